"""Splash attention (Pallas, interpret mode on CPU) equals plain masked attention: packed
segments, padding, GQA, T not a multiple of the block, gradients, and the shard_map path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klear_jax.models.splash import padded_length_and_blocks, splash_attention
from klear_jax.sharding import make_mesh, use_mesh


def _reference_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Plain float32 attention with the shared mask; fully masked rows -> 0."""
    B, T, H, hd = q.shape
    G = H // k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), G, axis=2)
    v = jnp.repeat(v.astype(jnp.float32), G, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k,
                   precision=jax.lax.Precision.HIGHEST) / np.sqrt(hd)
    mask = ((kv_pos[:, None, :] <= q_pos[:, :, None]) & (q_seg[:, :, None] == kv_seg[:, None, :])
            & (kv_seg[:, None, :] != 0))[:, None]
    s = jnp.where(mask, s, -1e30)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bhts,bshd->bthd", p, v, precision=jax.lax.Precision.HIGHEST)


def _packed_batch(B, T, H, K, hd, seed=0):
    """Row 0: three packed segments then padding; row 1: left padding then one segment."""
    r = np.random.RandomState(seed)
    q = jnp.asarray(r.randn(B, T, H, hd), jnp.float32)
    k = jnp.asarray(r.randn(B, T, K, hd), jnp.float32)
    v = jnp.asarray(r.randn(B, T, K, hd), jnp.float32)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    cuts = [0, T // 3, T // 3 + T // 4, T - 19, T]
    for i in range(3):
        seg[0, cuts[i]:cuts[i + 1]] = i + 1
        pos[0, cuts[i]:cuts[i + 1]] = np.arange(cuts[i + 1] - cuts[i])
    pos[0, cuts[3]:] = np.arange(T - cuts[3])
    if B > 1:
        lead = 23
        seg[1, lead:] = 1
        pos[1, :lead] = np.arange(lead)
        pos[1, lead:] = np.arange(T - lead)
    for b in range(2, B):
        seg[b] = 1
        pos[b] = np.arange(T)
    return q, k, v, jnp.asarray(pos), jnp.asarray(seg)


def _assert_close(out, ref, atol=1e-5):
    scale = float(jnp.abs(ref).max())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=atol * scale)


def _xla_attention():
    try:
        from klear_jax.models.attention import xla_attention
    except ImportError:  # the model's attention module is built in parallel
        return None
    return xla_attention


@pytest.mark.parametrize("H,K", [(4, 2), (4, 4), (4, 1)])
def test_forward_matches_reference(H, K):
    B, T, hd = 2, 256, 64
    q, k, v, pos, seg = _packed_batch(B, T, H, K, hd)
    out = jax.jit(lambda *a: splash_attention(*a, interpret=True, block_q=128, block_kv=128))(
        q, k, v, pos, pos, seg, seg)
    ref = _reference_attention(q, k, v, pos, pos, seg, seg)
    assert out.shape == (B, T, H, hd) and out.dtype == q.dtype
    _assert_close(out, ref)
    assert float(jnp.abs(out[0, T - 19:]).max()) == 0.0   # padding rows are zeros
    xla = _xla_attention()
    if xla is not None:
        _assert_close(out, xla(q, k, v, pos, pos, seg, seg))


def test_length_not_multiple_of_block_and_gradients():
    B, T, H, K, hd = 2, 200, 4, 2, 64    # 200 -> padded to 256 inside
    assert padded_length_and_blocks(200, 128, 128) == (256, 128, 128)
    assert padded_length_and_blocks(200, 512, 512) == (256, 256, 256)
    q, k, v, pos, seg = _packed_batch(B, T, H, K, hd, seed=1)
    w = jnp.asarray(np.random.RandomState(2).randn(B, T, H, hd), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(w * fn(q, k, v, pos, pos, seg, seg))

    splash = lambda *a: splash_attention(*a, interpret=True, block_q=128, block_kv=128)  # noqa
    out = jax.jit(splash)(q, k, v, pos, pos, seg, seg)
    _assert_close(out, _reference_attention(q, k, v, pos, pos, seg, seg))
    g = jax.jit(jax.grad(loss(splash), argnums=(0, 1, 2)))(q, k, v)
    rg = jax.grad(loss(_reference_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, rg):
        _assert_close(a, b, atol=1e-4)


def test_bfloat16_inputs():
    B, T, H, K, hd = 1, 128, 4, 2, 64
    q, k, v, pos, seg = _packed_batch(B, T, H, K, hd, seed=3)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = splash_attention(q, k, v, pos, pos, seg, seg, interpret=True, block_q=128,
                           block_kv=128)
    assert out.dtype == jnp.bfloat16
    _assert_close(out.astype(jnp.float32), _reference_attention(q, k, v, pos, pos, seg, seg),
                  atol=3e-2)


@pytest.mark.parametrize("H,K", [(4, 2), (8, 1)])
def test_sharded_matches_unsharded(H, K):
    """data=2 x fsdp=2 x tensor=2 on 8 fake devices; (8, 1): kv heads replicated over
    'tensor' while q heads are split."""
    B, T, hd = 4, 128, 64
    q, k, v, pos, seg = _packed_batch(B, T, H, K, hd, seed=4)
    fn = jax.jit(lambda *a: splash_attention(*a, interpret=True, block_q=128, block_kv=128))
    unsharded = fn(q, k, v, pos, pos, seg, seg)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with use_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda *a: splash_attention(*a, interpret=True, block_q=128,
                                                           block_kv=128))(q, k, v, pos, pos,
                                                                          seg, seg)
        assert "shard_map" in str(jaxpr)
        sharded = fn(q, k, v, pos, pos, seg, seg)
    _assert_close(sharded, unsharded, atol=1e-6)
    _assert_close(sharded, _reference_attention(q, k, v, pos, pos, seg, seg))


def test_kv_heads_not_divisible_by_head_shards():
    """H=4 over tensor=4 (one q head per shard) with K=2: each kv head is repeated."""
    B, T, H, K, hd = 2, 128, 4, 2, 64
    q, k, v, pos, seg = _packed_batch(B, T, H, K, hd, seed=5)
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    with use_mesh(mesh):
        out = jax.jit(lambda *a: splash_attention(*a, interpret=True, block_q=128,
                                                  block_kv=128))(q, k, v, pos, pos, seg, seg)
    _assert_close(out, _reference_attention(q, k, v, pos, pos, seg, seg))


def test_bad_inputs():
    q = jnp.zeros((1, 128, 4, 64))
    kv = jnp.zeros((1, 128, 3, 64))
    ids = jnp.zeros((1, 128), jnp.int32)
    with pytest.raises(ValueError, match="kv heads"):
        splash_attention(q, kv, kv, ids, ids, ids, ids, interpret=True)
    kv = jnp.zeros((1, 64, 2, 64))
    with pytest.raises(ValueError, match="T == S"):
        splash_attention(q, kv, kv, ids, ids, ids, ids, interpret=True)
    kv = jnp.zeros((1, 128, 2, 64))
    with pytest.raises(ValueError, match="q_segment_ids"):
        splash_attention(q, kv, kv, ids, ids, ids[:, :5], ids, interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        splash_attention(q, kv, kv, ids, ids, ids, ids, interpret=True, block_q=100)
