"""Host metrics of one RL step: rollout rewards and accuracy (per kind and per record
source), response lengths, group filtering, and the step's updates."""

from __future__ import annotations

import re

import numpy as np


def record_kind(rec) -> str:
    """"code" for a prompt with tests, else "math"."""
    return "code" if rec.get("tests") is not None else "math"


def _name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)[:40] or "none"


def rollout_metrics(records, rewards, correct, lengths, truncated, signal, kept,
                    batch_prompts: int) -> dict[str, float]:
    """rewards float [P, G], correct bool [P, G] (full reward), lengths / truncated [P*G],
    signal bool [P] (group has a learning signal), kept: the groups used for updates."""
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
           "accuracy": float(correct.mean())}
    groups: dict[str, list[int]] = {}
    for p, r in enumerate(records):
        groups.setdefault(record_kind(r), []).append(p)
        if r.get("source"):
            groups.setdefault("source_" + _name(r["source"]), []).append(p)
    for g, idx in groups.items():
        out[f"reward/{g}_mean"] = float(rewards[idx].mean())
        out[f"reward/{g}_std"] = float(rewards[idx].std())
        out[f"accuracy/{g}"] = float(correct[idx].mean())
    out.update({"response/length_mean": float(np.mean(lengths)),
                "response/length_max": float(np.max(lengths)),
                "response/truncation_rate": float(np.mean(truncated)),
                "groups/signal_frac": float(np.mean(signal)),
                "groups/kept": float(len(kept)),
                "groups/kept_frac": float(len(kept)) / batch_prompts})
    return out


def mean_update_metrics(ms: list[dict]) -> dict[str, float]:
    """Averages over the step's updates; min / max / sums where those are meaningful."""
    if not ms:
        return {"train/num_updates": 0.0}
    out = {}
    for k in ms[0]:
        vals = np.asarray([m[k] for m in ms], np.float64)
        if k == "ratio_min":
            out[f"train/{k}"] = float(vals.min())
        elif k == "ratio_max":
            out[f"train/{k}"] = float(vals.max())
        elif k in ("skipped", "tokens", "sft_tokens", "batch_tokens"):
            out[f"train/{k}"] = float(vals.sum())
        elif k in ("skipped_total", "lr"):
            out[f"train/{k}"] = float(vals[-1])
        else:
            out[f"train/{k}"] = float(vals.mean())
    out["train/grad_norm_max"] = float(max(m["grad_norm"] for m in ms))
    out["train/num_updates"] = float(len(ms))
    return out


def logprob_metrics(stats: list[dict]) -> dict[str, float]:
    """Entropy and the sampler-vs-trainer log-prob mismatch over the old-log-prob passes."""
    ntok = max(sum(s["tokens"] for s in stats), 1.0)
    return {"entropy": sum(s["entropy"] for s in stats) / ntok,
            "logprob_mismatch/abs_mean": sum(s["mismatch_abs"] for s in stats) / ntok,
            "logprob_mismatch/kl": sum(s["mismatch_kl"] for s in stats) / ntok,
            "logprob_mismatch/abs_max": max((s["max_mismatch_abs"] for s in stats), default=0.0)}
