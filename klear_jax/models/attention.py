"""Attention with causal + segment-id masking (packed sequences, padding, KV cache), and RoPE.

Masking rule shared by every path (XLA here, splash in ``splash.py``)::

    allowed[b, t, s] = (kv_pos[b, s] <= q_pos[b, t]) & (q_seg[b, t] == kv_seg[b, s])
                       & (kv_seg[b, s] != 0)

Segment id 0 marks padding and empty cache slots; a fully masked row returns zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from klear_jax import sharding as shd


def attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """bool [B, T, S] from positions / segment ids int32 [B, T] and [B, S]."""
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return causal & same & (kv_segment_ids[:, None, :] != 0)


def _masked_exp(s, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """float32 scores [B, K, G, T, S] -> (exp(s - row max) masked per ``attention_mask``,
    its row sums [B, K, G, T, 1], 1 for a fully masked row so that it gives zeros)."""
    mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked row: avoid inf - inf
    e = jnp.exp(s - m)  # exactly 0 where masked: no second select over [.., T, S]
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e, jnp.where(denom > 0, denom, 1.0)


# The CPU recompute path's causal block skipping: up to 4 query blocks of >= 64 queries. One
# layer's attention forward + backward at T = 512 took 221 ms unblocked, 190 / 153 / 138 ms in
# 2 / 4 / 8 blocks (benchmarks/attention_blocks.py). Each block adds its own dots to the
# graph: the bench-small train step compiled in 8.6 / 11.9 / 15.0 s with 1 / 4 / 8 blocks and
# stepped in 10.84 / 10.34 / 10.34 s (interleaved), hence 4.
CPU_QUERY_BLOCKS, CPU_MIN_QUERY_BLOCK = 4, 64


def xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  scale: float | None = None, recompute: bool = False,
                  causal_by_index: bool = False):
    """Grouped-query attention in plain XLA.

    q [B, T, H, hd]; k, v [B, S, K, hd] with H = K * G; positions / segment ids int32
    [B, T] (queries) and [B, S] (keys). Scores and softmax in float32. Returns [B, T, H, hd]
    in q's dtype. ``recompute``: the backward pass recomputes the [B, K, G, T, S]
    probabilities from q, k instead of saving them (as flash attention does); for layers
    that are not rematerialised already (under a remat policy it only adds memory).
    ``causal_by_index``: self-attention (T == S) whose allowed keys never lie after the query
    in the row (true of packed / left-padded rows, see ``splash.py``); the CPU recompute path
    then skips the key blocks above the diagonal.
    """
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"xla_attention: {q.shape[2]} query heads not a multiple of "
                         f"{k.shape[2]} kv heads")
    # Head-major k / v: both dots become plain batched matmuls (measured ~5% faster train step
    # on CPU than contracting the [B, S, K, hd] layout directly). Recomputing made the
    # bench-small train step (remat none) 24% faster on CPU: saving the probabilities of
    # every layer cost a zero-fill, writes and reads worth more than one more dot.
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    if recompute and shd.target_platform() == "cpu":
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        qg = _group_queries(q, k.shape[1])
        T = q.shape[1]
        n = min(CPU_QUERY_BLOCKS, T // CPU_MIN_QUERY_BLOCK) if causal_by_index and T == k.shape[2] else 1
        while n > 1 and T % n:
            n -= 1
        if n < 2:
            return _ungroup_heads(_recomputed_core(qg, k, v, masks, scale), q.dtype)
        # Query block i only attends to keys [0, (i + 1) T / n): the causal mask zeroes the
        # rest, so (n + 1) / 2n of the score work is done.
        size, outs = T // n, []
        for hi in range(size, T + 1, size):
            lo = hi - size
            block_masks = (q_positions[:, lo:hi], kv_positions[:, :hi],
                           q_segment_ids[:, lo:hi], kv_segment_ids[:, :hi])
            outs.append(_recomputed_core(qg[:, :, :, lo:hi], k[:, :, :hi], v[:, :, :hi],
                                         block_masks, scale))
        return _ungroup_heads(jnp.concatenate(outs, axis=3), q.dtype)
    core = functools.partial(head_major_attention, scale=scale)
    if recompute:
        core = jax.checkpoint(core)
    return core(q, k, v, *masks)


def head_major_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                         scale: float | None = None, keys_transposed: bool = False):
    """``xla_attention``'s core over head-major k, v [B, K, S, hd], or k [B, K, hd, S] when
    ``keys_transposed`` (the KV cache's layout); q [B, T, H, hd] (T = 1 when decoding).
    Returns [B, T, H, hd] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    out = _grouped_attention(_group_queries(q, k.shape[1]), k, v, masks, scale, keys_transposed)
    return _ungroup_heads(out, q.dtype)


def _group_queries(q, num_kv_heads: int):
    """q [B, T, H, hd] -> [B, K, G, T, hd] (query head h = k * G + g)."""
    B, T, H, hd = q.shape
    return q.reshape(B, T, num_kv_heads, H // num_kv_heads, hd).transpose(0, 2, 3, 1, 4)


def _ungroup_heads(out, dtype):
    """[B, K, G, T, hd] -> [B, T, H, hd] in ``dtype``. Outputs are produced in the dots'
    natural order and transposed after: asking for ...->btkgd made XLA CPU contract v's S
    axis as a transposed operand (decode attention several times slower)."""
    B, K, G, T, hd = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, hd).astype(dtype)


def _scores_exp(qg, k, masks, scale: float, keys_transposed: bool = False):
    """``_masked_exp`` of the scores of qg [B, K, G, T, hd] against k [B, K, S, hd] (or
    [B, K, hd, S] when ``keys_transposed``: decoding over it runs ~1.6x faster,
    benchmarks/decode_attention.py)."""
    qg = qg * jnp.asarray(scale, qg.dtype)  # on q [.., T, hd], not on the [.., T, S] scores
    if keys_transposed and qg.shape[3] == 1 and shd.target_platform() == "cpu":
        s = _decode_scores(qg, k)
    else:
        k_spec = "bkds" if keys_transposed else "bksd"
        s = jnp.einsum(f"bkgtd,{k_spec}->bkgts", qg, k, preferred_element_type=jnp.float32)
    return _masked_exp(s, *masks)


def _decode_scores(qg, k):
    """float32 [B, K, G, 1, S] scores of one query token qg [B, K, G, 1, hd] over keys
    k [B, K, hd, S] as G matrix-vector products, stacked. On XLA CPU the G products (each its
    own thread) beat the one [G, hd] x [hd, S] product per row-head (M = G = 2), though they
    read the keys G times: bench-small decode step at 1024 cached positions 30.2 -> 26.9 ms,
    at 64 unchanged (20.6 / 20.5 ms; 14 interleaved calls each)."""
    return jnp.stack([jnp.einsum("bktd,bkds->bkts", qg[:, :, g], k,
                                 preferred_element_type=jnp.float32)
                      for g in range(qg.shape[2])], axis=2)


def _probabilities(qg, k, masks, scale: float):
    """float32 [B, K, G, T, S] softmax probabilities (``_scores_exp`` normalised; one
    reciprocal per row, a multiply per score)."""
    e, denom = _scores_exp(qg, k, masks, scale)
    return e * (1.0 / denom)


def _grouped_attention(qg, k, v, masks, scale: float, keys_transposed: bool = False):
    """float32 [B, K, G, T, hd] output of qg [B, K, G, T, hd] attending over k (as in
    ``_scores_exp``) and v [B, K, S, hd]. The softmax division is applied to the output, a
    pass over hd instead of S: all layers' decode attention 2.40 -> 2.10 ms at 129 cache
    slots, 10.17 -> 9.37 ms at 1089 (bench-small shapes, interleaved A/B)."""
    e, denom = _scores_exp(qg, k, masks, scale, keys_transposed)
    out = jnp.einsum("bkgts,bksd->bkgtd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / denom


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _recomputed_core(qg, k, v, masks, scale):
    """float32 [B, K, G, T, hd] attention output of qg [B, K, G, T, hd] over k, v
    [B, K, S, hd], whose backward recomputes the probabilities (the CPU ``recompute`` path).

    Hand-written rather than ``jax.checkpoint``: dK and dV contract over the queries, the
    leading axis of both [T, S] probabilities and [T, hd] query-side operands. Left to
    itself XLA CPU transposed the [T, S] one, fused into the softmax backward, where it ran
    several times slower than the elementwise op alone; here the small [T, hd] operand is
    transposed instead, behind an optimization barrier. Measured on the bench-small train
    step against jax.checkpoint, interleaved: 11.88 -> 11.35 s (docs/performance.md).
    """
    return _grouped_attention(qg, k, v, masks, scale)


def _recomputed_core_fwd(qg, k, v, masks, scale):
    out = _recomputed_core(qg, k, v, masks, scale)
    return out, (qg, k, v, masks, out)


def _recomputed_core_bwd(scale, residuals, d_out):
    qg, k, v, masks, out = residuals
    B, K, G, T, hd = qg.shape
    f32 = jnp.float32
    p = _probabilities(qg, k, masks, scale)  # [B, K, G, T, S]
    rows = p.reshape(B, K, G * T, -1)
    small_t = lambda x: jax.lax.optimization_barrier(x.reshape(B, K, G * T, hd).swapaxes(2, 3))
    dv = jnp.einsum("bkdn,bkns->bkds", small_t(d_out), rows, preferred_element_type=f32)
    dp = jnp.einsum("bkgtd,bksd->bkgts", d_out, v, preferred_element_type=f32)
    # softmax backward; sum_s p * dp == sum_d d_out * out, a pass over hd instead of S
    delta = jnp.sum(d_out * out, axis=-1, keepdims=True)
    ds = p * (dp - delta) * scale
    dq = jnp.einsum("bkgts,bksd->bkgtd", ds.astype(k.dtype), k, preferred_element_type=f32)
    dk = jnp.einsum("bkdn,bkns->bkds", small_t(qg.astype(f32)), ds.reshape(rows.shape),
                    preferred_element_type=f32)
    no_grad = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), masks)
    # dK, dV come out [B, K, hd, S]: the dots' natural order; transposed after (small)
    return (dq.astype(qg.dtype), dk.swapaxes(2, 3).astype(k.dtype),
            dv.swapaxes(2, 3).astype(v.dtype), no_grad)


