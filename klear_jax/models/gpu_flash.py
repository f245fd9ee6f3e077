"""Pallas Triton flash attention for GPUs (T == S training rows): the ``"pallas"`` candidate
of ``klear_jax.models.gpu_attention``, whose docstring states the semantics::

    allowed[b, t, s] = (s <= t) & (q_seg[b, t] == kv_seg[b, s]) & (kv_seg[b, s] != 0)

Adapted from ``jax.experimental.pallas.ops.gpu.attention`` (one segment-id array, equal q /
kv head counts, a fused backward whose GQA form would need atomics): here q and kv segment
ids are separate, the mask is exact (masked probabilities are zeroed, so a row with no allowed
key, padding, returns zeros and gets no gradient), and grouped-query attention reads kv head
h // G through the index maps. Three kernels: the forward (per query block, row, head; also
the log2-sum-exp of each row), dQ (per query block, row, head) and dK / dV (per kv block,
row, kv head, looping over its G query heads, so no two programs write one block).

Shapes: B batch, T time (== S, padded to the block size), H query heads, K kv heads,
G = H / K, hd head dim (hdp: hd rounded up to a power of two).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(np.finfo(np.float32).max)  # finite: masked scores keep max() finite


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the Pallas kernels (powers of two >= 16; clipped to T rounded up to a power
    of two). Forward: block_q x block_k; dQ: block_q_dq x block_kv_dq; dK/dV: block_q_dkv x
    block_kv_dkv. Defaults: the fastest of six measured on one H200 (16 / 8 heads, hd 128,
    bf16, forward + backward of one layer at 4 x 4096 / 1 x 16384 tokens,
    benchmarks/gpu_attention_check.py): 5.5 / 20.6 ms; (128 x 64, backward 64 x 64, 8 warps)
    7.3 / 27.6; jax's Pallas defaults (128 x 128, backward 32 x 32, 8 warps) 12.6 / 45.4 (on
    packed rows: the kernel skips only blocks above the diagonal, so packed and one-segment
    rows cost the same, 7.5 vs 7.3 ms for the second)."""
    block_q: int = 128
    block_k: int = 128
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_warps: int | None = 4  # None: 4 for head_dim <= 64, else 8 (jax's heuristic)
    num_stages: int = 2

    def clipped(self, T: int) -> "BlockSizes":
        cap = max(16, pl_next_power_of_2(T))
        fields = {}
        for f in ("block_q", "block_k", "block_q_dq", "block_kv_dq", "block_q_dkv",
                  "block_kv_dkv"):
            b = getattr(self, f)
            if b < 16 or b & (b - 1):
                raise ValueError(f"BlockSizes.{f}={b} must be a power of two >= 16")
            fields[f] = min(b, cap)
        return dataclasses.replace(self, **fields)

    def padded_length(self, T: int) -> int:
        b = max(self.block_q, self.block_k, self.block_q_dq, self.block_kv_dq,
                self.block_q_dkv, self.block_kv_dkv)
        return -(-T // b) * b


def pl_next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 2 ** (int(x) - 1).bit_length()


def _allowed(q_seg, kv_seg, span_q, span_k):
    """bool [bq, bk] from segment ids [bq], [bk] and indices [bq], [bk]."""
    return ((q_seg[:, None] == kv_seg[None, :]) & (kv_seg[None, :] != 0)
            & (span_q[:, None] >= span_k[None, :]))


def _fwd_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, *, scale, block_q,
                block_k, head_dim):
    """One (query block, row, head): q_ref [bq, hdp], k/v_ref [T, hdp] (its kv head), segment
    refs [bq] / [T] -> o_ref [bq, hdp], lse_ref [bq] (log2-sum-exp2 of the scaled scores)."""
    i = pl.program_id(0)
    hdp = q_ref.shape[-1]
    head_mask = (jnp.arange(hdp) < head_dim)[None, :]
    q = plgpu.load(q_ref, mask=head_mask, other=0.0)
    q_seg = qs_ref[...]
    span_q = i * block_q + jnp.arange(block_q)

    def body(j, carry):
        o, m, l = carry
        sl = pl.ds(j * block_k, block_k)
        k = plgpu.load(k_ref.at[sl, :], mask=head_mask, other=0.0)
        s = plgpu.dot(q, k.T) * (scale * _LOG2E)  # float32 [bq, bk], log2 domain
        ok = _allowed(q_seg, ks_ref[sl], span_q, j * block_k + jnp.arange(block_k))
        s = jnp.where(ok, s, _MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.where(ok, jnp.exp2(s - m_new[:, None]), 0.0)  # exact zeros where masked
        v = plgpu.load(v_ref.at[sl, :], mask=head_mask, other=0.0)
        o = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v)
        return o, m_new, corr * l + jnp.sum(p, axis=-1)

    o = jnp.zeros((block_q, hdp), jnp.float32)
    m = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    n_kv = lax.div(block_q * (i + 1) + block_k - 1, block_k)  # causal: blocks up to the diagonal
    o, m, l = lax.fori_loop(0, n_kv, body, (o, m, l))
    has = l > 0  # rows with no allowed key (padding) give zeros
    o = jnp.where(has[:, None], o / jnp.where(has, l, 1.0)[:, None], 0.0)
    lse_ref[...] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), 0.0)
    plgpu.store(o_ref, o.astype(o_ref.dtype), mask=head_mask)


