"""The embedded default: the paper's pipeline in miniature, on a CPU, in minutes.

    python -m klear_jax.demo --workdir DIR [--seed N] [--size default|tiny]
    python -m klear_jax.demo --ablation --workdir DIR [--seeds 3]

Stages (each a real entry point of the project, called in-process with a config from
``klear_jax.demo.config``):
  1. data   synthetic math (multi-step arithmetic) and code (small Python functions with
            hidden function-call tests) problems; an imperfect teacher's worked solutions
            (about 30% wrong) for SFT; a locally trained byte-level BPE tokenizer; TFDS
            ArrayRecord datasets written by ``klear_jax.data.prepare``; held-out problems
            as JSONL in the eval command's input format (DIR/data/heldout_{math,code}.jsonl).
  2. sft    ``klear_jax.sft`` trains a small Qwen3-architecture model from scratch.
  3. rl     ``klear_jax.rl`` with GPPO from the SFT weights: code (soft pass rate of the
            hidden tests, run in the bubblewrap sandbox), then math (math-verify rewards);
            the order is ``demo_settings().rl_order`` (math last keeps the math gain).
  4. eval   ``klear_jax.eval`` reloads the SFT and the final RL checkpoints from disk and
            scores the held-out sets: avg@k at temperatures 1.0 and 0.6, and greedy.
Writes DIR/summary.json, DIR/curves.png, TensorBoard logs under DIR/{sft,rl_math,rl_code}/tb.

Code rewards run model-written programs; without bubblewrap the demo stops unless
``--allow_unsandboxed`` is given (then programs run with rlimits and timeouts only).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from klear_jax import config as C
from klear_jax import logs
from klear_jax import eval as ev
from klear_jax import rl, sft
from klear_jax.data import prepare as prep
from klear_jax.data import tokenizer as tk
from klear_jax.demo import config as demo_config
from klear_jax.demo import report
from klear_jax.demo import tasks as dt
from klear_jax.demo.config import demo_settings
from klear_jax.metrics import read_jsonl
from klear_jax.rewards import (CodeRewardConfig, MathRewardConfig, Sandbox, SandboxConfig,
                               SandboxUnavailable)

log = logging.getLogger("klear_jax.demo")


def load_demo_config(stage: str, size: str, steps: int = 0, overrides=()):
    arg = f"stage={stage},size={size}" + (f",steps={steps}" if steps else "")
    cfg = demo_config.get_config(arg)
    cfg.lock()
    return C.apply_overrides(cfg, overrides)


def check_sandbox(allow_unsandboxed: bool) -> str:
    """The sandbox mode code rewards will use; SandboxUnavailable when there is none."""
    return Sandbox(SandboxConfig(allow_unsandboxed=allow_unsandboxed)).mode


# ------------------------------------------------------------------------------ stages
def build_data(workdir: str, size: str, seed: int) -> dict:
    """Task files, tokenizer and TFDS datasets under ``workdir``; returns their locations."""
    s = demo_settings(size)
    info = dt.build_task_files(os.path.join(workdir, "data"), seed, s.n_sft, s.n_rl, s.n_eval,
                               s.math_error, s.code_error, s.code_frac, tuple(s.num_ops),
                               s.num_tests, s.max_operand)
    tok_dir = os.path.join(workdir, "tokenizer")
    tok = tk.train_tokenizer(dt.tokenizer_corpus(info["paths"]), s.vocab, tok_dir)
    if len(tok) > s.vocab:
        raise RuntimeError(f"demo tokenizer has {len(tok)} tokens > model vocab {s.vocab}")
    tfds_dir = os.path.join(workdir, "tfds")
    reports = {}
    for name, kind in (("demo_sft", "sft"), ("demo_rl_math", "rl_math"),
                       ("demo_rl_code", "rl_code")):
        reports[name] = prep.prepare([info["paths"][kind]], tfds_dir, name, kind, tok_dir,
                                     max_length=128, overwrite=True)["splits"]
    info.update(tokenizer=tok_dir, tfds=tfds_dir, vocab_used=len(tok), prepare=reports)
    with open(os.path.join(workdir, "data_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def run_sft(workdir: str, data: dict, size: str, seed: int, steps: int = 0) -> dict:
    cfg = load_demo_config("sft", size, steps, [
        f"workdir={os.path.join(workdir, 'sft')}", f"data.dir={data['tfds']}",
        f"seed={seed}"])
    t0 = time.perf_counter()
    out = sft.run(cfg)
    return {"steps": out["step"], "stopped": out["stopped"], "wall_s": time.perf_counter() - t0,
            "final_loss": out["last_metrics"].get("loss"), "dir": cfg.workdir}


def run_rl(workdir: str, name: str, init_dir: str, data: dict, task: str, size: str,
           seed: int, steps: int = 0, overrides=(), allow_unsandboxed: bool = False) -> dict:
    """One GPPO run on ``task`` ('math' | 'code') from the params in ``init_dir``;
    ``allow_unsandboxed`` lets the code rewards run without bubblewrap (the demo's flag)."""
    cfg = load_demo_config("rl", size, steps, [
        f"workdir={os.path.join(workdir, name)}", f"data.dir={data['tfds']}",
        f"data.name=demo_rl_{task}", f"data.tokenizer={data['tokenizer']}",
        f"init.path={init_dir}", f"seed={seed}",
        f"reward.code.allow_unsandboxed={str(bool(allow_unsandboxed)).lower()}", *overrides])
    t0 = time.perf_counter()
    out = rl.run(cfg)
    return {"steps": out["step"], "updates": out["updates"], "stopped": out["stopped"],
            "wall_s": time.perf_counter() - t0, "dir": cfg.workdir}


def run_eval(ckpt_dir: str, data: dict, out_dir: str, size: str, seed: int,
             allow_unsandboxed: bool, temperatures=None, tasks=("math", "code"),
             greedy: bool = True) -> dict:
    """Reloads the checkpoint in ``ckpt_dir`` from disk with ``klear_jax.eval`` and scores the
    held-out sets: {task: {setting: eval_metrics.summarize(...)}}, settings ``t1_0`` /
    ``t0_6`` (avg@k, k = eval_k) and ``greedy``."""
    s = demo_settings(size)
    temps = s.eval_temperatures if temperatures is None else temperatures
    benches = [ev.Benchmark(t, data["paths"][f"heldout_{t}"], t, s.eval_k) for t in tasks]
    settings = [ev.Setting("t" + str(float(t)).replace(".", "_"), temperature=float(t),
                           top_p=s.eval_top_p, max_new_tokens=s.eval_max_new_tokens)
                for t in temps]
    settings += [] if not greedy else [ev.Setting("greedy", temperature=0.0, max_new_tokens=s.eval_max_new_tokens,
                               num_samples=1)]
    sandbox = SandboxConfig(timeout_s=5.0, max_tests=s.num_tests, memory_mb=512,
                            allow_unsandboxed=allow_unsandboxed)
    code = CodeRewardConfig(dedupe=True, sandbox=sandbox)
    out = ev.evaluate(ckpt_dir, data["tokenizer"], benches, settings, out_dir=out_dir,
                      seed=seed, max_prompt_len=64, math_reward=MathRewardConfig(num_workers=1),
                      code_reward=code, log=log.info)
    return out["results"]


def _brief(r: dict) -> dict:
    keep = ("accuracy", "pass_rate", "response_length_mean", "truncation_rate")
    return {k: r[k] for k in keep if k in r} | {"pass@k": r.get("pass@k")}


def task_summary(sft_res: dict, rl_res: dict, k: int) -> dict:
    """{"math": {"sft_accuracy", "rl_accuracy", ...}, "code": {...}}. *_accuracy is avg@k at
    temperature 1.0 (the RL sampling temperature); the other settings sit beside it."""
    out = {}
    for task in ("math", "code"):
        a, b = sft_res[task], rl_res[task]
        d = {"sft_accuracy": a["t1_0"]["accuracy"], "rl_accuracy": b["t1_0"]["accuracy"],
             "metric": f"avg@{k} at temperature 1.0 (code: all hidden tests pass)"}
        for tag in a:
            d[f"sft_{tag}"], d[f"rl_{tag}"] = _brief(a[tag]), _brief(b[tag])
        d["gain_t1_0"] = d["rl_accuracy"] - d["sft_accuracy"]
        out[task] = d
    return out


# ------------------------------------------------------------------------------ the demo
def run_demo(workdir: str, size: str = "default", seed: int = 0,
             allow_unsandboxed: bool = False, sft_steps: int = 0, rl_steps: int = 0,
             code_rl_steps: int = 0) -> dict:
    """Runs every stage into ``workdir``; returns (and writes) the summary dict."""
    os.makedirs(workdir, exist_ok=True)
    mode = check_sandbox(allow_unsandboxed)
    s = demo_settings(size)
    t0 = time.perf_counter()
    times = {}

    def timed(name, fn, *a, **kw):
        t = time.perf_counter()
        log.info("demo: stage %s ...", name)
        r = fn(*a, **kw)
        times[name] = time.perf_counter() - t
        log.info("demo: stage %s done in %.1f s", name, times[name])
        return r

    data = timed("data", build_data, workdir, size, seed)
    sft = timed("sft", run_sft, workdir, data, size, seed, sft_steps)
    runs, init = {}, sft["dir"]  # RL stages chained in demo_settings().rl_order
    for task in s.rl_order:
        code = task == "code"
        r = timed(f"rl_{task}", run_rl, workdir, f"rl_{task}", init, data, task, size, seed,
                  (code_rl_steps or s.code_rl_steps) if code else rl_steps,
                  s.code_rl_overrides if code else (), allow_unsandboxed)
        runs[task], init = r, r["dir"]
    rl_math, rl_code, final = runs["math"], runs["code"], runs[s.rl_order[-1]]
    ev_dir = os.path.join(workdir, "eval")
    sft_res = timed("eval_sft", run_eval, sft["dir"], data, os.path.join(ev_dir, "sft"), size,
                    seed, allow_unsandboxed)
    rl_res = timed("eval_rl", run_eval, final["dir"], data, os.path.join(ev_dir, "rl"), size,
                   seed, allow_unsandboxed)
    summary = task_summary(sft_res, rl_res, s.eval_k)
    summary.update({
        "seed": seed, "size": size, "sandbox": mode,
        "steps": {"sft": sft["steps"], "rl_math": rl_math["steps"], "rl_code": rl_code["steps"],
                  "rl_updates": rl_math["updates"] + rl_code["updates"]},
        "teacher_accuracy": data["teacher_accuracy"], "counts": data["counts"],
        "heldout": {k: data["paths"][f"heldout_{k}"] for k in ("math", "code")},
        "rl_order": list(s.rl_order),
        "checkpoints": {"sft": sft["dir"], "rl": final["dir"], "rl_math": rl_math["dir"],
                        "rl_code": rl_code["dir"]},
        "stage_wall_s": times, "wall_time_s": time.perf_counter() - t0,
        "load_average": list(os.getloadavg()), "cpu_count": os.cpu_count()})
    report.plot_curves([runs[t]["dir"] for t in s.rl_order],
                            os.path.join(workdir, "curves.png"))
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


# ------------------------------------------------------------------------------ ablation
def _mean_metric(run_dir: str, key: str) -> float:
    vals = [r[key] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if key in r]
    return float(sum(vals) / len(vals)) if vals else float("nan")


def run_ablation(workdir: str, size: str = "default", seeds: int = 0,
                 allow_unsandboxed: bool = False, rl_steps: int = 0) -> dict:
    """RL from one SFT checkpoint with each policy loss (math) and soft vs all-or-nothing
    code reward (gppo), K mini-batch updates per rollout, over seeds; held-out avg@k at
    T=1.0 per run. Reuses DIR/data_info.json and DIR/sft when present (e.g. after the demo).
    Writes DIR/ablation/{ablation.md, ablation.json, ablation.png}."""
    check_sandbox(allow_unsandboxed)
    s = demo_settings(size)
    seeds = seeds or s.ablation_seeds
    t0 = time.perf_counter()
    info_path = os.path.join(workdir, "data_info.json")
    if os.path.exists(info_path) and os.path.isdir(os.path.join(workdir, "sft", "checkpoints")):
        with open(info_path) as f:
            data = json.load(f)
        sft_dir = os.path.join(workdir, "sft")
    else:
        data = build_data(workdir, size, 0)
        sft_dir = run_sft(workdir, data, size, 0)["dir"]
    ab = os.path.join(workdir, "ablation")
    os.makedirs(ab, exist_ok=True)
    sft_res = run_eval(sft_dir, data, os.path.join(ab, "eval_sft"), size, 0, allow_unsandboxed,
                       temperatures=(1.0,), greedy=False)
    sft_acc = {"math": sft_res["math"]["t1_0"]["accuracy"],
               "code": sft_res["code"]["t1_0"]["accuracy"],
               "code_pass_rate": sft_res["code"]["t1_0"]["pass_rate"]}
    K = s.ablation_minibatches
    variants = [(loss, "math", [f"loss.kind={loss}"]) for loss in s.ablation_losses]
    variants += [(f"gppo_code_{m}", "code", ["reward.code.mode=" + m, *s.code_rl_overrides])
                 for m in s.ablation_code_modes]
    rows, path_json = [], os.path.join(ab, "ablation.json")
    for seed in range(seeds):  # seeds outermost: a cut-short run still covers every variant
        for name, task, ov in variants:
            run = f"{name}_s{seed}"
            steps = rl_steps or (s.code_rl_steps if task == "code" else 0)
            r = run_rl(ab, run, sft_dir, data, task, size, seed, steps,
                       [*ov, f"train.num_minibatches={K}"], allow_unsandboxed)
            res = run_eval(r["dir"], data, os.path.join(ab, "eval_" + run), size, seed,
                           allow_unsandboxed, temperatures=(1.0,), tasks=(task,), greedy=False)
            m = res[task]["t1_0"]
            rows.append({"variant": name, "task": task, "seed": seed, "accuracy": m["accuracy"],
                         "pass_rate": m["pass_rate"], "rl_steps": r["steps"],
                         "clipfrac_low": _mean_metric(r["dir"], "train/clipfrac_low"),
                         "clipfrac_high": _mean_metric(r["dir"], "train/clipfrac_high")})
            out = {"sft": sft_acc, "rows": rows, "num_minibatches": K,
                   "wall_time_s": time.perf_counter() - t0, "load_average": list(os.getloadavg())}
            with open(path_json, "w") as f:
                json.dump(out, f, indent=2)
            with open(os.path.join(ab, "ablation.md"), "w") as f:
                f.write(report.ablation_table(rows, sft_acc))
            report.plot_ablation(rows, sft_acc, os.path.join(ab, "ablation.png"))
            log.info("ablation: %s seed %d: avg@k %.3f", name, seed, m["accuracy"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m klear_jax.demo",
                                description="The embedded default: SFT -> GPPO -> eval on a CPU.")
    p.add_argument("--workdir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="default", choices=("default", "tiny"))
    p.add_argument("--sft_steps", type=int, default=0, help="0 = the demo config's")
    p.add_argument("--rl_steps", type=int, default=0, help="math RL steps; 0 = the config's")
    p.add_argument("--code_rl_steps", type=int, default=0)
    p.add_argument("--ablation", action="store_true", help="the loss / code-reward ablation")
    p.add_argument("--seeds", type=int, default=0, help="ablation seeds (0 = config's, 3)")
    p.add_argument("--allow_unsandboxed", action="store_true",
                   help="run model-written code WITHOUT bubblewrap isolation if it is missing")
    logs.add_argument(p)
    a = p.parse_args(argv)
    logs.setup(a.verbosity)
    try:
        if a.ablation:
            out = run_ablation(a.workdir, a.size, a.seeds, a.allow_unsandboxed, a.rl_steps)
            print(open(os.path.join(a.workdir, "ablation", "ablation.md")).read())
        else:
            out = run_demo(a.workdir, a.size, a.seed, a.allow_unsandboxed, a.sft_steps,
                           a.rl_steps, a.code_rl_steps)
            print(report.format_summary(out))
    except SandboxUnavailable as e:
        print(f"error: {e}\nThe demo's code rewards run model-written programs; pass "
              "--allow_unsandboxed to run them without isolation.", file=sys.stderr)
        return 2
    except C.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
