"""The benchmark driver: runs each workload in a fresh process, combines rounds, computes the
ratios against the PyTorch reference, checks the targets and prints the table."""
from __future__ import annotations

import argparse
import ctypes.util
import fnmatch
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax

from klear_jax import logs
from klear_jax.bench import gpu
from klear_jax.bench.measure import round_orders, row
from klear_jax.bench.rollout import rollout_lines, run_rollout
from klear_jax.bench.workloads import (run_reference_workload, run_sample, run_scale,
                                       run_train, sizes)

WORKLOADS = ("train", "sample", "reference", "scale", "rollout")
# --preset: the CPU bench (bench-small) or an accelerator preset (klear_jax.bench.gpu); the
# rollout workload (static sampler vs engine, klear_jax.bench.rollout) runs in both, sized by
# ROLLOUT_SIZES.
PRESETS = {"small": WORKLOADS, "gpu-1.7b": gpu.WORKLOADS + ("rollout",)}
ROLLOUT_SIZES = {"small": "small", "gpu-1.7b": "gpu"}
# The number each workload's repeated runs are ranked by (``--rounds``).
HEADLINE = {"train": "tokens_per_s", "sample": "tokens_per_s",
            "reference": "train_tokens_per_s", "scale": "compile_ratio",
            "gpu_train": "wall_s", "gpu_sample": "tokens_per_s", "gpu_reference": "wall_s",
            "rollout": "engine_vs_static"}
# Numbers that come from their own median run, with the ones measured with them: the
# reference's generate (so the sample ratio pairs medians with medians) and the sampler's
# decode cost ratio (a target of its own, not ranked by generate tokens/s).
SECOND_HEADLINE = {"reference": ("generate_tokens_per_s", ("generate_s", "ttft_s")),
                   "sample": ("decode_cost_ratio", ("decode_step_s", "decode_step_runs_s"))}
# Other numbers listed per round (``rounds``).
PER_ROUND = {"train": ("mfu",)}


# ----------------------------------------------------------------------------- driver
# CPU regression checks (the numbers users care about come from accelerators: gpu.TARGETS).
TARGETS = (  # (ratio name or glob, comparison, threshold)
    ("train_vs_reference", ">=", 1.0),
    ("rollout_engine_vs_static", ">=", 2.0),
    ("sample_vs_reference", ">=", 1.5),
    ("decode_cost_1024_vs_64", "<=", 1.5),
    ("compile_32_vs_2_layers", "<=", 1.5),
)


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# glibc's malloc serves the train step's ~2.8 GB temp buffer with a fresh mmap and unmaps
# it on free, so every step page-faults it in again: ~755K minor faults and ~2 s of system
# time per bench-small step. tcmalloc keeps freed pages for reuse; with it the step took 8.27
# against 8.94 s (medians of 4 interleaved process pairs, docs/performance.md). Every
# workload, the PyTorch reference included, runs with the same allocator.
MALLOC_CHOICES = ("auto", "tcmalloc", "system")


def malloc_preload(choice: str) -> str | None:
    """The allocator library to LD_PRELOAD into every workload process for ``--malloc``:
    'auto' -> tcmalloc when installed (Debian/Ubuntu: libtcmalloc-minimal4), else None;
    'tcmalloc' -> tcmalloc or a ValueError naming the package; 'system' -> None (glibc)."""
    if choice not in MALLOC_CHOICES:
        raise ValueError(f"--malloc {choice!r}: choose from {MALLOC_CHOICES}")
    if choice == "system":
        return None
    lib = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if lib is None and choice == "tcmalloc":
        raise ValueError("--malloc tcmalloc: no libtcmalloc found by the dynamic loader; install "
                         "it (apt-get install libtcmalloc-minimal4) or pass --malloc system")
    return lib