def _dq_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale, block_q, block_k, head_dim):
    """dQ of one (query block, row, head); refs as in ``_fwd_kernel`` plus do [bq, hdp],
    lse / delta [bq]."""
    i = pl.program_id(0)
    hdp = q_ref.shape[-1]
    head_mask = (jnp.arange(hdp) < head_dim)[None, :]
    q = plgpu.load(q_ref, mask=head_mask, other=0.0)
    do = plgpu.load(do_ref, mask=head_mask, other=0.0)
    q_seg, lse, delta = qs_ref[...], lse_ref[...], delta_ref[...]
    span_q = i * block_q + jnp.arange(block_q)

    def body(j, dq):
        sl = pl.ds(j * block_k, block_k)
        k = plgpu.load(k_ref.at[sl, :], mask=head_mask, other=0.0)
        v = plgpu.load(v_ref.at[sl, :], mask=head_mask, other=0.0)
        s = plgpu.dot(q, k.T) * (scale * _LOG2E)
        ok = _allowed(q_seg, ks_ref[sl], span_q, j * block_k + jnp.arange(block_k))
        p = jnp.where(ok, jnp.exp2(s - lse[:, None]), 0.0)
        ds = p * (plgpu.dot(do, v.T) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = jnp.zeros((block_q, hdp), jnp.float32)
    dq = lax.fori_loop(0, lax.div(block_q * (i + 1) + block_k - 1, block_k), body, dq)
    plgpu.store(dq_ref, (dq * scale).astype(dq_ref.dtype), mask=head_mask)


def _dkv_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                *, scale, block_q, block_k, head_dim, groups):
    """dK, dV of one (kv block, row, kv head): k/v_ref [bk, hdp]; q/do_ref [T, G, hdp] (the
    kv head's G query heads); lse / delta_ref [G, T]; qs_ref [T]; ks_ref [bk]. Sums over
    the G query heads inside the program, so no two programs write the same block."""
    j = pl.program_id(0)
    T = q_ref.shape[0]
    hdp = k_ref.shape[-1]
    head_mask = (jnp.arange(hdp) < head_dim)[None, :]
    k = plgpu.load(k_ref, mask=head_mask, other=0.0)
    v = plgpu.load(v_ref, mask=head_mask, other=0.0)
    kv_seg = ks_ref[...]
    span_k = j * block_k + jnp.arange(block_k)
    first = lax.div(j * block_k, block_q)  # causal: query blocks from the diagonal on

    def body_for(g):
        g = jnp.int32(g)  # an array index (interpret mode rejects a Python int beside slices)

        def body(i, carry):
            dk, dv = carry
            sl = pl.ds(i * block_q, block_q)
            q = plgpu.load(q_ref.at[sl, g, :], mask=head_mask, other=0.0)
            do = plgpu.load(do_ref.at[sl, g, :], mask=head_mask, other=0.0)
            s = plgpu.dot(q, k.T) * (scale * _LOG2E)
            ok = _allowed(qs_ref[sl], kv_seg, i * block_q + jnp.arange(block_q), span_k)
            p = jnp.where(ok, jnp.exp2(s - lse_ref[g, sl][:, None]), 0.0)
            dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
            ds = p * (plgpu.dot(do, v.T) - delta_ref[g, sl][:, None])
            return dk + plgpu.dot(ds.astype(q.dtype).T, q), dv
        return body

    dk = jnp.zeros((block_k, hdp), jnp.float32)
    dv = jnp.zeros((block_k, hdp), jnp.float32)
    for g in range(groups):
        dk, dv = lax.fori_loop(first, T // block_q, body_for(g), (dk, dv))
    plgpu.store(dk_ref, (dk * scale).astype(dk_ref.dtype), mask=head_mask)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=head_mask)


def _num_warps(bs: BlockSizes, head_dim: int) -> int:
    return bs.num_warps or (4 if head_dim <= 64 else 8)


