"""The bench-small train step under different malloc implementations, in fresh processes
interleaved (ABBA...): per step wall seconds, CPU seconds (user + system) and minor page
faults, medians per process, then the median over processes per allocator.

    JAX_PLATFORMS=cpu python benchmarks/allocator_ab.py --pairs 4 --out /tmp/alloc.json

Allocators: glibc (the process's own malloc), tcmalloc / jemalloc when the dynamic loader
finds them (apt-get install libtcmalloc-minimal4 libjemalloc2). Every process gets
``klear_jax.bench``'s workload environment (``worker_env``) and its tcmalloc lookup
(``malloc_preload``). docs/performance.md has the runs.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from klear_jax import bench  # noqa: E402


def preload(name: str) -> str | None:
    """The library to LD_PRELOAD for allocator ``name`` (None for glibc); exits when it is
    unknown or not installed."""
    if name == "glibc":
        return None
    lib = (bench.malloc_preload("auto") if name == "tcmalloc"
           else ctypes.util.find_library("jemalloc") if name == "jemalloc" else None)
    if lib is None:
        sys.exit(f"--allocators: {name!r} unknown or not installed (glibc, tcmalloc, jemalloc)")
    return lib


def measure(steps: int) -> dict:
    """Per-step medians of the train step in this process, after 3 warm-up steps (under
    tcmalloc the third step still faults the ~2.8 GB temp buffer in; later ones do not)."""
    import jax
    from klear_jax import bench_workloads as bw
    run, state, _, _ = bw.build_train(bw.model_config(False), 8, 512, model_old_logp=False)
    for _ in range(3):
        state, m = run(state)
        jax.block_until_ready((state, m))
    wall, cpu, faults = [], [], []
    for _ in range(steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        state, m = run(state)
        jax.block_until_ready((state, m))
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        wall.append(time.perf_counter() - t0)
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "minor_faults": statistics.median(faults), "minor_faults_per_step": faults}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allocators", default="glibc,tcmalloc")
    ap.add_argument("--pairs", type=int, default=4, help="processes per allocator")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.steps)))
        return
    if args.pairs < 1 or args.steps < 1:
        ap.error(f"--pairs and --steps must be >= 1, got {args.pairs} and {args.steps}")
    threads = bench._threads()
    env = {name: bench.worker_env(threads, preload(name)) for name in args.allocators.split(",")}
    runs = {name: [] for name in env}
    for order in bench.round_orders(list(env), args.pairs):
        for name in order:
            p = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(args.steps)],
                               env=env[name], capture_output=True, text=True,
                               check=True)
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs)
                      for k in ("wall_s", "cpu_s", "minor_faults")}
               for name, rs in runs.items()}
    for name, s in summary.items():
        print(f"{name:10s} wall {s['wall_s']:.2f} s  cpu {s['cpu_s']:.2f} s  "
              f"minor faults {s['minor_faults']:.0f} per step (medians over {args.pairs} processes)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "summary": summary}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
