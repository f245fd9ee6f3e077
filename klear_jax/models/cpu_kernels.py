"""CPU-tuned forms of the model's matmuls and attention (``klear_jax.backend.cpu_kernels``).

Same values and gradients as the generic XLA forms (tests/test_dense.py,
tests/test_model_forward.py check both); they exist because XLA CPU runs the generic
forms' backward passes with transposed copies and saved probabilities that cost more than
they do on an accelerator. Measured on the bench-small train step (docs/performance.md):

* ``project``: a custom VJP on the flattened [N, Cin] x [Cin, Cout] matmul, dx = g @ w.T and
  dw a dot contracting x's row dim in place (Eigen reads it transposed, no copy): 10.37 ->
  8.14 s against autodiff of the einsum.
* ``recomputed_attention``: the backward recomputes the probabilities (flash-style) with the
  small [T, hd] operand transposed instead of the [T, S] one (11.88 -> 11.35 s against
  ``jax.checkpoint``), and skips key blocks above the causal diagonal in up to
  ``QUERY_BLOCKS`` query blocks (one layer fwd + bwd at T = 512: 221 -> 153 ms with 4).
* ``decode_attention``: one query's scores as G matrix-vector products over the transposed
  keys (decode step at 1024 cached positions 30.2 -> 26.9 ms).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from klear_jax.models import attention as A

# Causal block skipping: up to 4 query blocks of >= 64 queries (each block adds its own
# dots: the train step compiled in 8.6 / 11.9 / 15.0 s with 1 / 4 / 8 blocks and stepped in
# 10.84 / 10.34 / 10.34 s, hence 4).
QUERY_BLOCKS, MIN_QUERY_BLOCK = 4, 64


# ----------------------------------------------------------------------------- matmuls
def leading_contraction(eqn: str) -> int | None:
    """Number of dims contracted when ``eqn`` contracts x's trailing dims with w's leading
    dims in order and keeps the rest in order (``btd,dhk->bthk`` -> 1, ``bthk,hkd->btd`` ->
    2); None for any other einsum."""
    lhs, _, out = eqn.replace(" ", "").partition("->")
    xs, _, ws = lhs.partition(",")
    contracted = "".join(c for c in ws if c not in out)
    n = len(contracted)
    ok = (n > 0 and ws[:n] == contracted and xs.endswith(contracted)
          and out == xs[:len(xs) - n] + ws[n:] and "." not in ws)
    return n if ok else None


def project(eqn: str, x, w, preferred_element_type=None):
    """``jnp.einsum(eqn, x, w)`` with the CPU gradient (module docstring) for the
    trailing-with-leading contractions the model uses; other einsums as they are."""
    n = leading_contraction(eqn)
    if n is None:
        return jnp.einsum(eqn, x, w, preferred_element_type=preferred_element_type)
    return _project(x, w, n, preferred_element_type)


def _flat(x, w, n):
    """x [N, Cin], w [Cin, Cout] views."""
    cin = math.prod(w.shape[:n])
    return x.reshape(-1, cin), w.reshape(cin, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _project(x, w, n, preferred_element_type):
    x2, w2 = _flat(x, w, n)
    y = jnp.dot(x2, w2, preferred_element_type=preferred_element_type)
    return y.reshape(*x.shape[:x.ndim - n], *w.shape[n:])


def _project_fwd(x, w, n, preferred_element_type):
    return _project(x, w, n, preferred_element_type), (x, w)


def _project_bwd(n, preferred_element_type, res, g):
    x, w = res
    x2, w2 = _flat(x, w, n)
    g2 = g.reshape(x2.shape[0], -1)
    dx = jnp.dot(g2, w2.T.astype(g2.dtype)).astype(x.dtype).reshape(x.shape)
    dw = jax.lax.dot_general(x2.astype(g2.dtype), g2, (((0,), (0,)), ((), ())))
    return dx, dw.astype(w.dtype).reshape(w.shape)


_project.defvjp(_project_fwd, _project_bwd)


# ----------------------------------------------------------------------------- attention
def recomputed_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                         scale: float | None = None, causal_by_index: bool = False):
    """``attention.xla_attention(..., recompute=True)`` for CPU. ``causal_by_index``:
    self-attention (T == S) whose allowed keys never lie after the query in the row (packed
    and left-padded rows): key blocks above the diagonal are skipped."""
    A.check_gqa(q, k, "recomputed_attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    qg = A.group_queries(q, k.shape[1])
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    T = q.shape[1]
    n = min(QUERY_BLOCKS, T // MIN_QUERY_BLOCK) if causal_by_index and T == k.shape[2] else 1
    while n > 1 and T % n:
        n -= 1
    if n < 2:
        return A.ungroup_heads(_recomputed_core(qg, k, v, masks, scale), q.dtype)
    # Query block i only attends to keys [0, (i + 1) T / n): the causal mask zeroes the rest.
    size, outs = T // n, []
    for hi in range(size, T + 1, size):
        lo = hi - size
        block_masks = (q_positions[:, lo:hi], kv_positions[:, :hi],
                       q_segment_ids[:, lo:hi], kv_segment_ids[:, :hi])
        outs.append(_recomputed_core(qg[:, :, :, lo:hi], k[:, :, :hi], v[:, :, :hi],
                                     block_masks, scale))
    return A.ungroup_heads(jnp.concatenate(outs, axis=3), q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _recomputed_core(qg, k, v, masks, scale):
    """float32 [B, K, G, T, hd] attention of qg [B, K, G, T, hd] over k, v [B, K, S, hd].
    Hand-written backward rather than ``jax.checkpoint``: dK and dV contract over the
    queries; left to itself XLA CPU transposed the [T, S] probabilities, fused into the
    softmax backward where it ran several times slower; here the small [T, hd] operand is
    transposed instead, behind an optimization barrier."""
    return A.grouped_attention(qg, k, v, masks, scale)


def _recomputed_core_fwd(qg, k, v, masks, scale):
    out = _recomputed_core(qg, k, v, masks, scale)
    return out, (qg, k, v, masks, out)


def _recomputed_core_bwd(scale, residuals, d_out):
    qg, k, v, masks, out = residuals
    B, K, G, T, hd = qg.shape
    f32 = jnp.float32
    p = A.probabilities(qg, k, masks, scale)  # [B, K, G, T, S]
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


def decode_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """One query token q [B, 1, H, hd] over a KV cache k [B, K, hd, S], v [B, K, S, hd]: the
    scores as G matrix-vector products (each its own XLA CPU thread), stacked. Returns
    [B, 1, H, hd] in q's dtype."""
    qg = A.group_queries(q, k.shape[1]) * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    s = jnp.stack([jnp.einsum("bktd,bkds->bkts", qg[:, :, g], k,
                              preferred_element_type=jnp.float32)
                   for g in range(qg.shape[2])], axis=2)
    out = A.softmax_values(s, v, (q_positions, kv_positions, q_segment_ids, kv_segment_ids))
    return A.ungroup_heads(out, q.dtype)


