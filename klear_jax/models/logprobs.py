"""Per-token log-probabilities and entropies, chunked along the sequence.

At the paper's lengths the full logits tensor does not fit (32K tokens x 152K vocab x 4 bytes
is ~20 GB per sequence), so ``chunked_token_logprobs`` computes the unembedding, the
log-softmax and the entropy ``chunk_size`` positions at a time under ``lax.scan``. Each chunk
is wrapped in ``jax.checkpoint``: the backward pass recomputes that chunk's logits instead of
saving them, so neither pass ever holds more than one [B, chunk, V] float32 block.

Shapes: B batch, T time, D model, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from klear_jax.models.kernels import project


def _check_inputs(hidden, unembed, targets, temperature):
    if hidden.ndim != 3:
        raise ValueError(f"logprobs: hidden must be [B, T, D], got shape {hidden.shape}")
    if unembed.ndim != 2 or unembed.shape[0] != hidden.shape[-1]:
        raise ValueError(f"logprobs: unembed must be [D, V] with D={hidden.shape[-1]} "
                         f"(hidden's last dim), got shape {unembed.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"logprobs: targets must be [B, T] = {hidden.shape[:2]}, "
                         f"got shape {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"logprobs: targets must be integer, got dtype {targets.dtype}")
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"logprobs: temperature must be > 0, got {temperature}")


def _logits_f32(hidden, unembed, temperature):
    """[..., D] x [D, V] -> float32 [..., V]; accumulates in float32 whatever the inputs' dtype
    (bfloat16 x bfloat16 products are exact in float32, so this is float32 math)."""
    logits = project("...d,dv->...v", hidden, unembed, preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.float32)
    if not (isinstance(temperature, (int, float)) and temperature == 1.0):
        logits = logits / jnp.asarray(temperature, jnp.float32)
    return logits


def _logp_entropy(logits, targets, return_entropy):
    """float32 logits [..., V], targets [...] -> (logp [...], entropy [...] or None)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    # Targets outside [0, V) (e.g. -100 "ignore" labels on padding) are clipped: their logp is
    # meaningless and must be masked by the caller's loss mask.
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1,
                              mode="clip")[..., 0]
    logp = tgt - lse
    if not return_entropy:
        return logp, None
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return logp, entropy


def token_logprobs_reference(hidden, unembed, targets, *, return_entropy=True, temperature=1.0):
    """Unchunked reference: materialises the whole float32 [B, T, V] logits.

    Same arguments and results as ``chunked_token_logprobs``; used by tests and benchmarks.
    """
    _check_inputs(hidden, unembed, targets, temperature)
    logits = _logits_f32(hidden, unembed, temperature)
    return _logp_entropy(logits, targets, return_entropy)


def chunked_token_logprobs(hidden, unembed, targets, *, chunk_size=512, return_entropy=True,
                           temperature=1.0, remat=True):
    """Per-token log-probabilities (and entropies) of ``targets`` under ``hidden @ unembed``.

    Args:
      hidden: [B, T, D] final hidden states (after the final norm), any float dtype.
      unembed: [D, V] output projection (the transposed embedding when tied).
      targets: int [B, T] token ids whose log-probability is wanted (the *next* tokens; the
        caller does the shift). Ids outside [0, V) are clipped; mask them out downstream.
      chunk_size: positions per chunk along T (clipped to T; T is padded up to a multiple
        internally and the padding sliced off).
      return_entropy: also return the entropy of the (tempered) next-token distribution.
      temperature: logits are divided by it before the softmax (python float or scalar array).
      remat: recompute each chunk's logits in the backward pass (default), so the [B, T, V]
        logits are never materialised, forward or backward. False saves every chunk's
        float32 softmax for the backward instead (B x T x V x 4 bytes): one LM-head matmul
        fewer per step, for when that memory is there.

    Returns:
      (logp float32 [B, T], entropy float32 [B, T] or None). Values and gradients w.r.t.
      ``hidden`` and ``unembed`` equal ``token_logprobs_reference``.
    """
    _check_inputs(hidden, unembed, targets, temperature)
    if chunk_size <= 0:
        raise ValueError(f"logprobs: chunk_size must be > 0, got {chunk_size}")
    B, T, D = hidden.shape
    c = min(int(chunk_size), T)
    n = -(-T // c)
    pad = n * c - T
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [n, B, c, ...]: scan over chunks.
    h_chunks = hidden.reshape(B, n, c, D).swapaxes(0, 1)
    t_chunks = targets.reshape(B, n, c).swapaxes(0, 1)

    def chunk(h, t, w):
        logp, ent = _logp_entropy(_logits_f32(h, w, temperature), t, return_entropy)
        return (logp, ent) if return_entropy else (logp,)

    if remat:
        chunk = jax.checkpoint(chunk)

    def body(carry, xs):
        h, t = xs
        return carry, chunk(h, t, unembed)

    _, outs = jax.lax.scan(body, None, (h_chunks, t_chunks))
    outs = [o.swapaxes(0, 1).reshape(B, n * c)[:, :T] for o in outs]
    return (outs[0], outs[1]) if return_entropy else (outs[0], None)
