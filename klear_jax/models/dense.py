"""Projections ``x [..., *C] . w [*C, *O] -> [..., *O]`` with a CPU-friendly gradient.

``project(eqn, x, w)`` is ``jnp.einsum(eqn, x, w)`` for the einsums the model uses (x's
trailing dims contracted with w's leading dims: ``btd,dhk->bthk``, ``btf,fd->btd``,
``...d,dv->...v``). On TPU/GPU it is exactly that einsum. Compiling for CPU it carries a
custom VJP whose weight gradient ``x2.T @ g2`` reads a transposed copy of the activations
made behind an optimization barrier: left to itself, XLA CPU fuses that transpose into the
producer of ``g`` (SwiGLU's backward, the attention output's), where it ran ~3x slower than
the elementwise op and a plain transpose apart, and computes the dot off the YNNPACK path. Measured on the
bench-small MLP (fwd + bwd): 525 -> 400 ms; the whole train step: see docs/performance.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from klear_jax import sharding as shd


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
    """``jnp.einsum(eqn, x, w, preferred_element_type=...)``; see the module docstring."""
    n = leading_contraction(eqn)
    if n is None or shd.target_platform() != "cpu":
        return jnp.einsum(eqn, x, w, preferred_element_type=preferred_element_type)
    return _cpu_project(x, w, n, preferred_element_type)


def _flat(x, w, n):
    """x [N, Cin], w [Cin, Cout] views."""
    cin = math.prod(w.shape[:n])
    return x.reshape(-1, cin), w.reshape(cin, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cpu_project(x, w, n, preferred_element_type):
    x2, w2 = _flat(x, w, n)
    y = jnp.dot(x2, w2, preferred_element_type=preferred_element_type)
    return y.reshape(*x.shape[:x.ndim - n], *w.shape[n:])


def _cpu_project_fwd(x, w, n, preferred_element_type):
    return _cpu_project(x, w, n, preferred_element_type), (x, w)


def _cpu_project_bwd(n, preferred_element_type, res, g):
    x, w = res
    x2, w2 = _flat(x, w, n)
    g2 = g.reshape(x2.shape[0], -1)
    dx = jnp.dot(g2, w2.T.astype(g2.dtype)).astype(x.dtype).reshape(x.shape)
    # The barrier keeps the transpose a standalone copy (see the module docstring).
    xt = jax.lax.optimization_barrier(x2.T.astype(g2.dtype))
    dw = jnp.dot(xt, g2).astype(w.dtype).reshape(w.shape)
    return dx, dw


_cpu_project.defvjp(_cpu_project_fwd, _cpu_project_bwd)
