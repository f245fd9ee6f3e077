"""Where the bench-small train step spends its time: one step under jax.profiler, device ops
summed by the JAX operation that produced them (HLO op_name metadata) and by fused op.

    JAX_PLATFORMS=cpu python benchmarks/profile_train_step.py --out /tmp/train_profile.json

Times come from the profiler's trace events, so they include its overhead (the traced step
runs ~20-30% slower than an untraced one); compare rows within one run, not across runs.
--batch / --seq change the shape; --logprob-remat / --remat-policy the memory settings.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import jax  # noqa: E402

from klear_jax.bench import workloads as bw  # noqa: E402

_DEF = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) .*?op_name=\"([^\"]+)\"")


def op_table(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (result shape, JAX op_name without the jit(...) prefixes)."""
    table = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            table[m.group(1)] = (m.group(2), re.sub(r"jit\([^)]*\)/", "", m.group(3)))
    return table


def trace_events(trace_dir: str) -> list[dict]:
    path = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        ev = json.load(f)
    return ev["traceEvents"] if isinstance(ev, dict) else ev


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--remat-policy", default="none")
    ap.add_argument("--logprob-remat", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = bw.model_config(False, remat_policy=args.remat_policy,
                          logprob_remat=args.logprob_remat)
    run, state, compiled, _ = bw.build_train(cfg, args.batch, args.seq, model_old_logp=False)
    state, m = run(state)
    jax.block_until_ready((state, m))  # warm-up
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            state, m = run(state)
            jax.block_until_ready((state, m))
        events = trace_events(d)
    ops = op_table(compiled.as_text())
    by_fusion, by_op = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ops:
            by_fusion[e["name"]] += e["dur"] / 1e3
            by_op[ops[e["name"]][1]] += e["dur"] / 1e3
    total = sum(by_fusion.values())
    print(f"device op time {total:.0f} ms (traced), batch {args.batch} x {args.seq}")
    print(f"\n{'ms':>9}  JAX operation")
    for name, ms in by_op.most_common(args.top):
        print(f"{ms:9.1f}  {name[:110]}")
    print(f"\n{'ms':>9}  {'fused op':<28}{'shape':<26}JAX operation")
    for name, ms in by_fusion.most_common(args.top):
        shape, op = ops[name]
        print(f"{ms:9.1f}  {name:<28}{shape:<26}{op[-70:]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"total_ms": total, "batch": args.batch, "seq": args.seq,
                       "by_op_ms": dict(by_op.most_common()),
                       "by_fusion": [{"name": n, "ms": ms, "shape": ops[n][0], "op": ops[n][1]}
                                     for n, ms in by_fusion.most_common()]}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