def _query_block_specs(bq: int, T: int, G: int, hdp: int) -> list:
    """In-specs of (q, k, v, q_seg, kv_seg) for a grid (query block i, batch b, head h):
    one query block of head h against the whole of its kv head h // G."""
    return [
        pl.BlockSpec((None, bq, None, hdp), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, T, None, hdp), lambda i, b, h: (b, 0, h // G, 0)),
        pl.BlockSpec((None, T, None, hdp), lambda i, b, h: (b, 0, h // G, 0)),
        pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
    ]


def _flash_fwd(q, k, v, q_seg, kv_seg, bs: BlockSizes, interpret: bool):
    """(out [B, T, H, hd], lse float32 [B, H, T]) on padded, block-aligned inputs."""
    B, T, H, hd = q.shape
    G = H // k.shape[2]
    hdp = pl_next_power_of_2(hd)
    bq, bk = bs.block_q, bs.block_k
    kernel = functools.partial(_fwd_kernel, scale=hd ** -0.5, block_q=bq, block_k=bk,
                               head_dim=hd)
    return pl.pallas_call(
        kernel,
        grid=(T // bq, B, H),
        in_specs=[
            *_query_block_specs(bq, T, G, hdp),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, hdp), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=_num_warps(bs, hd),
                                             num_stages=bs.num_stages),
        interpret=interpret,
        name="klear_flash_fwd",
    )(q, k, v, q_seg, kv_seg)


def _flash_bwd(q, k, v, q_seg, kv_seg, out, lse, do, bs: BlockSizes, interpret: bool):
    """(dq, dk, dv) on padded, block-aligned inputs."""
    B, T, H, hd = q.shape
    K = k.shape[2]
    G = H // K
    hdp = pl_next_power_of_2(hd)
    # delta_t = sum_d out * dout = sum_s p * dp (the softmax backward's row term), [B, H, T]
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    params = plgpu.CompilerParams(num_warps=_num_warps(bs, hd), num_stages=bs.num_stages)
    bq, bk = bs.block_q_dq, bs.block_kv_dq
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=hd ** -0.5, block_q=bq, block_k=bk, head_dim=hd),
        grid=(T // bq, B, H),
        in_specs=[
            *_query_block_specs(bq, T, G, hdp),
            pl.BlockSpec((None, bq, None, hdp), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
            pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, hdp), lambda i, b, h: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params, interpret=interpret, name="klear_flash_dq",
    )(q, k, v, q_seg, kv_seg, do, lse, delta)
    bq, bk = bs.block_q_dkv, bs.block_kv_dkv
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=hd ** -0.5, block_q=bq, block_k=bk, head_dim=hd,
                          groups=G),
        grid=(T // bk, B, K),
        in_specs=[
            pl.BlockSpec((None, T, G, hdp), lambda j, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, bk, None, hdp), lambda j, b, h: (b, j, h, 0)),
            pl.BlockSpec((None, bk, None, hdp), lambda j, b, h: (b, j, h, 0)),
            pl.BlockSpec((None, T), lambda j, b, h: (b, 0)),
            pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
            pl.BlockSpec((None, T, G, hdp), lambda j, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0)),
            pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0)),
        ],
        out_specs=[pl.BlockSpec((None, bk, None, hdp), lambda j, b, h: (b, j, h, 0)),
                   pl.BlockSpec((None, bk, None, hdp), lambda j, b, h: (b, j, h, 0))],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params, interpret=interpret, name="klear_flash_dkv",
    )(q, k, v, q_seg, kv_seg, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, q_seg, kv_seg, bs, interpret):
    return _flash_fwd(q, k, v, q_seg, kv_seg, bs, interpret)[0]


def _flash_vjp_fwd(q, k, v, q_seg, kv_seg, bs, interpret):
    out, lse = _flash_fwd(q, k, v, q_seg, kv_seg, bs, interpret)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _flash_vjp_bwd(bs, interpret, res, do):
    q, k, v, q_seg, kv_seg, out, lse = res
    dq, dk, dv = _flash_bwd(q, k, v, q_seg, kv_seg, out, lse, do, bs, interpret)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def pallas_attention(q, k, v, q_seg, kv_seg, *, block_sizes: BlockSizes | None = None,
                     interpret: bool = False):
    """Per-shard Pallas flash attention. q [B, T, H, hd], k / v [B, T, K, hd], segment ids
    int32 [B, T] -> [B, T, H, hd] in q's dtype (padding rows zero). T is padded to the block
    size with segment 0 (sliced off after)."""
    B, T, H, hd = q.shape
    bs = (block_sizes or BlockSizes()).clipped(T)
    Tp = bs.padded_length(T)
    if Tp != T:
        pad4 = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad4), jnp.pad(k, pad4), jnp.pad(v, pad4)
        q_seg = jnp.pad(q_seg, ((0, 0), (0, Tp - T)))
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, Tp - T)))
    out = _flash(q, k, v, q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32), bs, interpret)
    return out[:, :T]
