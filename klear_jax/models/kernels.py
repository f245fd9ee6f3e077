"""The model's kernel dispatch: which matmul and attention implementation a trace uses.

The model calls ``project``, ``attention`` and ``cache_attention`` from here; this module
asks ``klear_jax.backend`` which implementation the target platform gets and routes to it:
XLA's own forms (``attention.py``), the CPU-tuned forms (``cpu_kernels.py``), TPU splash
attention (``splash.py``), the fused GPU kernels (``gpu_attention.py``: cuDNN, else Pallas;
an unsupported case falls back to XLA with a one-line warning naming why) or, for a rollout
engine's slot cache, the ragged blocked decode loop (``decode_attention.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from klear_jax import backend
from klear_jax.models import attention as A
from klear_jax.models import cpu_kernels, gpu_attention
from klear_jax.models.decode_attention import ragged_decode_attention


def project(eqn: str, x, w, preferred_element_type=None):
    """``jnp.einsum(eqn, x, w, preferred_element_type=...)`` (CPU: its tuned gradient)."""
    if backend.cpu_kernels():
        return cpu_kernels.project(eqn, x, w, preferred_element_type)
    return jnp.einsum(eqn, x, w, preferred_element_type=preferred_element_type)


def rms_norm(x, scale, eps: float):
    """RMSNorm in float32, returned in x's dtype. x [..., N], scale [N]."""
    if backend.cpu_kernels():
        return cpu_kernels.rms_norm(x, scale, eps)
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * (xf * inv)).astype(x.dtype)


def swiglu(gate, up):
    """``silu(gate) * up``, any shape."""
    if backend.cpu_kernels():
        return cpu_kernels.swiglu(gate, up)
    return jax.nn.silu(gate) * up


def apply_rope(x, cos, sin):
    """x [B, T, N, hd] rotated by cos / sin [B, T, hd]."""
    if backend.cpu_kernels():
        return cpu_kernels.apply_rope(x, cos, sin)
    return A.apply_rope(x, cos, sin)


def attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
              impl: str = "auto", recompute: bool = False):
    """Self-attention of training / prefill rows: q [B, T, H, hd], k, v [B, T, K, hd],
    positions and segment ids [B, T]; causal by index within each segment (packed and
    left-padded rows). ``impl``: ModelConfig.attention_impl ("auto" picks per platform).
    ``recompute`` (XLA path): recompute the probabilities in the backward pass."""
    impl = backend.attention_impl(impl)
    args = (q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    if impl == "splash":
        from klear_jax.models.splash import splash_attention  # Pallas TPU: heavy import
        return splash_attention(*args, interpret=backend.pallas_interpret())
    if impl == "gpu_flash":
        chosen, reasons = gpu_attention.choose(q, k, interpret=backend.pallas_interpret())
        if chosen is not None:
            return gpu_attention.gpu_attention(*args, impl=chosen,
                                               interpret=backend.pallas_interpret())
        backend.warn_fallback("gpu_flash", "; ".join(f"{i}: {r}" for i, r in reasons.items()))
    if recompute and backend.cpu_kernels():
        return cpu_kernels.recomputed_attention(*args, causal_by_index=True)
    return A.xla_attention(*args, recompute=recompute)


def cache_attention(q, cache_k, cache_v, q_positions, kv_positions, q_segment_ids,
                    kv_segment_ids):
    """q [B, T, H, hd] over a KV cache k [B, K, hd, S], v [B, K, S, hd] (T = 1 decoding)."""
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    if q.shape[1] == 1 and backend.cpu_kernels():
        return cpu_kernels.decode_attention(q, cache_k, cache_v, *masks)
    return A.head_major_attention(q, cache_k, cache_v, *masks, keys_transposed=True)


def slot_attention(q, cache_k, cache_v, lengths):
    """q [B, 1, H, hd] (one token per slot) over a slot cache k [B, K, hd, S], v [B, K, S, hd],
    slot b reading its first lengths[b] entries; the work is bounded by the filled entries
    (``decode_attention.ragged_decode_attention``, key blocks of ``backend.decode_block()``)."""
    return ragged_decode_attention(q, cache_k, cache_v, lengths, block=backend.decode_block())
