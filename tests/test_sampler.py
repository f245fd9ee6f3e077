"""Sampler: greedy vs full forward, logprobs vs the trainer's recomputation, stops, filters,
seeding, n samples, sharded decoding, stop strings, validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klear_jax import sampling_utils as su
from klear_jax import sharding as shd
from klear_jax.models import ModelConfig, create_model, param_shardings
from klear_jax.models.logprobs import chunked_token_logprobs
from klear_jax.sampler import SampleOutput, Sampler, SamplingParams
from sample_helpers import sequences

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
                                                          30, 31, 32, 33, 34, 35, 36, 37]]
M = 8


@pytest.fixture(scope="module")
def model():
    m = create_model(CFG, seed=0)
    # Random init gives near-uniform logits; a larger unembedding makes argmax margins
    # clear of float rounding (cache vs no-cache) so greedy comparisons are meaningful.
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * 20.0
    return m


@pytest.fixture(scope="module")
def split(model):
    return nnx.split(model)


@pytest.fixture(scope="module")
def sampler(split):
    return Sampler(split[0], pad_id=0, max_prompt_len=64)


@pytest.fixture(scope="module")
def greedy_out(sampler, split):
    return sampler.generate(split[1], PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=M), 0)


@nnx.jit
def _full_logits(m, ids):
    return m(ids)


def reference_greedy(model, prompts, steps, penalty=1.0):
    """Step-by-step argmax of the full forward (no cache). Rows are right-padded to a fixed
    width: causal attention makes the padding after a row's last token irrelevant."""
    width = max(map(len, prompts)) + steps
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        ids = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
        logits = np.asarray(_full_logits(model, jnp.asarray(ids)))
        for i, s in enumerate(seqs):
            lg = logits[i, len(s) - 1].copy()
            if penalty != 1.0:
                seen = np.unique(s)
                lg[seen] = np.where(lg[seen] > 0, lg[seen] / penalty, lg[seen] * penalty)
            s.append(int(np.argmax(lg)))
    return np.asarray([s[len(p):] for s, p in zip(seqs, prompts)], np.int32)


@nnx.jit(static_argnums=3)
def _recompute(m, ids, seg, temperature):
    h, _ = m.hidden_states(ids[:, :-1], segment_ids=seg[:, :-1])
    lp, _ = chunked_token_logprobs(h, m.unembed_matrix(), ids[:, 1:], chunk_size=8,
                                   return_entropy=False, temperature=temperature)
    return lp, m.logits(h)


def trainer_logprobs(model, out: SampleOutput, temperature=1.0):
    """The RL trainer's recomputation on prompt + response: logprobs [N, P + M] aligned so
    that entry t is log p(input_ids[t] | input_ids[:t]), and raw logits [N, P + M - 1, V]."""
    seq = sequences(out)
    lp, logits = _recompute(model, jnp.asarray(seq["input_ids"]), jnp.asarray(seq["segment_ids"]),
                            float(temperature))
    lp = np.concatenate([np.zeros((lp.shape[0], 1), np.float32), np.asarray(lp)], 1)
    return lp, np.asarray(logits), seq


# --------------------------------------------------------------------------- correctness
def test_greedy_matches_full_forward_argmax(model, greedy_out):
    ref = reference_greedy(model, PROMPTS, M)
    np.testing.assert_array_equal(greedy_out.tokens, ref)
    assert greedy_out.tokens.dtype == np.int32 and greedy_out.tokens.shape == (4, M)
    np.testing.assert_array_equal(greedy_out.lengths, M)
    assert greedy_out.truncated.all()
    np.testing.assert_array_equal(greedy_out.prompt_lengths, [3, 7, 1, 18])
    assert greedy_out.prompt_tokens.shape == (4, 32)  # bucket: next power of two >= 18


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=20),
                                dict(temperature=0.0)])
