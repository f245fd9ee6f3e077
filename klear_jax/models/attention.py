"""Attention with causal + segment-id masking (packed sequences, padding, KV cache), and RoPE.

Masking rule shared by every kernel (XLA here, splash in ``splash.py``, the GPU kernel in
``gpu_attention.py``, the CPU forms in ``cpu_kernels.py``)::

    allowed[b, t, s] = (kv_pos[b, s] <= q_pos[b, t]) & (q_seg[b, t] == kv_seg[b, s])
                       & (kv_seg[b, s] != 0)

Segment id 0 marks padding and empty cache slots; a fully masked row returns zeros. Which
kernel runs is decided by ``klear_jax.models.kernels`` (from ``klear_jax.backend``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """bool [B, T, S] from positions / segment ids int32 [B, T] and [B, S]."""
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return causal & same & (kv_segment_ids[:, None, :] != 0)


def masked_exp(s, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """float32 scores [B, K, G, T, S] -> (exp(s - row max) masked per ``attention_mask``,
    its row sums [B, K, G, T, 1], 1 for a fully masked row so that it gives zeros)."""
    mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked row: avoid inf - inf
    e = jnp.exp(s - m)  # exactly 0 where masked: no second select over [.., T, S]
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e, jnp.where(denom > 0, denom, 1.0)


def group_queries(q, num_kv_heads: int):
    """q [B, T, H, hd] -> [B, K, G, T, hd] (query head h = k * G + g)."""
    B, T, H, hd = q.shape
    return q.reshape(B, T, num_kv_heads, H // num_kv_heads, hd).transpose(0, 2, 3, 1, 4)


def ungroup_heads(out, dtype):
    """[B, K, G, T, hd] -> [B, T, H, hd] in ``dtype``. Outputs are produced in the dots'
    natural order and transposed after: asking for ...->btkgd made XLA CPU contract v's S
    axis as a transposed operand (decode attention several times slower)."""
    B, K, G, T, hd = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, hd).astype(dtype)


def scores(qg, k, scale: float, keys_transposed: bool = False):
    """float32 [B, K, G, T, S] scores of qg [B, K, G, T, hd] against k [B, K, S, hd], or
    [B, K, hd, S] when ``keys_transposed`` (the KV cache's layout). The scale goes on q
    [.., T, hd], not on the [.., T, S] scores."""
    qg = qg * jnp.asarray(scale, qg.dtype)
    k_spec = "bkds" if keys_transposed else "bksd"
    return jnp.einsum(f"bkgtd,{k_spec}->bkgts", qg, k, preferred_element_type=jnp.float32)


def softmax_values(s, v, masks):
    """float32 [B, K, G, T, hd]: softmax of the masked scores s [B, K, G, T, S] times v
    [B, K, S, hd]. The division is applied to the output, a pass over hd instead of S."""
    e, denom = masked_exp(s, *masks)
    out = jnp.einsum("bkgts,bksd->bkgtd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / denom


def probabilities(qg, k, masks, scale: float):
    """float32 [B, K, G, T, S] softmax probabilities (one reciprocal per row)."""
    e, denom = masked_exp(scores(qg, k, scale), *masks)
    return e * (1.0 / denom)


def grouped_attention(qg, k, v, masks, scale: float, keys_transposed: bool = False):
    """float32 [B, K, G, T, hd] output of qg [B, K, G, T, hd] over k (as in ``scores``) and
    v [B, K, S, hd]."""
    return softmax_values(scores(qg, k, scale, keys_transposed), v, masks)


def head_major_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                         scale: float | None = None, keys_transposed: bool = False):
    """Attention of q [B, T, H, hd] (T = 1 when decoding) over head-major k, v [B, K, S, hd],
    or k [B, K, hd, S] when ``keys_transposed``. Returns [B, T, H, hd] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    out = grouped_attention(group_queries(q, k.shape[1]), k, v, masks, scale, keys_transposed)
    return ungroup_heads(out, q.dtype)


def check_gqa(q, k, who: str = "attention") -> None:
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{who}: {q.shape[2]} query heads not a multiple of {k.shape[2]} "
                         "kv heads")


def xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  scale: float | None = None, recompute: bool = False):
    """Grouped-query attention in plain XLA.

    q [B, T, H, hd]; k, v [B, S, K, hd] with H = K * G; positions / segment ids int32
    [B, T] (queries) and [B, S] (keys). Scores and softmax in float32. Returns [B, T, H, hd]
    in q's dtype. ``recompute``: the backward pass recomputes the [B, K, G, T, S]
    probabilities instead of saving them (as flash attention does); for layers that are not
    rematerialised already (under a remat policy it only adds memory).
    """
    check_gqa(q, k, "xla_attention")
    # Head-major k / v: both dots become plain batched matmuls.
    core = functools.partial(head_major_attention, scale=scale)
    if recompute:
        core = jax.checkpoint(core)
    return core(q, k.swapaxes(1, 2), v.swapaxes(1, 2), q_positions, kv_positions,
                q_segment_ids, kv_segment_ids)


def rope_cos_sin(positions, inv_freq, attention_scaling: float, dtype):
    """cos, sin [B, T, hd] for int positions [B, T] (HF layout: frequencies repeated twice)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return ((jnp.cos(emb) * attention_scaling).astype(dtype),
            (jnp.sin(emb) * attention_scaling).astype(dtype))


def apply_rope(x, cos, sin):
    """x [B, T, N, hd] rotated with cos/sin [B, T, hd] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


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
