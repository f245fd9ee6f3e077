"""Qwen decoder: masking, packing, KV cache, remat, dtypes, log-probs, config validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klear_jax.models import ModelConfig, Qwen, create_model, init_cache
from klear_jax.models import cpu_kernels
from klear_jax.models.attention import positions_from_segment_ids, xla_attention

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=24, rope_theta=10000.0)


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=0)


def with_config(model, cfg):
    """The same parameters under another config (dtype, remat, attention impl)."""
    return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))),
                     nnx.state(model))


@nnx.jit
def fwd(m, ids, positions=None, segment_ids=None):
    return m(ids, positions, segment_ids)


def _ids(B, T, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, CFG.vocab_size, (B, T)), jnp.int32)


# --------------------------------------------------------------------------- attention
def test_fully_masked_rows_are_zero_and_finite():
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(1, 4, 4, 8), jnp.float32)
    k = jnp.asarray(rng.randn(1, 4, 2, 8), jnp.float32)
    pos = jnp.arange(4)[None]
    seg = jnp.asarray([[0, 0, 1, 1]])
    out = xla_attention(q, k, k, pos, pos, seg, seg)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[:, :2]), 0.0)
    g = jax.grad(lambda q: jnp.sum(xla_attention(q, k, k, pos, pos, seg, seg) ** 2))(q)
    assert np.isfinite(np.asarray(g)).all()


def test_attention_matches_naive_gqa():
    rng = np.random.RandomState(1)
    B, T, H, K, hd = 2, 5, 6, 2, 4
    q, k, v = (rng.randn(B, T, n, hd).astype(np.float32) for n in (H, K, K))
    pos = np.tile(np.arange(T), (B, 1))
    seg = np.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 1]])
    out = np.asarray(xla_attention(*map(jnp.asarray, (q, k, v, pos, pos, seg, seg))))
    ref = np.zeros_like(out)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                ok = [s for s in range(T) if s <= t and seg[b, s] == seg[b, t]]
                sc = np.array([q[b, t, h] @ k[b, s, h // 3] for s in ok]) / np.sqrt(hd)
                p = np.exp(sc - sc.max())
                ref[b, t, h] = (p / p.sum()) @ v[b, ok, h // 3]
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("query_block", [None, 4])
def test_recompute_backward_matches_autodiff(dtype, tol, query_block, monkeypatch):
    """The CPU recompute path's hand-written backward (and, with ``query_block``, its causal
    block skipping: 3 blocks of 4 queries) against autodiff of the plain path: GQA, packed
    segments, left and right padding, a fully masked row."""
    if query_block:
        monkeypatch.setattr(cpu_kernels, "MIN_QUERY_BLOCK", query_block)
    rng = np.random.RandomState(2)
    B, T, H, K, hd = 2, 12, 6, 2, 8
    q, k, v, cot = (jnp.asarray(rng.randn(B, T, n, hd), dtype) for n in (H, K, K, H))
    seg = jnp.asarray([[0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2], [1] * 9 + [0] * 3])
    pos = positions_from_segment_ids(seg)

    def loss(q, k, v, recompute):
        if recompute:
            out = cpu_kernels.recomputed_attention(q, k, v, pos, pos, seg, seg,
                                                   causal_by_index=True)
        else:
            out = xla_attention(q, k, v, pos, pos, seg, seg)
        assert out.dtype == dtype
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (ref_l, ref_g), (l, g) = grads(q, k, v, False), grads(q, k, v, True)
    np.testing.assert_allclose(float(l), float(ref_l), rtol=tol)
    for name, a, b in zip("qkv", g, ref_g):
        assert a.dtype == dtype, name
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=tol * scale, err_msg=f"d{name}")


def test_positions_from_segment_ids():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0], [0, 0, 1, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(positions_from_segment_ids(seg)),
                                  [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])


# --------------------------------------------------------------------------- model
def test_packed_equals_separate(model):
    a, b = _ids(1, 7, seed=1), _ids(1, 6, seed=2)
    packed = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], axis=1)
    seg = jnp.asarray([[1] * 7 + [2] * 6 + [0] * 3])
    pos = jnp.asarray([list(range(7)) + list(range(6)) + [0] * 3])
    out = fwd(model, packed, pos, seg)
    np.testing.assert_allclose(np.asarray(out[:, :7]), np.asarray(fwd(model, a)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[:, 7:13]), np.asarray(fwd(model, b)), atol=1e-5)
    # default positions are derived per segment
    np.testing.assert_allclose(np.asarray(fwd(model, packed, None, seg)), np.asarray(out),
                               atol=1e-6)


@pytest.mark.parametrize("fresh", [False, True])
def test_kv_cache_prefill_and_steps_match_full_forward(model, fresh):
    """Row 0: a 5-token prompt left-padded by 3; row 1: an 8-token prompt; then 4 steps.
    ``fresh``: the prefill attends within the prompt (``fresh_cache``), not over the cache."""
    B, P, steps = 2, 8, 4
    full = _ids(B, P + steps, seed=3)
    seg = jnp.ones((B, P + steps), jnp.int32).at[0, :3].set(0)
    ref = fwd(model, full[:1, 3:])[0]  # row 0 run alone, unpadded
    ref1 = fwd(model, full[1:])[0]
    cache = init_cache(CFG, B, P + steps + 2)
    step = nnx.jit(lambda m, ids, s, c, f=False: m.hidden_states(ids, segment_ids=s, cache=c,
                                                                 fresh_cache=f),
                   static_argnums=4)
    h, cache = step(model, full[:, :P], seg[:, :P], cache, fresh)
    outs = [model.logits(h)]
    for t in range(P, P + steps):
        h, cache = step(model, full[:, t:t + 1], seg[:, t:t + 1], cache)
        outs.append(model.logits(h))
    got = jnp.concatenate(outs, axis=1)
    assert int(cache["index"]) == P + steps
    np.testing.assert_allclose(np.asarray(got[0, 3:]), np.asarray(ref), atol=2e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref1), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(cache["positions"][0, 3:P + steps]), np.arange(9))


def test_remat_policies_same_loss_and_grads(model):
    ids = _ids(2, 9, seed=4)
    state = nnx.state(model)

    def loss(state, policy):
        m = with_config(nnx.merge(nnx.graphdef(model), state), CFG.replace(remat_policy=policy))
        lp, _ = m.token_logprobs(ids[:, :-1], ids[:, 1:])
        return -jnp.mean(lp)

    vg = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ref_l, ref_g = vg(state, "none")
    for path, g in jax.tree_util.tree_flatten_with_path(ref_g)[0]:  # every param gets a gradient
        assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)
    for policy in ("full",):
        l, g = vg(state, policy)
        np.testing.assert_allclose(float(l), float(ref_l), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_unrolled_layers_equal_scan(model):
    ids = _ids(2, 9, seed=9)
    unrolled = with_config(model, CFG.replace(scan_layers=False))
    np.testing.assert_allclose(np.asarray(fwd(unrolled, ids)), np.asarray(fwd(model, ids)),
                               atol=1e-6)


def test_token_logprobs_match_log_softmax(model):
    ids = _ids(2, 11, seed=5)
    tgt = _ids(2, 11, seed=6)
    lp, ent = nnx.jit(lambda m, i, t: m.token_logprobs(i, t, return_entropy=True))(model, ids, tgt)
    logits = fwd(model, ids)
    ref = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(jnp.take_along_axis(
        ref, tgt[..., None], -1)[..., 0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(-jnp.sum(jnp.exp(ref) * ref, -1)),
                               atol=1e-5)
    assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32


def test_tied_embeddings_share_weights():
    m = create_model(CFG.replace(tie_word_embeddings=True))
    assert not hasattr(m, "lm_head")
    np.testing.assert_array_equal(np.asarray(m.unembed_matrix()),
                                  np.asarray(m.embed.embedding.get_value()).T)


def test_bfloat16_compute_close(model):
    m32 = model
    m16 = with_config(model, CFG.replace(dtype="bfloat16"))
    ids = _ids(2, 13, seed=7)
    a, b = np.asarray(fwd(m32, ids)), np.asarray(fwd(m16, ids))
    assert b.dtype == np.float32 and np.isfinite(b).all()
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max() + 1e-2
    cfg16 = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
    abstract = nnx.eval_shape(lambda: Qwen(cfg16, rngs=nnx.Rngs(0)))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(abstract)))
    mp = nnx.merge(nnx.graphdef(abstract),
                   jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
    c = np.asarray(fwd(mp, ids))
    assert np.isfinite(c).all() and np.abs(a - c).max() < 0.05 * np.abs(a).max() + 1e-2


def test_splash_path_matches_xla(model):
    pytest.importorskip("klear_jax.models.splash")
    m = with_config(model, CFG.replace(attention_impl="splash"))
    ids = _ids(1, 128, seed=8)
    seg = jnp.ones((1, 128), jnp.int32).at[0, 70:].set(2).at[0, 120:].set(0)
    a = fwd(model, ids, None, seg)
    b = fwd(m, ids, None, seg)
    np.testing.assert_allclose(np.asarray(b[:, :120]), np.asarray(a[:, :120]), atol=1e-4)


# --------------------------------------------------------------------------- config
def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig\.dtype.*float16"):
        CFG.replace(dtype="float16")
    with pytest.raises(ValueError, match=r"ModelConfig\.param_dtype"):
        CFG.replace(param_dtype="int8")
    with pytest.raises(ValueError, match=r"remat_policy"):
        CFG.replace(remat_policy="sometimes")
    with pytest.raises(ValueError, match=r"num_kv_heads"):
        CFG.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match=r"model_type 'llama'"):
        ModelConfig.from_hf_config({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(ValueError, match=r"missing required field 'vocab_size'"):
        ModelConfig.from_hf_config({"model_type": "qwen3", "hidden_size": 8,
                                    "num_attention_heads": 2})


def test_config_hf_round_trip_and_hashable():
    cfg = CFG.replace(rope_scaling={"factor": 2.5, "original_max_position_embeddings": 32768},
                      max_position_embeddings=81920)
    again = ModelConfig.from_hf_config(cfg.to_hf_config())
    assert again == cfg
    assert hash(again) == hash(cfg)
    q2 = ModelConfig.from_hf_config(CFG.replace(model_type="qwen2", qk_norm=False,
                                                qkv_bias=True).to_hf_config())
    assert q2.qkv_bias and not q2.qk_norm
