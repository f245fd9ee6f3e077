"""GPU fused attention (klear_jax/models/gpu_attention.py, gpu_flash.py) against the XLA path.

The Pallas Triton kernels run in interpret mode on CPU: values and gradients (dq, dk, dv)
are compared with ``xla_attention`` on packed rows, left / right padding, a fully padded row,
GQA and odd lengths. cuDNN cannot run on CPU: its layout translation (segment ids -> runs,
offsets) is checked by building the mask the packed layout implies and running dense
attention under it, values and gradients, against ``xla_attention``, and so is the run-time
switch to the fallback kernel for rows with more runs than the layout holds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klear_jax.models import gpu_attention as ga
from klear_jax.models.gpu_flash import BlockSizes, pallas_attention
from klear_jax.models.attention import attention_mask, positions_from_segment_ids, xla_attention
from klear_jax.sharding import make_mesh, use_mesh

BLOCKS16 = BlockSizes(block_q=16, block_k=16, block_q_dq=16, block_kv_dq=16,
                         block_q_dkv=16, block_kv_dkv=16)


def _batch(T, H, K, hd, dtype=jnp.float32, seed=0):
    """Row 0: three packed segments then right padding; row 1: left padding, one segment,
    right padding (a GPPO row); row 2: all padding (fully masked: zeros)."""
    r = np.random.RandomState(seed)
    q, k, v, w = (jnp.asarray(r.randn(3, T, n, hd), dtype) for n in (H, K, K, H))
    seg = np.zeros((3, T), np.int32)
    seg[0, :T // 3], seg[0, T // 3:2 * T // 3], seg[0, 2 * T // 3:T - 5] = 1, 2, 3
    seg[1, 7:T - 6] = 1
    seg = jnp.asarray(seg)
    return q, k, v, w, positions_from_segment_ids(seg), seg


def _close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, np.abs(want).max()))


def _value_and_grads(fn, q, k, v, w):
    """(out, (dq, dk, dv)) of sum(fn(q, k, v) * w)."""
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


# ------------------------------------------------------------------------------ Pallas
@pytest.mark.parametrize("T,H,K", [(45, 4, 2), (33, 8, 2)])
def test_pallas_values_and_gradients_match_xla(T, H, K):
    """GQA (G = 2, 4), odd T (padded to 48 inside, 3 x 16-blocks: causal block skipping in
    every kernel), packed / left- and right-padded / fully padded rows."""
    q, k, v, w, pos, seg = _batch(T, H, K, hd=16)
    out, grads = _value_and_grads(
        lambda q, k, v: ga.gpu_attention(q, k, v, pos, pos, seg, seg, impl="pallas",
                                         interpret=True, block_sizes=BLOCKS16), q, k, v, w)
    ref, ref_grads = _value_and_grads(
        lambda q, k, v: xla_attention(q, k, v, pos, pos, seg, seg), q, k, v, w)
    _close(out, ref, 1e-5)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == rg.shape, name
        _close(g, rg, 1e-5)
    pad = np.asarray(seg) == 0
    assert not np.asarray(out)[pad].any()            # padding rows are zeros
    assert not np.asarray(grads[0])[pad].any()       # and get no gradient
    assert not np.asarray(grads[1])[pad].any() and not np.asarray(grads[2])[pad].any()


def test_pallas_bfloat16_and_default_blocks():
    """bf16 inputs with the default (clipped) block sizes: one 64-block at T = 50."""
    q, k, v, w, pos, seg = _batch(50, 4, 2, hd=32, dtype=jnp.bfloat16, seed=1)
    out = jax.jit(lambda *a: ga.gpu_attention(*a, pos, pos, seg, seg, impl="pallas",
                                              interpret=True))(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    _close(out, xla_attention(f32(q), f32(k), f32(v), pos, pos, seg, seg), 2e-2)


@pytest.mark.parametrize("H,K", [(4, 2), (4, 1)])
def test_pallas_under_mesh_matches_unsharded(H, K):
    """fsdp=2 x tensor=2 on fake CPU devices: inside shard_map, heads split over 'tensor';
    (4, 1): the single kv head cannot split, so it is repeated for the head shards."""
    q, k, v, w, pos, seg = _batch(20, H, K, hd=16, seed=2)
    q, k, v, pos, seg = (x[:2] for x in (q, k, v, pos, seg))  # batch 2 over fsdp 2
    fn = lambda *a: ga.gpu_attention(*a, pos, pos, seg, seg, impl="pallas",  # noqa: E731
                                     interpret=True, block_sizes=BLOCKS16)
    with use_mesh(make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])):
        assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
        sharded = jax.jit(fn)(q, k, v)
    _close(sharded, xla_attention(q, k, v, pos, pos, seg, seg), 1e-5)


# ------------------------------------------------------------------------------ cuDNN layout
def test_segment_runs_layout():
    seg = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, 0],
                       [1, 1, 1, 1, 1, 1, 1, 1],
                       [3, 3, 0, 0, 4, 4, 4, 4]], jnp.int32)
    runs = jax.jit(ga.segment_runs, static_argnums=1)
    seqlens, offsets, overflow = runs(seg, 5)
    np.testing.assert_array_equal(seqlens, [[2, 3, 2, 1, -1], [8, -1, -1, -1, -1],
                                            [2, 2, 4, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 2, 5, 7, -1, -1], [0, -1, -1, -1, -1, -1],
                                            [0, 2, 4, -1, -1, -1]])
    assert not np.asarray(overflow).any()
    # the runs tile each row: every token is in exactly one run
    np.testing.assert_array_equal(np.where(seqlens > 0, seqlens, 0).sum(1), [8, 8, 8])
    # too many runs for the layout: flagged (that shard takes the fallback kernel)
    _, _, overflow = runs(seg, 3)
    np.testing.assert_array_equal(overflow, [True, False, False])
    # at least 2 slots per row (jax's packed path)
    assert runs(seg, 1)[0].shape == (3, 2)


def packed_causal_mask(seqlens, offsets, T: int):
    """bool [B, T, T]: what cuDNN's packed layout with a causal mask allows, from
    ``segment_runs`` output: t and s in the same run and s <= t. (A reference for reading the
    layout; the kernel never builds it.)"""
    idx = jnp.arange(T)
    M = seqlens.shape[1]
    lo = offsets[:, :M, None]  # [B, M, 1]
    hi = lo + seqlens[:, :, None]
    inside = (idx[None, None, :] >= lo) & (idx[None, None, :] < hi) & (seqlens[:, :, None] > 0)
    same = jnp.einsum("bmt,bms->bts", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
    return same & (idx[None, None, :] <= idx[None, :, None])


def _dense_packed(q, k, v, q_runs, kv_runs):
    """What cuDNN computes over ``segment_runs``' layout: causal attention inside each run
    (padding runs too). Dense float32 under ``packed_causal_mask``; GQA by grouping q heads.
    A reference for the layout, in place of the kernel (which needs a GPU)."""
    B, T, H, hd = q.shape
    K = k.shape[2]
    mask = packed_causal_mask(*q_runs, T)[:, None, None]  # [B, 1, 1, T, S]
    qg = q.reshape(B, T, K, H // K, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision="highest") * hd ** -0.5
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", p, v, precision="highest").reshape(B, T, H, hd)


def test_packed_layout_mask_is_the_xla_rule():
    """Runs + causal inside each run, restricted to non-padding query rows, is exactly
    ``attention_mask`` for packed / padded rows."""
    *_, pos, seg = _batch(45, 4, 2, hd=8)

    @jax.jit
    def masks(pos, seg):
        seqlens, offsets, _ = ga.segment_runs(seg, 8)
        packed = packed_causal_mask(seqlens, offsets, 45) & (seg != 0)[:, :, None]
        return packed, attention_mask(pos, pos, seg, seg)
    packed, rule = masks(pos, seg)
    np.testing.assert_array_equal(packed, rule)


@pytest.mark.parametrize("max_segments,expect", [(8, "packed"), (3, "fallback")])
def test_cudnn_layout_values_and_gradients_match_xla(max_segments, expect):
    """Attention under the packed layout (padding runs attending among themselves, zeroed
    after) has the XLA path's values and gradients, padding rows' included. Row 0 has 4
    runs: with 3 slots per row the shard takes the fallback (here the Pallas kernel)."""
    q, k, v, w, pos, seg = _batch(45, 4, 2, hd=16, seed=3)

    def fallback(*a):
        return pallas_attention(*a, block_sizes=BLOCKS16, interpret=True)

    def fn(q, k, v):
        return ga.packed_or_fallback(q, k, v, seg, seg, max_segments, _dense_packed, fallback)
    out, grads = _value_and_grads(fn, q, k, v, w)
    ref, ref_grads = _value_and_grads(
        lambda q, k, v: xla_attention(q, k, v, pos, pos, seg, seg), q, k, v, w)
    _close(out, ref, 1e-5)
    for g, rg in zip(grads, ref_grads):
        _close(g, rg, 1e-5)

    # which branch ran: each returns ones when it is the expected one (row 0 is not padding)
    def mark(name):
        return lambda q, *a: jnp.full(q.shape, float(name == expect), q.dtype)
    picked = jax.jit(lambda q, k, v: ga.packed_or_fallback(
        q, k, v, seg, seg, max_segments, mark("packed"), mark("fallback")))(q, k, v)
    assert float(picked[0, 0, 0, 0]) == 1.0


# ------------------------------------------------------------------------------ choosing
def test_supports_and_choose_on_cpu():
    q = jax.ShapeDtypeStruct((2, 64, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 64, 2, 128), jnp.bfloat16)
    cpu = jax.devices("cpu")[0]
    assert "GPU" in ga.supports("pallas", q, k, device=cpu)
    assert ga.supports("pallas", q, k, device=cpu, interpret=True) is None
    assert "CUDA GPU" in ga.supports("cudnn", q, k, device=cpu)
    assert "unknown" in ga.supports("flash3", q, k, device=cpu)
    impl, why = ga.choose(q, k, device=cpu, interpret=True)
    assert impl == "pallas" and set(why) == {"cudnn"}
    impl, why = ga.choose(q, k, device=cpu)
    assert impl is None and set(why) == set(ga.IMPLS)
    assert all("\n" not in r for r in why.values())  # one-line reasons for the warning
    # decode / cached attention is not a training row
    one = jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16)
    assert "T == S" in ga.supports("pallas", one, k, device=cpu, interpret=True)
    odd = jax.ShapeDtypeStruct((2, 64, 3, 128), jnp.bfloat16)
    assert "multiple" in ga.supports("pallas", q, odd, device=cpu, interpret=True)
    with pytest.raises(ValueError, match="unknown"):
        ga.gpu_attention(q, k, k, None, None, jnp.ones((2, 64)), jnp.ones((2, 64)), impl="x")


H100 = dict(platform="gpu", platform_version="cuda 12080", compute_capability=(9, 0),
            cudnn_version=90800, jax_version=(0, 11))


@pytest.mark.parametrize("change,dtype,shapes,expect", [
    ({}, jnp.bfloat16, None, None),
    ({}, jnp.float16, None, None),
    ({}, jnp.float32, None, "bfloat16 / float16"),
    ({}, jnp.bfloat16, ((1, 8, 4, 96 + 4), (1, 8, 2, 100)), "multiple of 8"),
    ({"compute_capability": (8, 0)}, jnp.bfloat16, None, "compute capability >= 9.0"),
    ({"cudnn_version": 90500}, jnp.bfloat16, None, "cuDNN >= 9.6"),
    ({"jax_version": (0, 10)}, jnp.bfloat16, None, "jax >= 0.11"),
    ({"jax_version": (0, 10)}, jnp.bfloat16, ((1, 8, 4, 128), (1, 8, 4, 128)), None),  # MHA
    ({"platform_version": "rocm 60300"}, jnp.bfloat16, None, "CUDA GPU"),
])
def test_cudnn_reason(change, dtype, shapes, expect):
    q_shape, k_shape = shapes or ((1, 8, 32, 128), (1, 8, 8, 128))
    reason = ga.cudnn_reason(q_shape, k_shape, dtype, **{**H100, **change})
    if expect is None:
        assert reason is None
    else:
        assert expect in reason and "\n" not in reason
