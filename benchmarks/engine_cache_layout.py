"""Decode attention for the rollout engine: cache layout and work bound, measured.

    JAX_PLATFORMS=cpu python benchmarks/engine_cache_layout.py [--slots 32] [--cache 2048]

One layer's decode attention for ``slots`` slots of a cache of ``cache`` entries (bench-small
heads: K = 4, G = 2, hd = 64, float32), with slot fills drawn like a refilled batch (lognormal,
mean ~0.3 of the cache, a few slots near full). Timed, jitted, median of interleaved reps:

    full          the static sampler's form: one masked softmax over all S entries of every
                  slot (``attention.head_major_attention``, keys transposed)
    batch_max     blocked loop over key blocks up to the LONGEST slot's fill
    ragged        ``decode_attention.ragged_decode_attention`` (slot-contiguous cache, the
                  engine's): (slot, block) work list, bounded by the SUM of fills
    paged         the same ragged loop over a paged cache (pages of ``block`` entries in one
                  pool, a page table per slot, pages shuffled): the layout that prefix sharing
                  and allocation by fill would need
at block sizes 64 / 128 / 256 / 512. Prints ms per call and writes --out JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from klear_jax.models import attention as A
from klear_jax.models.decode_attention import NEG, ragged_decode_attention


def batch_max(q, k, v, lengths, block):
    """Blocked online softmax over blocks 0 .. ceil(max(lengths) / block) of every slot."""
    B, _, H, hd = q.shape
    K = k.shape[1]
    qg = A.group_queries(q, K)[:, :, :, 0] * hd ** -0.5

    def trip(j, acc):
        m, l, o = acc
        kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=3)
        vb = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=2)
        s = jnp.einsum("bkgd,bkds->bkgs", qg, kb, preferred_element_type=jnp.float32)
        ok = (j * block + jnp.arange(block))[None] < lengths[:, None]
        s = jnp.where(ok[:, None, None], s, NEG)
        m_new = jnp.maximum(m, s.max(-1))
        e = jnp.where(ok[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        a = jnp.exp(m - m_new)
        return m_new, l * a + e.sum(-1), o * a[..., None] + jnp.einsum("bkgs,bksd->bkgd", e, vb)
    G = H // K
    acc = (jnp.full((B, K, G), NEG), jnp.zeros((B, K, G)), jnp.zeros((B, K, G, hd)))
    n = (jnp.max(lengths) + block - 1) // block
    m, l, o = jax.lax.fori_loop(0, n, trip, acc)
    return A.ungroup_heads((o / jnp.maximum(l, 1e-30)[..., None])[:, :, :, None], q.dtype)


def paged(q, k_pages, v_pages, table, lengths, block, pairs=None):
    """The ragged loop over pages: k_pages [Np, K, hd, block], v_pages [Np, K, block, hd],
    table int32 [B, S / block] (slot b's j-th block is page table[b, j])."""
    B, _, H, hd = q.shape
    K = k_pages.shape[1]
    G = H // K
    pairs = pairs or B
    qg = A.group_queries(q, K)[:, :, :, 0] * hd ** -0.5
    nb = (lengths + block - 1) // block
    ends = jnp.cumsum(nb)
    starts, total = ends - nb, ends[-1]
    col = jnp.arange(block)

    def trip(i, acc):
        m, l, o = acc
        t = i * pairs + jnp.arange(pairs)
        b = jnp.minimum(jnp.searchsorted(ends, t, side="right"), B - 1)
        j = t - starts[b]
        page = table[b, jnp.minimum(j, table.shape[1] - 1)]
        kb, vb = k_pages[page], v_pages[page]
        s = jnp.einsum("pkgd,pkds->pkgs", qg[b], kb, preferred_element_type=jnp.float32)
        ok = ((t < total)[:, None] & (j[:, None] * block + col[None] < lengths[b][:, None]))
        ok = ok[:, None, None]
        s = jnp.where(ok, s, NEG)
        mp = s.max(-1)
        e = jnp.where(ok, jnp.exp(s - mp[..., None]), 0.0)
        m_new = m.at[b].max(mp)
        w = jnp.exp(mp - m_new[b])
        a = jnp.exp(m - m_new)
        op = jnp.einsum("pkgs,pksd->pkgd", e, vb)
        return (m_new, (l * a).at[b].add(e.sum(-1) * w),
                (o * a[..., None]).at[b].add(op * w[..., None]))
    acc = (jnp.full((B, K, G), NEG), jnp.zeros((B, K, G)), jnp.zeros((B, K, G, hd)))
    m, l, o = jax.lax.fori_loop(0, (total + pairs - 1) // pairs, trip, acc)
    return A.ungroup_heads((o / jnp.maximum(l, 1e-30)[..., None])[:, :, :, None], q.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--cache", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    B, K, G, hd, S = a.slots, 4, 2, 64, a.cache
    r = np.random.default_rng(0)
    q = jnp.asarray(r.standard_normal((B, 1, K * G, hd)), jnp.float32)
    k = jnp.asarray(r.standard_normal((B, K, hd, S)), jnp.float32)
    v = jnp.asarray(r.standard_normal((B, K, S, hd)), jnp.float32)
    fill = np.clip(np.exp(r.normal(np.log(0.2 * S), 1.0, B)), 1, S).astype(np.int32)
    fill[:2] = S  # a few slots deep into long responses, as in a refilled batch
    lengths = jnp.asarray(fill)
    seg = (jnp.arange(S)[None] < lengths[:, None]).astype(jnp.int32)
    pos = (jnp.full((B, 1), S), jnp.zeros((B, S), jnp.int32), jnp.ones((B, 1), jnp.int32), seg)
    ref = A.head_major_attention(q, k, v, *pos, keys_transposed=True)
    fns = {"full": (jax.jit(lambda q, k, v, l: A.head_major_attention(
        q, k, v, *pos, keys_transposed=True)), (q, k, v, lengths))}
    for blk in (64, 128, 256, 512):
        fns[f"batch_max/{blk}"] = (jax.jit(lambda q, k, v, l, b=blk: batch_max(q, k, v, l, b)),
                                   (q, k, v, lengths))
        fns[f"ragged/{blk}"] = (jax.jit(lambda q, k, v, l, b=blk: ragged_decode_attention(
            q, k, v, l, block=b)), (q, k, v, lengths))
        nbk = S // blk
        perm = r.permutation(B * nbk)
        kp = k.reshape(B, K, hd, nbk, blk).transpose(0, 3, 1, 2, 4).reshape(B * nbk, K, hd, blk)
        vp = v.reshape(B, K, nbk, blk, hd).transpose(0, 2, 1, 3, 4).reshape(B * nbk, K, blk, hd)
        inv = np.argsort(perm)
        table = jnp.asarray(inv.reshape(B, nbk), jnp.int32)
        fns[f"paged/{blk}"] = (jax.jit(lambda q, kp, vp, t, l, b=blk: paged(q, kp, vp, t, l, b)),
                               (q, kp[perm], vp[perm], table, lengths))
        ident = jnp.arange(B * nbk, dtype=jnp.int32).reshape(B, nbk)
        for mult in (1, 2, 4):
            fns[f"blocked/{blk}/x{mult}"] = (
                jax.jit(lambda q, kp, vp, t, l, b=blk, m=mult: paged(q, kp, vp, t, l, b, m * B)),
                (q, kp, vp, ident, lengths))
    times = {name: [] for name in fns}
    for name, (f, args) in fns.items():
        out = f(*args).block_until_ready()
        err = float(jnp.abs(out - ref).max())
        assert err < 1e-4, (name, err)
    for rep in range(a.reps):
        for name, (f, args) in (fns.items() if rep % 2 == 0 else reversed(fns.items())):
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    res = {"slots": B, "cache": S, "kv_heads": K, "group": G, "head_dim": hd,
           "fill_mean": float(fill.mean()), "fill_max": int(fill.max()),
           "ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
           "platform": jax.default_backend()}
    for n, ms in res["ms"].items():
        print(f"{n:16s} {ms:8.2f} ms")
    print(f"fills: mean {res['fill_mean']:.0f}, max {res['fill_max']} of {S}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
