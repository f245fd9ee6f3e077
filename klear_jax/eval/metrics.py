"""Evaluation metrics: avg@k, the unbiased pass@k estimator, per-benchmark summaries, a table.

All pure functions of numpy arrays; P problems, k samples each.

    pass_at_k(n, c, k)            1 - C(n - c, k) / C(n, k)  (Chen et al. 2021): the chance
                                  that at least one of k samples drawn without replacement
                                  from n samples, c of them correct, is correct
    pass_ks(k)                    the k' reported for k samples: 1, 2, 4, ... and k itself
    summarize(correct, pass_rate, rewards, lengths, truncated) -> dict   (see below)
    format_table(results)         the printed table

avg@k is the mean over problems of the fraction of a problem's k samples that are correct
(the paper's "avg pass@1" over k samples). A sample is *correct* when it gets the
benchmark's full reward: math, the answer verifies; code, every test passes. For code the
mean *soft* pass rate (fraction of tests passed, 0 for a format failure) is reported
beside it as ``pass_rate``; for math ``pass_rate`` equals ``accuracy``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct among ``n`` samples (k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i = n-c+1}^{n} (1 - k / i): the numerically stable form of the ratio
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_ks(k: int) -> list[int]:
    """[1, 2, 4, ..., k] (powers of two below k, then k)."""
    out, p = [], 1
    while p < k:
        out.append(p)
        p *= 2
    return out + [k]


def summarize(correct: np.ndarray, pass_rate: np.ndarray, rewards: np.ndarray,
              lengths: np.ndarray, truncated: np.ndarray) -> dict:
    """Per-benchmark metrics from per-sample arrays, each [P, k].

    Returns {"num_problems", "k", "num_samples", "accuracy" (= "avg@k": mean of ``correct``),
    "avg@k", "pass_rate" (mean soft pass rate), "pass@k": {"1": .., "2": .., ..., str(k): ..}
    (mean over problems of the unbiased estimator on ``correct``), "accuracy_std_over_samples"
    (std over the k sample indices of the per-index accuracy: run-to-run spread),
    "reward_mean", "response_length_mean", "response_length_max", "truncation_rate",
    "per_problem_accuracy": [P]}.
    """
    correct = np.asarray(correct, bool)
    if correct.ndim != 2 or correct.shape[0] == 0 or correct.shape[1] == 0:
        raise ValueError(f"summarize: correct must be [P, k] with P, k >= 1, got {correct.shape}")
    shapes = {a.shape for a in map(np.asarray, (pass_rate, rewards, lengths, truncated))}
    if shapes != {correct.shape}:
        raise ValueError(f"summarize: all arrays must be {correct.shape}, got {shapes}")
    P, k = correct.shape
    c = correct.sum(1)
    acc = float(correct.mean())
    return {
        "num_problems": int(P), "k": int(k), "num_samples": int(P * k),
        "accuracy": acc, "avg@k": acc,
        "pass_rate": float(np.mean(pass_rate)),
        "pass@k": {str(kk): float(np.mean([pass_at_k(k, int(ci), kk) for ci in c]))
                   for kk in pass_ks(k)},
        "accuracy_std_over_samples": float(correct.mean(0).std()),
        "reward_mean": float(np.mean(rewards)),
        "response_length_mean": float(np.mean(lengths)),
        "response_length_max": int(np.max(lengths)),
        "truncation_rate": float(np.mean(truncated)),
        "per_problem_accuracy": [float(x) for x in correct.mean(1)],
    }


def format_table(results: Mapping[str, Mapping[str, Mapping]]) -> str:
    """``results[benchmark][setting]`` (summaries plus "kind") -> a fixed-width text table."""
    head = ("benchmark", "kind", "setting", "k", "avg@k", "pass_rate", "pass@1", "pass@k",
            "len", "trunc")
    rows = [head]
    for bench, per in results.items():
        for setting, m in per.items():
            k = m["k"]
            rows.append((bench, m.get("kind", ""), setting, str(k), f"{m['accuracy']:.4f}",
                         f"{m['pass_rate']:.4f}", f"{m['pass@k']['1']:.4f}",
                         f"{m['pass@k'][str(k)]:.4f}", f"{m['response_length_mean']:.1f}",
                         f"{m['truncation_rate']:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    line = lambda r: "  ".join(s.ljust(w) if i < 3 else s.rjust(w)  # noqa: E731
                               for i, (s, w) in enumerate(zip(r, widths)))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), sep] + [line(r) for r in rows[1:]])