def worker_env(threads: int, preload: str | None = None, accelerator: bool = False) -> dict:
    """The environment every workload process gets: CPU JAX with one device (unless
    ``accelerator``: JAX's default backend), the same intra-op thread count for XLA (Eigen
    pool = all cores) and torch (set explicitly), and ``preload`` (an allocator library, see
    ``malloc_preload``) ahead of any LD_PRELOAD."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TF_CPP_MIN_LOG_LEVEL="2")
    if not accelerator:
        env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    if preload:
        env["LD_PRELOAD"] = " ".join([preload] + env.get("LD_PRELOAD", "").split())
    return env


def loaded_allocator() -> str:
    """'tcmalloc' when this process has a tcmalloc library mapped, else 'system'."""
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" if any("libtcmalloc" in line for line in f) else "system"
    except OSError:
        return "system"


def run_worker(name: str, quick: bool, threads: int, preset: str = "small") -> dict:
    fns = {"train": run_train, "sample": run_sample, "scale": run_scale,
           "reference": lambda q: run_reference_workload(q, threads),
           "gpu_train": gpu.run_gpu_train, "gpu_sample": gpu.run_gpu_sample,
           "gpu_reference": lambda q: gpu.run_gpu_reference(q, threads),
           "rollout": lambda q: run_rollout("quick" if q else ROLLOUT_SIZES[preset])}
    t0 = time.perf_counter()
    out = fns[name](quick)
    out["wall_s"] = time.perf_counter() - t0
    out["allocator"] = loaded_allocator()
    if "reference" not in name:
        out["jax_version"] = jax.__version__
        out["jax_devices"] = [str(d) for d in jax.devices()]
    return out


def spawn(name: str, quick: bool, threads: int, timeout: float,
          preload: str | None = None, preset: str = "small") -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{name}.json")
        cmd = [sys.executable, "-m", "klear_jax.bench", "--worker", name, "--worker-out", path,
               "--threads", str(threads), "--preset", preset] + (["--quick"] if quick else [])
        env = worker_env(threads, preload, accelerator=preset != "small")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not os.path.exists(path):
            return {"error": f"workload {name!r} exited with {p.returncode}",
                    "stderr_tail": p.stderr[-3000:]}
        with open(path) as f:
            return json.load(f)


def combine_runs(workload: str, runs: list[dict]) -> dict:
    """The median run by ``HEADLINE``, with ``SECOND_HEADLINE``'s numbers from their own."""
    out = dict(median_run(runs, HEADLINE[workload]))
    if workload in SECOND_HEADLINE:
        key, measured_with = SECOND_HEADLINE[workload]
        other = median_run(runs, key)
        out.update({k: other[k] for k in (key, *measured_with) if k in other})
    return out


def round_values(workload: str, runs: list[dict]) -> dict:
    """'rounds' entries: each headline's value per run, keyed 'workload', and the
    ``PER_ROUND`` / ``SECOND_HEADLINE`` numbers, keyed 'workload:key'."""
    out = {workload: [r.get(HEADLINE[workload]) for r in runs]}
    keys = PER_ROUND.get(workload, ()) + SECOND_HEADLINE.get(workload, ())[:1]
    out.update({f"{workload}:{key}": [r.get(key) for r in runs] for key in keys})
    return out


def median_run(runs: list[dict], key: str) -> dict:
    """The run with the median ``key`` (the lower one of an even count); runs without it
    (errors) only when no run has it."""
    ok = sorted((r for r in runs if key in r), key=lambda r: r[key])
    return ok[(len(ok) - 1) // 2] if ok else runs[-1]


def machine_info(threads: int, preload: str | None = None) -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "threads": threads,
            "xla_threads": f"{threads} (XLA CPU intra-op pool: all cores in affinity)",
            "torch_threads": threads, "loadavg_1m": os.getloadavg()[0],
            "malloc": f"LD_PRELOAD={preload}" if preload else "system (glibc)"}


