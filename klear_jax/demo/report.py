"""Plots and tables for the demo: RL curves from metrics.jsonl, the summary line, the
ablation's markdown table (mean +- std over seeds) and bar plot."""

from __future__ import annotations

import os

import numpy as np
from matplotlib.figure import Figure  # the object API: no pyplot, no global backend

from klear_jax.metrics import read_jsonl

CURVES = (  # (title, [(metrics.jsonl key, label)])
    ("reward", [("reward/mean", "mean reward")]),
    ("training accuracy", [("accuracy", "rollout accuracy")]),
    ("response length", [("response/length_mean", "mean tokens")]),
    ("clipped fraction", [("train/clipfrac_low", "low (A<0)"), ("train/clipfrac_high",
                                                                   "high (A>0)")]),
)


def plot_curves(run_dirs: list[str], out_path: str) -> None:
    """One figure, a panel per CURVES entry; consecutive runs (math RL, then code RL) are
    laid end to end on the RL-step axis, each in its own colour."""
    fig = Figure(figsize=(4 * len(CURVES), 3.2))
    axes = fig.subplots(1, len(CURVES))
    offset = 0
    for i, d in enumerate(run_dirs):
        rows = read_jsonl(os.path.join(d, "metrics.jsonl"))
        name = os.path.basename(os.path.normpath(d))
        steps = np.asarray([r["step"] for r in rows]) + offset
        for ax, (title, keys) in zip(axes, CURVES):
            for j, (key, label) in enumerate(keys):
                ys = [r.get(key, np.nan) for r in rows]
                ax.plot(steps, ys, color=f"C{2 * i + j}", label=f"{name}: {label}")
            ax.set_title(title)
            ax.set_xlabel("RL step")
        offset = int(steps[-1]) if len(steps) else offset
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)


def format_summary(s: dict) -> str:
    parts = []
    for task in ("math", "code"):
        t = s[task]
        extra = [f"{name} {t['sft_' + tag]['accuracy']:.3f} -> {t['rl_' + tag]['accuracy']:.3f}"
                 for tag, name in (("t0_6", "T=0.6"), ("greedy", "greedy"))
                 if f"sft_{tag}" in t and f"rl_{tag}" in t]  # settings the eval ran
        parts.append(f"{task}: avg@k T=1.0 SFT {t['sft_accuracy']:.3f} -> RL "
                     f"{t['rl_accuracy']:.3f}" + (f" ({'; '.join(extra)})" if extra else ""))
    return "; ".join(parts) + f"; wall {s['wall_time_s']:.0f} s"


# ------------------------------------------------------------------------------ ablation
def _ms(xs, digits: int = 3) -> str:
    xs = np.asarray(xs, np.float64)
    if xs.size == 0:
        return "-"
    sd = xs.std(ddof=1) if xs.size > 1 else 0.0
    return f"{xs.mean():.{digits}f} +- {sd:.{digits}f}"


def _variants(rows: list[dict]) -> list[tuple[str, str]]:
    """The distinct (variant, task) pairs of ``rows``, in first-seen order."""
    return list(dict.fromkeys((r["variant"], r["task"]) for r in rows))


def ablation_table(rows: list[dict], sft_acc: dict) -> str:
    """rows: {"variant", "task", "seed", "accuracy", "pass_rate", "clipfrac_low",
    "clipfrac_high"}; mean +- std (sample std) over seeds per variant."""
    lines = [f"SFT checkpoint (start of every run): math avg@k {sft_acc['math']:.3f}, "
             f"code avg@k {sft_acc['code']:.3f}, code pass rate {sft_acc['code_pass_rate']:.3f}",
             "",
             "| variant | task | seeds | held-out avg@k (T=1.0) | soft pass rate | "
             "clipfrac low | clipfrac high |",
             "|---|---|---|---|---|---|---|"]
    for v, t in _variants(rows):
        g = [r for r in rows if r["variant"] == v and r["task"] == t]
        lines.append(f"| {v} | {t} | {len(g)} | {_ms([r['accuracy'] for r in g])} | "
                     f"{_ms([r['pass_rate'] for r in g])} | "
                     f"{_ms([r['clipfrac_low'] for r in g], 4)} | "
                     f"{_ms([r['clipfrac_high'] for r in g], 4)} |")
    return "\n".join(lines) + "\n"


def plot_ablation(rows: list[dict], sft_acc: dict, out_path: str) -> None:
    keys = _variants(rows)
    fig = Figure(figsize=(1.6 * max(len(keys), 2) + 1, 3.4))
    ax = fig.subplots()
    for i, (v, t) in enumerate(keys):
        acc = [r["accuracy"] for r in rows if r["variant"] == v and r["task"] == t]
        ax.bar(i, np.mean(acc), yerr=np.std(acc, ddof=1) if len(acc) > 1 else 0.0,
               color="C0" if t == "math" else "C1", capsize=4)
        ax.scatter([i] * len(acc), acc, color="k", s=8, zorder=3)
    for t, c in (("math", "C0"), ("code", "C1")):
        ax.axhline(sft_acc[t], color=c, ls="--", lw=1, label=f"SFT {t}")
    ax.set_xticks(range(len(keys)), [f"{v}\n({t})" for v, t in keys], fontsize=7)
    ax.set_ylabel("held-out avg@k, T=1.0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