def test_logprobs_equal_trainer_recomputation(model, split, sampler, kw):
    params = SamplingParams(max_new_tokens=M, stop_token_ids=(7, 9), **kw)
    out = sampler.generate(split[1], PROMPTS, params, seed=3)
    t = kw["temperature"] if kw["temperature"] > 0 else 1.0
    lp, logits, seq = trainer_logprobs(model, out, t)
    mask = seq["response_mask"] > 0
    assert mask.sum() == out.lengths.sum() > 0
    np.testing.assert_allclose(seq["old_logprobs"][mask], lp[mask], atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(out.logprobs[np.arange(M)[None] >= out.lengths[:, None]], 0.0)
    if "top_k" in kw:  # every sampled token lies inside the top-k and the top-p nucleus
        P = out.prompt_tokens.shape[1]
        for i in range(len(PROMPTS)):
            for s in range(out.lengths[i]):
                lg = logits[i, P + s - 1] / t
                order = np.argsort(-lg)
                probs = np.exp(lg[order] - lg.max())
                probs /= probs.sum()
                nucleus = order[:min(kw["top_k"], int(np.sum(np.cumsum(probs) - probs < kw["top_p"])))]
                assert out.tokens[i, s] in nucleus
    if kw["temperature"] == 1.0:  # the model's own token_logprobs (temperature 1) agrees too
        ids = jnp.asarray(seq["input_ids"])
        own, _ = model.token_logprobs(ids[:, :-1], ids[:, 1:],
                                      segment_ids=jnp.asarray(seq["segment_ids"][:, :-1]))
        np.testing.assert_allclose(seq["old_logprobs"][mask], np.asarray(own)[mask[:, 1:]],
                                   atol=1e-4)


def test_stop_token_sets_lengths_and_truncation(split, sampler, greedy_out):
    stop = int(greedy_out.tokens[0, 3])  # row 0 emits it at step 3 (maybe earlier too)
    first = [int(np.argmax(r == stop)) + 1 if (r == stop).any() else M for r in greedy_out.tokens]
    out = sampler.generate(split[1], PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=M,
                                                             stop_token_ids=(stop,)), 0)
    np.testing.assert_array_equal(out.lengths, first)
    assert out.lengths[0] <= 4
    for i, L in enumerate(first):
        np.testing.assert_array_equal(out.tokens[i, :L], greedy_out.tokens[i, :L])
        np.testing.assert_array_equal(out.tokens[i, L:], 0)  # pad after the stop token
        assert out.truncated[i] == (stop not in greedy_out.tokens[i])


def test_early_exit_when_all_rows_stop(split, sampler, greedy_out):
    """Every row's first token is a stop token: the decode loop runs no step at all."""
    stops = tuple(sorted(set(greedy_out.tokens[:, 0].tolist())))
    out = sampler.generate(split[1], PROMPTS, SamplingParams(
        temperature=0.0, max_new_tokens=M, stop_token_ids=stops), 0)
    np.testing.assert_array_equal(out.lengths, 1)
    assert not out.truncated.any() and sampler.last_decode_steps == 1
    np.testing.assert_array_equal(out.tokens[:, 1:], 0)
    np.testing.assert_array_equal(out.logprobs[:, 1:], 0.0)


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6)])
def test_top_k_one_and_tiny_top_p_equal_greedy(split, sampler, greedy_out, kw):
    out = sampler.generate(split[1], PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=M,
                                                             **kw), 11)
    np.testing.assert_array_equal(out.tokens, greedy_out.tokens)


def test_repetition_penalty_greedy_matches_reference(model, split, sampler):
    out = sampler.generate(split[1], PROMPTS, SamplingParams(
        temperature=0.0, repetition_penalty=1.8, max_new_tokens=M), 0)
    np.testing.assert_array_equal(out.tokens, reference_greedy(model, PROMPTS, M, penalty=1.8))


def test_filters_match_transformers_processors():
    import torch
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    rng = np.random.RandomState(0)
    logits = rng.randn(3, 50).astype(np.float32) * 3
    seen = rng.randint(0, 50, (3, 6))
    presence = np.zeros((3, 50), bool)
    presence[np.arange(3)[:, None], seen] = True
    ours = su.apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(presence), 1.3)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(seen), torch.tensor(logits))
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)
    for k, p in [(5, 1.0), (0, 0.8), (10, 0.5), (0, 0.05)]:
        t = torch.tensor(logits)
        if k:
            t = TopKLogitsWarper(k)(None, t)
        if p < 1:
            t = TopPLogitsWarper(p)(None, t)
        kept_ref = np.isfinite(t.numpy())
        vals, idx = jax.lax.top_k(jnp.asarray(logits), k or 50)
        vals = su.truncate_sorted(vals, jnp.float32(p), p < 1)
        kept = np.zeros_like(kept_ref)
        np.put_along_axis(kept, np.asarray(idx), np.isfinite(np.asarray(vals)), axis=1)
        np.testing.assert_array_equal(kept, kept_ref, err_msg=f"top_k={k} top_p={p}")


# --------------------------------------------------------------------------- seeding, n
def test_seeded_reproducible_and_independent_of_batching(split, sampler):
    params = SamplingParams(temperature=1.0, max_new_tokens=M, stop_token_ids=(7, 9))
    a = sampler.generate(split[1], PROMPTS, params, seed=42)
    b = sampler.generate(split[1], PROMPTS, params, seed=42)
    c = sampler.generate(split[1], PROMPTS, params, seed=43)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).any()
    order = [2, 0, 3, 1]  # a row's samples do not depend on its position in the batch
    shuffled = sampler.generate(split[1], [PROMPTS[i] for i in order], params, seed=42)
    np.testing.assert_array_equal(shuffled.tokens, a.tokens[order])


