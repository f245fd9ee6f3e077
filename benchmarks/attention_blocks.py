"""Training attention alone (one layer, forward + backward): the CPU recompute path unblocked
and with its causal block skipping at several query-block sizes, interleaved in one process.

Shapes are bench-small's train workload (4096 tokens per step as B = 4096 // T rows, 8 query
heads over 4 KV heads, head_dim 64, float32, one segment per row).

    JAX_PLATFORMS=cpu python benchmarks/attention_blocks.py --out /tmp/attention_blocks.json

Prints ms per forward + backward and the largest gradient difference from the unblocked path.
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

from klear_jax.models import attention as at  # noqa: E402


def grad_fn(q, k, v, cot, min_block: int, max_blocks: int):
    """Compiled d(sum(attention * cot))/d(q, k, v) with the given block settings."""
    B, T = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    at.CPU_QUERY_BLOCKS, at.CPU_MIN_QUERY_BLOCK = max_blocks, min_block  # read while tracing

    def loss(q, k, v):
        out = at.xla_attention(q, k, v, pos, pos, seg, seg, recompute=True, causal_by_index=True)
        return jnp.sum(out * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--blocks", default="256,128,64,32", help="query-block sizes to compare")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    T, H, K, hd = args.seq, 8, 4, 64
    B = max(1, 4096 // T)
    rng = np.random.default_rng(0)
    q, k, v, cot = (jnp.asarray(rng.standard_normal((B, T, n, hd)), jnp.float32)
                    for n in (H, K, K, H))
    saved = at.CPU_QUERY_BLOCKS, at.CPU_MIN_QUERY_BLOCK
    try:
        fns = {"unblocked": grad_fn(q, k, v, cot, T, 1)}
        for b in (int(x) for x in args.blocks.split(",")):
            fns[f"blocks of {b}"] = grad_fn(q, k, v, cot, b, T // b)
    finally:
        at.CPU_QUERY_BLOCKS, at.CPU_MIN_QUERY_BLOCK = saved
    ref = fns["unblocked"](q, k, v)
    diffs = {name: max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ref, f(q, k, v)))
             for name, f in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(args.rounds):  # interleaved: the box's load drifts alike for every case
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            times[name].append(time.perf_counter() - t0)
    results = []
    print(f"B={B} T={T}\n{'path':<18}{'ms fwd+bwd':>12}{'max |dgrad|':>14}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        results.append({"path": name, "ms": ms, "max_grad_diff": diffs[name]})
        print(f"{name:<18}{ms:>12.1f}{diffs[name]:>14.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": jax.default_backend(), "batch": B, "seq": T,
                       "results": results}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