_recomputed_core.defvjp(_recomputed_core_fwd, _recomputed_core_bwd)


def attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
              impl: str = "xla", scale: float | None = None, recompute: bool = False,
              causal_by_index: bool = False):
    """Dispatches to the XLA path or to the Pallas splash kernel (T == S only, causal by
    index; it never keeps the probabilities, so ``recompute`` and ``causal_by_index`` only
    concern the XLA path)."""
    if impl == "xla":
        return xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                             scale=scale, recompute=recompute, causal_by_index=causal_by_index)
    if impl == "splash":
        from klear_jax.models.splash import splash_attention  # lazy: Pallas import is heavy
        if scale is not None and scale != q.shape[-1] ** -0.5:
            raise ValueError("splash attention only supports the default 1/sqrt(head_dim) scale")
        return splash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                                interpret=shd.target_platform() == "cpu")
    raise ValueError(f"attention impl {impl!r} unknown (xla, splash)")


def rope_cos_sin(positions, inv_freq, attention_scaling: float, dtype):
    """cos, sin [B, T, hd] for int positions [B, T] (HF layout: frequencies repeated twice)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return ((jnp.cos(emb) * attention_scaling).astype(dtype),
            (jnp.sin(emb) * attention_scaling).astype(dtype))


@jax.custom_vjp
def apply_rope(x, cos, sin):
    """x [B, T, N, hd] rotated with cos/sin [B, T, hd] (rotate-half convention).

    The rotation's transpose is the rotation by -angle, so the VJP is ``apply_rope(g, cos,
    -sin)``: one fused pass, where autodiff's transpose of the half slices pads and adds.
    """
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


def _rope_fwd(x, cos, sin):
    return apply_rope(x, cos, sin), (cos, sin)


def _rope_bwd(res, g):
    cos, sin = res
    # Positions carry no gradient; cos/sin come from integer positions.
    return apply_rope(g, cos, -sin), None, None


apply_rope.defvjp(_rope_fwd, _rope_bwd)


def positions_from_segment_ids(segment_ids):
    """Position of each token inside its segment, counting from the segment's first token.

    segment_ids int32 [B, T] -> int32 [B, T]. Packed rows restart at 0 per segment; a
    left-padded row's first real token gets 0 (the pads count their own run from 0).
    """
    T = segment_ids.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    start = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
        axis=1)
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    return (idx - first).astype(jnp.int32)
