"""Decode attention alone: one query token over a KV cache, keys stored [B, K, S, hd] vs the
cache's [B, K, hd, S], at a short and a long cache, interleaved in one process.

Shapes are bench-small's sample workload (batch 8, 8 query heads over 4 KV heads, head_dim
64, 8 layers, float32); the cache lengths are the bench's 64 and 1024 prompt positions plus
65 generated slots.

    JAX_PLATFORMS=cpu python benchmarks/decode_attention.py --out /tmp/decode_attention.json

Prints ms per decode step (all layers' attention) and the bytes of K/V read per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from klear_jax.models.attention import head_major_attention  # noqa: E402


def layer_attention(keys_transposed: bool):
    """jit: q [B, 1, H, hd] attending over each layer's (k, v) cache."""
    def f(q, ks, vs, q_pos, kv_pos, q_seg, kv_seg):
        return [head_major_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg,
                                     keys_transposed=keys_transposed) for k, v in zip(ks, vs)]
    return jax.jit(f)


def inputs(B, H, K, hd, L, S, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, 1, H, hd)), jnp.float32)
    ks = [jnp.asarray(rng.standard_normal((B, K, S, hd)), jnp.float32) for _ in range(L)]
    vs = [jnp.asarray(rng.standard_normal((B, K, S, hd)), jnp.float32) for _ in range(L)]
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    masks = (jnp.full((B, 1), S - 1, jnp.int32), kv_pos, jnp.ones((B, 1), jnp.int32),
             jnp.ones((B, S), jnp.int32))
    return q, ks, vs, masks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-lengths", default="129,1089")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    B, H, K, hd, L = 8, 8, 4, 64, 8
    fns = {"[B,K,S,hd] keys": (layer_attention(False), False),
           "[B,K,hd,S] keys (cache)": (layer_attention(True), True)}
    cases = {}
    for S in (int(s) for s in args.cache_lengths.split(",")):
        q, ks, vs, masks = inputs(B, H, K, hd, L, S)
        kts = [k.swapaxes(2, 3) for k in ks]
        for name, (fn, transposed) in fns.items():
            cases[name, S] = (fn, (q, kts if transposed else ks, vs, *masks))
    times = {key: [] for key in cases}
    for fn, a in cases.values():
        jax.block_until_ready(fn(*a))  # compile
    for _ in range(args.rounds):  # interleaved: the box's load drifts alike for every case
        for key, (fn, a) in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times[key].append(time.perf_counter() - t0)
    results = []
    print(f"{'keys layout':<26}{'cache len':>10}{'MB K/V read':>13}{'ms/step':>10}")
    for (name, S), ts in times.items():
        ms = statistics.median(ts) * 1e3
        mb = 2 * L * B * K * S * hd * 4 / 1e6
        results.append({"keys": name, "cache_len": S, "kv_mb": mb, "ms_per_step": ms})
        print(f"{name:<26}{S:>10}{mb:>13.1f}{ms:>10.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": jax.default_backend(), "results": results}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
