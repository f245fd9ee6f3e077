"""Rollout engine: samples and log-probs equal the static sampler's (float32), whatever the
slots / chunk / companions; budgets, stops, n, filters; sharded == unsharded; stop strings
while decoding; the ragged decode attention against the masked full softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klear_jax import sampling_utils as su
from klear_jax import sharding as shd
from klear_jax.engine import Engine
from klear_jax.models import ModelConfig, create_model, param_shardings
from klear_jax.models import attention as A
from klear_jax.models.decode_attention import ragged_decode_attention
from klear_jax.sampler import Sampler, SamplingParams

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], list(range(20, 38)), [40, 41]]
M = 20
# Log-probs: float32, |engine - static| <= 1e-5. Not bitwise: the two sum attention over
# different lengths and orders (static: one softmax over the whole P + M cache; engine:
# prefill over the prompt bucket, then 128-key blocks folded flash-style) and run their
# matmuls at different row counts, so logits differ in the last bits (~1e-6 here, where the
# unembedding is scaled x20). Tokens are equal: a flip needs two Gumbel-perturbed logits
# within ~1e-6 of each other.
ATOL = 1e-5
# Everything on at once (each filter alone is checked against references in test_sampler):
# the RL setting (T = 1, stop tokens) and the paper's eval settings (T 0.6, top-p 0.95,
# top-k 20, repetition penalty 1.05, here 1.3 to matter in 20 tokens).
SETTINGS = {
    "rl": SamplingParams(temperature=1.0, max_new_tokens=M, stop_token_ids=(7, 9), n=3),
    "eval": SamplingParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.3,
                           max_new_tokens=M, stop_token_ids=(7, 9, 11), n=2),
}


@pytest.fixture(scope="module")
def split():
    m = create_model(CFG, seed=0)
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * 20.0  # clear margins, as in test_sampler
    return nnx.split(m)


@pytest.fixture(scope="module")
def static(split):
    return Sampler(split[0], pad_id=0, max_prompt_len=64)


@pytest.fixture(scope="module")
def engine(split):
    # 4 slots for 15 / 10 samples: every slot is refilled several times; 2 insert rows
    return Engine(split[0], pad_id=0, max_prompt_len=64, slots=4, chunk=3, insert_rows=2)


def budgets_for(n_samples, seed=0):
    """A stop schedule: per-sample caps in [1, M]."""
    return np.random.default_rng(seed).integers(1, M + 1, n_samples)


def assert_same(a, b):
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.truncated, b.truncated)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_engine_equals_static_sampler(split, static, engine, name):
    params = SETTINGS[name]
    N = len(PROMPTS) * params.n
    budgets = budgets_for(N) if name == "rl" else None
    ref = static.generate(split[1], PROMPTS, params, seed=5, budgets=budgets)
    seen = {}
    out = engine.generate(split[1], PROMPTS, params, seed=5, budgets=budgets,
                          on_finish=lambda fs: [seen.setdefault(f.index, f) for f in fs])
    assert_same(out, ref)
    np.testing.assert_array_equal(out.prompt_tokens, ref.prompt_tokens)
    np.testing.assert_array_equal(out.prompt_index, ref.prompt_index)
    assert out.lengths.min() >= 1 and (ref.lengths < M).any() and ref.truncated.any()
    stopped = ~ref.truncated
    assert np.isin(ref.tokens[stopped, ref.lengths[stopped] - 1], params.stop_token_ids).all()
    if budgets is not None:
        assert (ref.lengths <= budgets).all()
        assert (ref.lengths[ref.truncated] == budgets[ref.truncated]).all()
    # every sample handed over once, with its row's data
    assert sorted(seen) == list(range(N))
    for i, f in seen.items():
        L = out.lengths[i]
        assert f.prompt_index == i // params.n and f.truncated == out.truncated[i]
        np.testing.assert_array_equal(f.tokens, out.tokens[i, :L])
        np.testing.assert_array_equal(f.logprobs, out.logprobs[i, :L])
    st = engine.last_stats
    assert st["useful_slot_steps"] == out.lengths.sum() - N  # first tokens come from inserts
    assert 0 < st["slot_utilisation"] <= 1 and st["inserts"] >= N / 2


def test_samples_depend_on_seed_prompt_and_copy_only(split, engine):
    """Shuffled prompts, other slot counts / chunk / insert rows: same sample per (prompt,
    copy)."""
    params = SETTINGS["rl"]
    n = params.n
    a = engine.generate(split[1], PROMPTS, params, seed=9)
    order = [3, 0, 4, 2, 1]
    other = Engine(split[0], pad_id=0, max_prompt_len=64, slots=7, chunk=5, insert_rows=3)
    b = other.generate(split[1], [PROMPTS[i] for i in order], params, seed=9)
    rows = np.asarray([i * n + j for i in order for j in range(n)])
    np.testing.assert_array_equal(b.tokens, a.tokens[rows])
    np.testing.assert_allclose(b.logprobs, a.logprobs[rows], atol=ATOL, rtol=0)
    c = engine.generate(split[1], PROMPTS, params, seed=10)
    assert (c.tokens != a.tokens).any()


def test_sharded_equals_unsharded(split, engine):
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    graphdef, state = split
    sharded = jax.device_put(state, param_shardings(state, mesh))
    eng = Engine(graphdef, mesh=mesh, pad_id=0, max_prompt_len=64, slots=4, chunk=3,
                 insert_rows=2)
    params = SETTINGS["rl"]
    out = eng.generate(sharded, PROMPTS, params, seed=5)
    assert_same(out, engine.generate(state, PROMPTS, params, seed=5))


def test_stop_strings_end_samples_while_decoding(tmp_path, split, engine):
    from klear_jax.data.tokenizer import train_tokenizer
    tok = train_tokenizer(["the answer is 42 </answer> and more text", "hello world"] * 20,
                          vocab_size=300, out_dir=str(tmp_path / "tok"))
    params = SamplingParams(temperature=1.0, max_new_tokens=M, n=2)
    free = engine.generate(split[1], PROMPTS, params, seed=1)
    texts = [tok.decode(su.response_ids(free, i)) for i in range(len(free.lengths))]
    stop = next(t[len(t) // 2:len(t) // 2 + 2] for t in texts if len(t) > 8)  # 2 characters
    eng = Engine(split[0], pad_id=0, max_prompt_len=64, slots=4, chunk=3, insert_rows=2,
                 tokenizer=tok)
    out = eng.generate(split[1], PROMPTS, SamplingParams(
        temperature=1.0, max_new_tokens=M, n=2, stop_strings=(stop,)), seed=1)
    assert out.stop_string_hit.any()
    for i in range(len(out.lengths)):
        L = out.lengths[i]
        np.testing.assert_array_equal(out.tokens[i, :L], free.tokens[i, :L])  # same draws
        if out.stop_string_hit[i]:
            assert stop in tok.decode(out.tokens[i, :L].tolist())
            assert stop not in tok.decode(out.tokens[i, :L - 1].tolist())
            assert not out.truncated[i] and (out.tokens[i, L:] == 0).all()
        else:
            assert stop not in texts[i] and L == free.lengths[i]
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(split[1], PROMPTS, SamplingParams(stop_strings=("x",)), seed=0)


def test_stop_string_cut_window(tmp_path):
    from klear_jax.data.tokenizer import train_tokenizer
    tok = train_tokenizer(["the answer is 42 </answer> and more text"] * 20, vocab_size=300,
                          out_dir=str(tmp_path / "tok"))
    ids = tok("the answer is 42 </answer> and more text", add_special_tokens=False)["input_ids"]
    cut = su.stop_string_cut(tok, ids, ("</answer>",))
    assert tok.decode(ids[:cut]).endswith("</answer>") and "</answer>" not in tok.decode(ids[:cut - 1])
    assert su.stop_string_cut(tok, ids, ("</answer>",), checked=cut - 1) == cut
    assert su.stop_string_cut(tok, ids[:cut - 1], ("</answer>",)) == 0
    assert su.stop_string_cut(tok, ids, ("nowhere",)) == 0


def test_ragged_decode_attention_equals_masked_softmax():
    B, K, G, hd, S = 5, 2, 3, 16, 64
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal(s), jnp.float32)
               for s in ((B, 1, K * G, hd), (B, K, hd, S), (B, K, S, hd)))
    lengths = jnp.asarray([0, 1, 17, 64, 33], jnp.int32)
    seg = (jnp.arange(S)[None] < lengths[:, None]).astype(jnp.int32)
    ref = A.head_major_attention(q, k, v, jnp.full((B, 1), S), jnp.zeros((B, S), jnp.int32),
                                 jnp.ones((B, 1), jnp.int32), seg, keys_transposed=True)
    for block, pairs in ((16, None), (8, 2), (64, 1)):
        out = ragged_decode_attention(q, k, v, lengths, block=block, pairs=pairs)
        np.testing.assert_allclose(out, ref, atol=1e-6)
        np.testing.assert_array_equal(out[0], 0.0)  # an empty slot reads nothing


def test_bad_inputs(split, engine):
    with pytest.raises(ValueError, match="budgets"):
        engine.generate(split[1], PROMPTS, SETTINGS["rl"], 0, budgets=[M + 1] * 15)
    with pytest.raises(ValueError, match="slots"):
        Engine(split[0], slots=0)
    with pytest.raises(ValueError, match="stop_strings"):
        SamplingParams(stop_strings="</answer>")
