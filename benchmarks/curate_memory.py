"""Peak memory of the curation pipeline vs input size (streaming check).

    python benchmarks/curate_memory.py [--sizes 250000,2500000] [--workdir /tmp/curate_mem]

For each size, generates a JSONL file of short SFT records (about 5% duplicate prompts,
0.1% containing a benchmark problem's 9-gram), then runs validate + prompt/response dedup +
9-gram decontamination against 500 generated benchmark problems and writes the kept
records as JSONL, in a fresh subprocess whose peak RSS (resource.getrusage ru_maxrss) is
reported beside the input size. The TFDS / tokenizer stage is skipped (output.tfds=False):
it runs the same streaming writer per record but tokenisation would dominate the runtime.
What grows with the input is only the dedup tables (HashSet64, 16-32 bytes per unique
key); the report shows their size.

Measured (2-core shared CPU host, `--sizes 250000,2500000`, 3.5 min in all):
| records   | input MiB | peak RSS MiB | RSS after imports | dedup tables MiB | written   | curate s |
| 250,000   | 28        | 37           | 24                | 8                | 237,500   | 17.5     |
| 2,500,000 | 292       | 193          | 24                | 128              | 2,375,000 | 158.2    |
Two tables (prompt + response) of 2^23 slots for 2.38M unique keys each (28 B/key); the
other ~41 MiB at 2.5M is mostly the previous table kept during the last resize.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VOCAB = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega").split()


def bench_problem(i: int) -> str:
    rng = random.Random(i)
    return f"Benchmark {i}: " + " ".join(rng.choice(VOCAB) for _ in range(14))


def generate(path: str, n: int, n_bench: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            j = i - 7 if i % 20 == 19 else i  # every 20th prompt repeats an earlier one
            if i % 1000 == 999:
                prompt = "Solve: " + bench_problem((i // 1000) % n_bench).split(": ", 1)[1]
            else:
                prompt = f"Compute {j % 97} times {j % 89} plus {j} for case {j}"
            resp = f"<think>{rng.randint(0, 9)} then {i}</think> result {i * 3}"
            f.write(json.dumps({"prompt": prompt, "response": resp}) + "\n")


def child(workdir: str, src: str, bench: str) -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    from klear_jax import curate as C  # after the RSS baseline: measures the import too
    rss_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c = C.curate_base()
    c.sources.gen = C.source([src], "math")
    c.decontam.benchmarks = {"gen_bench": [bench]}
    c.output.update(dir=os.path.join(workdir, "out"), name="mem", tfds=False, overwrite=True)
    t0 = time.time()
    rep = C.run(c)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    steps = {s["step"]: {"kept": s["kept"], "dropped": s["dropped"],
                         **{k: v for k, v in s["info"].items() if k in ("unique_keys", "table_bytes")}}
             for s in rep["steps"]}
    print(json.dumps({"seconds": round(time.time() - t0, 1), "written": rep["written"], "steps": steps,
                      "rss_start_mib": rss0 / 1024, "rss_after_import_mib": rss_import / 1024,
                      "rss_peak_mib": peak / 1024}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="250000,2500000")
    p.add_argument("--workdir", default="/tmp/curate_mem")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.workdir, *a.child)
    os.makedirs(a.workdir, exist_ok=True)
    bench = os.path.join(a.workdir, "bench.jsonl")
    with open(bench, "w") as f:
        for i in range(500):
            f.write(json.dumps({"problem": bench_problem(i)}) + "\n")
    rows = []
    for n in map(int, a.sizes.split(",")):
        src = os.path.join(a.workdir, f"records_{n}.jsonl")
        t0 = time.time()
        generate(src, n, 500)
        gen_s = time.time() - t0
        out = subprocess.run([sys.executable, __file__, "--workdir", a.workdir, "--child", src, bench],
                             cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"child failed:\n{out.stderr}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r.update(records=n, input_mib=os.path.getsize(src) / 2**20, generate_s=round(gen_s, 1))
        rows.append(r)
        os.remove(src)
        print(json.dumps(r), flush=True)
    print("\n| records | input MiB | peak RSS MiB | RSS after imports MiB | dedup tables MiB | "
          "written | curate s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        tables = sum(s.get("table_bytes", 0) for s in r["steps"].values()) / 2**20
        print(f"| {r['records']:,} | {r['input_mib']:.0f} | {r['rss_peak_mib']:.0f} | "
              f"{r['rss_after_import_mib']:.0f} | {tables:.0f} | {r['written']:,} | {r['seconds']} |")


if __name__ == "__main__":
    main()