def ratios(res: dict) -> dict:
    """The CPU workloads' ratios and the rollout's (both presets run it; the accelerator
    workloads' are ``gpu.ratios``)."""
    g = lambda w, k: (res.get(w) or {}).get(k)
    out = {}
    tr, ref, sm, sc = g("train", "tokens_per_s"), g("reference", "train_tokens_per_s"), \
        g("sample", "tokens_per_s"), g("scale", "compile_ratio")
    if tr and ref:
        out["train_vs_reference"] = tr / ref
    if g("train", "mfu"):
        out["train_mfu_vs_jax_peak"] = g("train", "mfu")
    if sm and g("reference", "generate_tokens_per_s"):
        out["sample_vs_reference"] = sm / g("reference", "generate_tokens_per_s")
    if g("sample", "decode_cost_ratio"):
        out["decode_cost_1024_vs_64"] = g("sample", "decode_cost_ratio")
    if sc:
        out["compile_32_vs_2_layers"] = sc
    if g("rollout", "engine_vs_static"):
        out["rollout_engine_vs_static"] = g("rollout", "engine_vs_static")
    if g("train", "matmul") and g("reference", "matmul"):
        out["jax_vs_torch_matmul_peak"] = (res["train"]["matmul"]["peak_flops"]
                                          / res["reference"]["matmul"]["peak_flops"])
    return out


def targets(r: dict, table=TARGETS) -> dict:
    """{ratio: value, target, met} for every ratio a (glob) name of ``table`` matches."""
    out = {}
    for pattern, op, thr in table:
        for name in sorted(fnmatch.filter(r, pattern)):
            v = r[name]
            out[name] = {"value": v, "target": f"{op} {thr}",
                         "met": bool(v >= thr if op == ">=" else v <= thr)}
    return out


def table_lines(res: dict) -> list[str]:
    """The bench table's lines of the CPU workloads (none when they did not run)."""
    lines = []
    add = lambda k, v: lines.append(row(k, v))  # noqa: E731
    t, s, sc, ref = (res.get(k) or {} for k in ("train", "sample", "scale", "reference"))
    if "tokens_per_s" in t:
        lines.append(f"train (B={t['batch']} x T={t['seq_len']}, GPPO, AdamW)")
        add("tokens/s (median)", f"{t['tokens_per_s']:.0f}")
        add("MFU vs JAX f32 matmul peak", f"{t['mfu']:.1%} (peak {t['matmul']['peak_flops']/1e9:.1f} GFLOP/s)")
        add("compile s", f"{t['compile_s']:.1f}")
        add("peak memory (compiled est / process RSS) MiB",
            f"{t['memory'].get('peak_estimate', 0)/2**20:.0f} / {t['peak_rss_bytes']/2**20:.0f}")
    if "tokens_per_s" in s:
        lines.append(f"sample ({s['prompts']} x {s['prompt_len']} prompt, {s['new_tokens']} new)")
        add("generated tokens/s", f"{s['tokens_per_s']:.0f}")
        add("time to first token s", f"{s['ttft_s']:.3f}")
        for c, v in s["decode_step_s"].items():
            add(f"decode step ms at {c} cached", f"{v*1e3:.2f}")
    if "seq" in sc:
        lines.append(f"scale ({sc['rows']})")
        for r in sc["seq"]:
            add(f"T={r['seq_len']} B={r['batch']} tokens/s", f"{r['tokens_per_s']:.0f}")
        for r in sc["compile"]:
            add(f"compile s at {r['num_layers']} layers", f"{r['compile_s']:.1f}")
    if "train_tokens_per_s" in ref:
        lines.append("reference (transformers PyTorch Qwen3)")
        add("train tokens/s", f"{ref['train_tokens_per_s']:.0f}")
        add("MFU vs torch f32 matmul peak", f"{ref['mfu']:.1%} (peak {ref['matmul']['peak_flops']/1e9:.1f} GFLOP/s)")
        add("generate tokens/s", f"{ref['generate_tokens_per_s']:.0f}")
        add("time to first token s", f"{ref['ttft_s']:.3f}")
    return lines


