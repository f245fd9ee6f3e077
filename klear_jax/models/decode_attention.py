"""Decode attention over a slot cache, bounded by what each slot holds: flash-decoding over a
ragged work list, in plain XLA (CPU, GPU and TPU compile the same code).

Shapes: q [B, 1, H, hd] (one new token per slot), k [B, K, hd, S], v [B, K, S, hd] (the slot
cache's layouts, ``qwen.init_slot_cache``), lengths int32 [B]: slot b attends to its entries
0 .. lengths[b] - 1; a slot with length 0 (idle) gets zeros.

The cache is cut into key blocks of ``block`` entries (S a multiple of it). Slot b needs
nb[b] = ceil(lengths[b] / block) blocks; all (slot, block) pairs form one work list of
sum(nb) items, taken ``pairs`` at a time by a while loop. Each trip gathers its pairs' key and
value blocks [pairs, K, hd, block], computes their scores and partial softmax (max, sum,
weighted values) and folds them into per-slot accumulators (scatter max / add, rescaled as in
flash attention). Trips = ceil(sum(nb) / pairs): with pairs = B that is the MEAN number of
filled blocks per slot. Not the allocation S / block (the static sampler's cost) and not the
longest slot (a batch-wide blocked loop's): in a refilled batch some slot is nearly always
deep into a long response while most are short.

Under a mesh it runs inside ``jax.shard_map`` (slots over the cache's batch axes, kv heads
over 'tensor' where they divide): each shard walks its own slots' list, with no collective
inside the loop.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from klear_jax.models import attention as A
from klear_jax.sharding import current_mesh, logical_to_spec

NEG = -1e30  # a finite "minus infinity": exp(NEG - m) underflows to 0, exp(NEG - NEG) = 1

CACHE_K_NAMES = ("cache_batch", "cache_kv_heads", "cache_head_dim", "cache_length")


def _ragged_local(q, k, v, lengths, *, block: int, pairs: int):
    """Unsharded (or per-shard) body of ``ragged_decode_attention``."""
    B, _, H, hd = q.shape
    K, S = k.shape[1], k.shape[3]
    G = H // K
    qg = A.group_queries(q, K)[:, :, :, 0] * jnp.asarray(hd ** -0.5, q.dtype)  # [B, K, G, hd]
    lengths = jnp.minimum(lengths.astype(jnp.int32), S)
    nb = (lengths + block - 1) // block
    ends = jnp.cumsum(nb)
    starts = ends - nb
    total = ends[-1]
    trips = (total + pairs - 1) // pairs
    col = jnp.arange(block, dtype=jnp.int32)

    def take(x, b, off, sizes, at):
        idx = [jnp.zeros((), jnp.int32)] * 4
        idx[0], idx[at] = b, off
        return jax.lax.dynamic_slice(x, idx, sizes)[0]

    def trip(i, acc):
        m, l, o = acc  # [B, K, G], [B, K, G], [B, K, G, hd] float32
        t = i * pairs + jnp.arange(pairs, dtype=jnp.int32)
        valid = t < total
        b = jnp.minimum(jnp.searchsorted(ends, t, side="right"), B - 1).astype(jnp.int32)
        off = (t - starts[b]) * block
        kb = jax.vmap(lambda bb, oo: take(k, bb, oo, (1, K, hd, block), 3))(b, off)
        vb = jax.vmap(lambda bb, oo: take(v, bb, oo, (1, K, block, hd), 2))(b, off)
        s = jnp.einsum("pkgd,pkds->pkgs", qg[b], kb, preferred_element_type=jnp.float32)
        ok = (valid[:, None] & (off[:, None] + col[None, :] < lengths[b][:, None]))[:, None, None]
        s = jnp.where(ok, s, NEG)
        mp = jnp.max(s, axis=-1)                                  # [P, K, G]
        e = jnp.where(ok, jnp.exp(s - mp[..., None]), 0.0)
        lp = jnp.sum(e, axis=-1)
        op = jnp.einsum("pkgs,pksd->pkgd", e.astype(v.dtype), vb,
                        preferred_element_type=jnp.float32)
        m_new = m.at[b].max(mp)
        w = jnp.exp(mp - m_new[b])
        alpha = jnp.exp(m - m_new)
        l = (l * alpha).at[b].add(lp * w)
        o = (o * alpha[..., None]).at[b].add(op * w[..., None])
        return m_new, l, o

    acc = (jnp.full((B, K, G), NEG, jnp.float32), jnp.zeros((B, K, G), jnp.float32),
           jnp.zeros((B, K, G, hd), jnp.float32))
    m, l, o = jax.lax.fori_loop(0, trips, trip, acc)
    out = o / jnp.where(l > 0, l, 1.0)[..., None]
    return A.ungroup_heads(out[:, :, :, None, :], q.dtype)


def ragged_decode_attention(q, k, v, lengths, *, block: int, pairs: int | None = None):
    """See the module docstring. ``block`` divides S; ``pairs`` (default B per shard) is the
    number of (slot, block) items per loop trip. Returns [B, 1, H, hd] in q's dtype."""
    B, T, H, hd = q.shape
    if T != 1 or k.shape[0] != B or k.shape[3] % block or H % k.shape[1]:
        raise ValueError(f"ragged_decode_attention: needs q [B, 1, H, hd], k [B, K, hd, S] with "
                         f"S % block == 0 and H % K == 0; got q {q.shape}, k {k.shape}, "
                         f"block {block}")
    mesh = current_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return _ragged_local(q, k, v, lengths, block=block, pairs=pairs or B)
    P = jax.sharding.PartitionSpec
    ks = logical_to_spec(CACHE_K_NAMES, k.shape, mesh)
    batch, heads = ks[0], ks[1]
    n_batch = math.prod(mesh.shape[a] for a in
                        ((batch,) if isinstance(batch, str) else (batch or ())))
    # Query head h reads kv head h // G: splitting both over the same axes keeps that local.
    q_spec, k_spec = P(batch, None, heads, None), P(batch, heads, None, None)
    v_spec = P(batch, heads, None, None)
    local = functools.partial(_ragged_local, block=block, pairs=pairs or B // n_batch)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, k_spec, v_spec, P(batch)),
                       out_specs=q_spec, check_vma=False)
    return fn(q, k, v, lengths)