# ----------------------------------------------------------------------------- elementwise
# Autodiff keeps extra [.., F] / [.., D] tensors for these (sigmoid and silu of the gate;
# the normalised x) and XLA CPU writes each out; these VJPs keep only their inputs (and the
# [.., 1] inverse RMS): train step 9.57 -> 9.16 s, compiled temp 2877 -> 2651 MiB (rms_norm).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps):
    """``kernels.rms_norm`` whose VJP computes dx in one pass,
    ``inv * (gs - x_hat * mean(gs * x_hat))`` with gs = g * scale."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * (xf * inv)).astype(x.dtype), (x, scale, inv)


def _rms_norm_bwd(eps, res, g):
    x, scale, inv = res
    x_hat = x.astype(jnp.float32) * inv
    gf = g.astype(jnp.float32)
    gs = gf * scale.astype(jnp.float32)
    dx = inv * (gs - x_hat * jnp.mean(gs * x_hat, axis=-1, keepdims=True))
    d_scale = jnp.sum(gf * x_hat, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), d_scale.reshape(scale.shape).astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def swiglu(gate, up):
    """``silu(gate) * up``; the VJP keeps gate and up and recomputes the sigmoid."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, g):
    gate, up = res
    gf, uf, g = gate.astype(jnp.float32), up.astype(jnp.float32), g.astype(jnp.float32)
    sig = jax.nn.sigmoid(gf)
    d_gate = g * uf * sig * (1.0 + gf * (1.0 - sig))  # d silu(z)/dz = s (1 + z (1 - s))
    return d_gate.astype(gate.dtype), (g * gf * sig).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def apply_rope(x, cos, sin):
    """``attention.apply_rope`` whose VJP is the rotation by -angle (one fused pass, where
    autodiff's transpose of the half slices pads and adds)."""
    return A.apply_rope(x, cos, sin)


def _rope_fwd(x, cos, sin):
    return A.apply_rope(x, cos, sin), (cos, sin)


def _rope_bwd(res, g):
    cos, sin = res
    return A.apply_rope(g, cos, -sin), None, None  # positions carry no gradient


apply_rope.defvjp(_rope_fwd, _rope_bwd)