def table(res: dict) -> str:
    """The printed table of either preset: errors, each workload's lines, the rounds, the
    targets."""
    lines = [row(f"{w}: ERROR", r["error"]) for w, r in res.items()
             if isinstance(r, dict) and "error" in r]
    if "machine" in res:
        lines.append(row("allocator (every workload)", res["machine"]["malloc"]))
    lines += table_lines(res) + gpu.table_lines(res) + rollout_lines(res.get("rollout") or {})
    for w, values in res.get("rounds", {}).items():
        w, _, key = w.partition(":")
        lines.append(row(f"{w} {key or HEADLINE[w]} per round",
                         " / ".join(f"{v:.3g}" for v in values if v is not None)))
    lines.append("targets")
    for k, v in res.get("targets", {}).items():
        lines.append(row(k, f"{v['value']:.3f} (target {v['target']}) "
                            f"{'MET' if v['met'] else 'MISSED'}"))
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="klear_jax benchmarks (see module docstring)")
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--preset", default="small", choices=tuple(PRESETS),
                   help="small: the CPU bench (bench-small); gpu-1.7b: Qwen3-1.7B shape on one "
                        "accelerator vs PyTorch on the same card (klear_jax.bench.gpu)")
    p.add_argument("--workloads", default="",
                   help="comma-separated subset of the preset's workloads (default: all): "
                        + "; ".join(f"{k}: {','.join(v)}" for k, v in PRESETS.items()))
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--threads", type=int, default=_threads())
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per workload")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the workloads this many times, in reversed order every other "
                        "round (ABBA); each reports its median run by HEADLINE; the JSON "
                        "keeps every run whole under 'runs'")
    p.add_argument("--malloc", default="auto", choices=MALLOC_CHOICES,
                   help="allocator of every workload process: auto = tcmalloc when installed")
    p.add_argument("--worker", choices=sum(PRESETS.values(), ()), help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    logs.add_argument(p)
    a = p.parse_args(argv)
    logs.setup(a.verbosity)
    if a.worker:
        res = run_worker(a.worker, a.quick, a.threads, a.preset)
        with open(a.worker_out, "w") as f:
            json.dump(res, f)
        return res
    allowed = PRESETS[a.preset]
    names = [w.strip() for w in a.workloads.split(",") if w.strip()] or list(allowed)
    bad = [w for w in names if w not in allowed]
    if bad:
        p.error(f"--workloads: unknown {bad} for --preset {a.preset}; choose from {allowed}")
    accelerator = a.preset != "small"
    model = gpu.preset(a.quick)["model"] if accelerator else dict(sizes(a.quick)["model"],
                                                                   dtype="float32")
    res = {"workload": f"{a.preset}{'-quick' if a.quick else ''}", "model": model,
           "command": "python -m klear_jax.bench " + " ".join(argv if argv is not None else sys.argv[1:])}
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    try:
        preload = malloc_preload(a.malloc)
    except ValueError as e:
        p.error(str(e))
    runs = {w: [] for w in names}
    for order in round_orders(names, a.rounds):
        for w in order:
            t0 = time.perf_counter()
            runs[w].append(spawn(w, a.quick, a.threads, a.timeout, preload, preset=a.preset))
            print(f"[bench] {w}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            res[w] = combine_runs(w, runs[w])
            if a.rounds > 1:
                res.setdefault("rounds", {}).update(round_values(w, runs[w]))
                res["runs"] = {w: rs for w, rs in runs.items() if rs}  # every run, whole
            res["machine"] = machine_info(a.threads, preload)
            res["ratios"] = ratios(res) | gpu.ratios(res)
            res["targets"] = targets(res["ratios"], gpu.TARGETS if accelerator else TARGETS)
            if a.out:  # after every workload, so a long run keeps what it has measured
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=2)
    print(table(res))
    return res

