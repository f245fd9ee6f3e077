"""Compile time (lower + compile) of a forward + backward step vs depth.

Layers run under lax.scan, so compiling 16 layers should cost about the same as 2.

    JAX_PLATFORMS=cpu python benchmarks/compile_depth.py --layers 2 16 --unrolled --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from klear_jax.models import ModelConfig, Qwen  # noqa: E402


def measure(num_layers: int, remat: str, batch: int, length: int, scan: bool = True) -> dict:
    cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=64,
                      remat_policy=remat, scan_layers=scan)
    abstract = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)

    def loss(state, ids):
        model = nnx.merge(graphdef, state)
        lp, _ = model.token_logprobs(ids[:, :-1], ids[:, 1:])
        return -jnp.mean(lp)

    step = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    lowered = step.lower(state, ids)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"num_layers": num_layers, "scan_layers": scan, "remat_policy": remat, "lower_s": round(t1 - t0, 3),
            "compile_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 16])
    p.add_argument("--remat", default="full")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--unrolled", action="store_true",
                   help="also measure the unrolled layer loop (scan_layers=False) for contrast")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    measure(2, args.remat, args.batch, args.length)  # warm-up: imports, first-use caches
    rows = [measure(n, args.remat, args.batch, args.length) for n in args.layers]
    if args.unrolled:
        rows += [measure(n, args.remat, args.batch, args.length, scan=False) for n in args.layers]
    for r in rows:
        mode = "scan    " if r["scan_layers"] else "unrolled"
        print(f"{mode} layers={r['num_layers']:3d} remat={r['remat_policy']}: lower {r['lower_s']:.2f}s "
              f"compile {r['compile_s']:.2f}s total {r['total_s']:.2f}s")
    result = {"backend": jax.default_backend(), "batch": args.batch, "length": args.length,
              "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