def test_n_samples_contiguous_and_equal_to_duplicated_prompts(split, sampler):
    params = SamplingParams(temperature=1.0, max_new_tokens=M, stop_token_ids=(7, 9), n=2)
    prompts = [PROMPTS[1], PROMPTS[3]]
    out = sampler.generate(split[1], prompts, params, seed=1)
    np.testing.assert_array_equal(out.prompt_index, [0, 0, 1, 1])
    assert out.tokens.shape == (4, M)
    for r in range(4):
        p = prompts[r // 2]
        np.testing.assert_array_equal(out.prompt_tokens[r, -len(p):], p)
        assert out.prompt_lengths[r] == len(p)
    assert (out.tokens[0] != out.tokens[1]).any() and (out.tokens[2] != out.tokens[3]).any()
    # n samples == the prompt repeated n times (sample j <-> j-th occurrence)
    dup = sampler.generate(split[1], [prompts[0]] * 2 + [prompts[1]] * 2,
                           dataclasses.replace(params, n=1), seed=1)
    np.testing.assert_array_equal(out.tokens, dup.tokens)


# --------------------------------------------------------------------------- mesh
def test_sharded_greedy_equals_unsharded(model, greedy_out):
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, param_shardings(state, mesh))
    sampler = Sampler(graphdef, mesh=mesh, pad_id=0, max_prompt_len=64)
    assert sampler.batch_multiple == 4
    out = sampler.generate(state, PROMPTS[:3], SamplingParams(temperature=0.0, max_new_tokens=M), 0)
    np.testing.assert_array_equal(out.tokens, greedy_out.tokens[:3])
    np.testing.assert_allclose(out.logprobs, greedy_out.logprobs[:3], atol=1e-5)


# --------------------------------------------------------------------------- host side
def test_compiles_once_per_bucket(split, sampler, greedy_out):
    params = SamplingParams(temperature=0.0, max_new_tokens=M, stop_token_ids=(1, 2, 3))
    sampler.generate(split[1], [[1] * 17, [2] * 20, [3] * 30, [4] * 32], params, 0)  # bucket 32
    greedy = [s for s, _, _ in sampler.compiled_shapes if s.greedy and not s.use_penalty]
    assert len(greedy) == 1
    prefill, decode = sampler._functions(greedy[0])
    assert prefill._cache_size() == 1 and decode._cache_size() == 1
    assert su.bucket_length(17, 512) == 32 and su.bucket_length(3, 512) == 16
    assert su.bucket_length(600, 512) == 512


def test_stop_strings_cut_text(tmp_path):
    """decode_text cuts after a stop string (token-level cuts while decoding: the engine,
    tests/test_engine.py)."""
    from klear_jax.data.tokenizer import train_tokenizer
    tok = train_tokenizer(["the answer is 42 </answer> and more text", "hello world"] * 20,
                          vocab_size=300, out_dir=str(tmp_path / "tok"))
    ids = tok("the answer is 42 </answer> and more text", add_special_tokens=False)["input_ids"]
    Mx = len(ids) + 3
    tokens = np.zeros((2, Mx), np.int32)
    tokens[0, :len(ids)] = ids
    tokens[1, :2] = ids[:2]
    out = SampleOutput(tokens=tokens, logprobs=np.full((2, Mx), -1.0, np.float32),
                       lengths=np.array([len(ids), 2], np.int32), truncated=np.array([True, True]),
                       prompt_index=np.arange(2, dtype=np.int32),
                       prompt_tokens=np.ones((2, 4), np.int32),
                       prompt_lengths=np.array([4, 4], np.int32))
    texts = Sampler.decode_text(out, tok, stop_strings=("</answer>",))
    assert texts[0] == "the answer is 42 </answer>" and texts[1] == tok.decode(ids[:2])


def test_bad_inputs_raise_clear_errors(split, sampler):
    ok = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[1\].*max_prompt_len=64"):
        sampler.generate(split[1], [[1], list(range(1, 70))], ok, 0)
    with pytest.raises(ValueError, match=r"prompts\[0\].*outside \[0, 128\)"):
        sampler.generate(split[1], [[1, 500]], ok, 0)
    with pytest.raises(ValueError, match=r"prompts\[0\].*non-empty"):
        sampler.generate(split[1], [[]], ok, 0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        sampler.generate(split[1], [[1]], SamplingParams(stop_token_ids=(999,)), 0)
    with pytest.raises(ValueError, match="stop_strings.*Engine"):
        sampler.generate(split[1], [[1]], SamplingParams(stop_strings=("x",)), 0)
    for bad in [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(n=0),
                dict(max_new_tokens=0), dict(repetition_penalty=0.0)]:
        with pytest.raises(ValueError, match="SamplingParams." + next(iter(bad))):
            SamplingParams(**bad)
