"""The optimizer update alone on bench-small's parameters: the optax chain with the train
step's select (how the step ran before the fused update) against ``optim.clipped_adamw``,
compiled with the train step's CPU options, params and state donated, calls interleaved.

    JAX_PLATFORMS=cpu python benchmarks/optimizer_update.py --out /tmp/optimizer_update.json
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
import optax  # noqa: E402

from klear_jax import bench_workloads as bw, optim, sharding as shd, train_step as ts  # noqa: E402
from klear_jax.models import create_model  # noqa: E402

HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def chain_step(optimizer):
    """The pre-fusion form: optax update, then keep old params and state unless ``ok``."""
    def step(params, opt_state, grads):
        ok = jnp.isfinite(optax.global_norm(grads))
        updates, new_opt = optimizer.update(grads, opt_state, params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        return keep(optax.apply_updates(params, updates), params), keep(new_opt, opt_state)
    return step


def fused_step(optimizer):
    def step(params, opt_state, grads):
        ok = jnp.isfinite(optax.global_norm(grads))
        updates, new_opt = optimizer.update(grads, opt_state, params, ok=ok)
        return optax.apply_updates(params, updates), new_opt
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    schedule = optim.make_schedule(1e-6, "constant")
    chain = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.adamw(schedule, mask=optim.decay_mask, **HYPER))
    fused = optim.clipped_adamw(schedule, mask=optim.decay_mask, clip_norm=1.0, **HYPER)
    params = ts.split_model(create_model(bw.model_config(False), seed=0))[1]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)
    options = shd.CPU_TRAINING_COMPILER_OPTIONS
    variants = {}
    for name, make, opt in (("optax_chain", chain_step, chain), ("clipped_adamw", fused_step, fused)):
        p = jax.tree.map(jnp.copy, params)
        fn = jax.jit(make(opt), donate_argnums=(0, 1), compiler_options=options)
        variants[name] = [fn, (p, opt.init(p)), []]
    for i in range(args.calls + 1):
        for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            fn, state, times = variants[name]
            t0 = time.perf_counter()
            state = jax.block_until_ready(fn(*state, grads))
            if i:  # the first call compiles
                times.append(time.perf_counter() - t0)
            variants[name][1] = state
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(variants["optax_chain"][1][0]), jax.tree.leaves(variants["clipped_adamw"][1][0])))
    out = {"params": n_params, "calls": args.calls, "max_abs_param_diff": diff}
    for name, (_, _, times) in variants.items():
        out[name] = {"median_ms": 1e3 * statistics.median(times), "runs_ms": [1e3 * t for t in times]}
        print(f"{name:14s} median {out[name]['median_ms']:7.1f} ms over {len(times)} calls")
    out["ratio"] = out["clipped_adamw"]["median_ms"] / out["optax_chain"]["median_ms"]
    print(f"clipped_adamw / optax_chain: {out['ratio']:.3f}; {n_params / 1e6:.1f}M params; "
          f"params after {args.calls + 1} updates differ by at most {diff:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
