"""float32 GEMM throughput on bench-small's train-step shapes: JAX compiled with XLA CPU's
defaults (YNNPACK) and with the train step's options (Eigen), and torch.mm, interleaved in
one process (medians of 7 calls).

    JAX_PLATFORMS=cpu python benchmarks/gemm_shapes.py --out /tmp/gemm.json

Both libraries' thread pools live in this one process, so compare the JAX columns with each
other; the torch column is only indicative (the bench's reference runs torch alone).
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
import torch  # noqa: E402

from klear_jax import sharding as shd  # noqa: E402

SHAPES = {"2048^3": (2048, 2048, 2048), "x@W_up [4096,512]x[512,1536]": (4096, 512, 1536),
          "h@W_down [4096,1536]x[1536,512]": (4096, 1536, 512),
          "x@W_lm [4096,512]x[512,32000]": (4096, 512, 32000),
          "dW_up x^T@g [512,4096]x[4096,1536]": (512, 4096, 1536),
          "dW_lm x^T@g [512,4096]x[4096,32000]": (512, 4096, 32000)}


def gemms(m: int, k: int, n: int, rng) -> dict:
    """Zero-argument callables running one [m, k] x [k, n] float32 product per library."""
    a, b = (rng.standard_normal(s, np.float32) for s in ((m, k), (k, n)))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    lowered = jax.jit(jnp.dot).lower(ja, jb)
    ynn = lowered.compile()
    eigen = lowered.compile(compiler_options=shd.CPU_TRAINING_COMPILER_OPTIONS)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return {"jax_ynnpack": lambda: ynn(ja, jb).block_until_ready(),
            "jax_eigen": lambda: eigen(ja, jb).block_until_ready(),
            "torch": lambda: torch.mm(ta, tb)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rng = np.random.default_rng(0)
    fns = {name: gemms(*shape, rng) for name, shape in SHAPES.items()}
    times = {(name, lib): [] for name, libs in fns.items() for lib in libs}
    for libs in fns.values():
        for f in libs.values():
            f()  # compile / warm up
    for _ in range(args.rounds):  # interleaved: the box's load drifts alike for every case
        for (name, lib) in times:
            t0 = time.perf_counter()
            fns[name][lib]()
            times[name, lib].append(time.perf_counter() - t0)
    res = {}
    for name, (m, k, n) in SHAPES.items():
        res[name] = {lib: 2 * m * k * n / statistics.median(times[name, lib]) / 1e9
                     for lib in fns[name]}
        print(f"{name:38s}" + "".join(f"{lib:>13s} {v:6.1f}" for lib, v in res[name].items()))
    print(f"GFLOP/s, median of {args.rounds}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gflops_median": res, "threads": torch.get_num_threads()}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
