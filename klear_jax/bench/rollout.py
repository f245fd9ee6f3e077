"""The ``rollout`` workload: static sampler vs rollout engine on a long-tailed length
distribution, same model, same samples, same process.

Random weights never choose to stop, so the lengths are imposed by a stop schedule: sample s
gets a budget drawn lognormally (sigma ``SIGMA``, mu solved so that the mean of the capped
lengths is ``mean_frac`` x max_new_tokens) and capped at max_new_tokens; both samplers end s
after budget[s] tokens (``budgets=``). Both draw identical tokens (checked: ``tokens_equal``).

    static   ``Sampler.generate`` over batches of ``slots`` rows (slots / n prompts a call, the
             same KV-cache rows the engine holds): every call decodes until its longest row
             ends, attending over the whole P + M cache
    engine   ``Engine.generate`` with ``slots`` decode slots, refilled between chunks

Each side runs twice, in the order static, engine, engine, static (a shared host's speed
drifts). Per side: useful_tokens_per_s (generated tokens that belong to a sample / wall
seconds of the timed calls, compilation excluded by a warm-up on the same shapes),
slot_utilisation (useful tokens / (decode steps x rows)), seconds. ``engine_vs_static`` is the ratio of the useful
token rates. Presets (picked by the driver's ``--preset`` / ``--quick``): "small" (CPU
default: bench-small, float32), "quick" (tests), "gpu" (``gpu-1.7b``: Qwen3-1.7B shape,
bfloat16, for one H200).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np
from flax import nnx

from klear_jax.bench import gpu, workloads
from klear_jax.bench.measure import peak_rss_bytes, row
from klear_jax.engine import Engine
from klear_jax.models import ModelConfig, create_model
from klear_jax.sampler import Sampler, SamplingParams

SIGMA = 1.0  # lognormal shape of the imposed lengths (a long right tail)

# The models: the train / sample workloads' shapes; bench-small and the quick one in float32
# (untied), Qwen3-1.7B with bfloat16 weights and cache.
F32 = dict(dtype="float32", param_dtype="float32", tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Preset:
    model: dict
    prompts: int          # distinct prompts
    n: int                # samples per prompt
    prompt_len: int
    max_new_tokens: int
    slots: int            # engine decode slots = static rows per call
    chunk: int            # engine decode steps per chunk
    insert_rows: int
    mean_frac: float = 0.3  # mean / max of the imposed lengths


PRESETS = {
    "quick": Preset(dict(workloads.QUICK["model"], **F32), prompts=4, n=4, prompt_len=8,
                    max_new_tokens=32, slots=8, chunk=4, insert_rows=4),
    "small": Preset(dict(workloads.FULL["model"], **F32), prompts=16, n=8, prompt_len=64,
                    max_new_tokens=384, slots=16, chunk=16, insert_rows=8),
    # sized for a 15-minute device lease: ~3 minutes with compilation (estimated)
    "gpu": Preset(dict(gpu.GPU_1_7B["model"], dtype="bfloat16", param_dtype="bfloat16"),
                  prompts=32, n=8, prompt_len=256, max_new_tokens=1024, slots=64, chunk=32,
                  insert_rows=8),
}


def lognormal_budgets(n: int, max_len: int, mean_frac: float, seed: int = 0) -> np.ndarray:
    """int32 [n] lengths in [1, max_len]: ceil(lognormal(mu, SIGMA)) capped at max_len, mu
    chosen (bisection) so that their mean is mean_frac * max_len."""
    z = np.random.default_rng(seed).standard_normal(n)

    def draw(mu):
        return np.clip(np.ceil(np.exp(mu + SIGMA * z)), 1, max_len)
    lo, hi = -5.0, math.log(max_len) + 5 * SIGMA
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if draw(mid).mean() < mean_frac * max_len else (lo, mid)
    return draw(lo).astype(np.int32)


def _side(useful: int, runs_s: list, steps_x_rows: int) -> dict:
    """One side's numbers: ``useful`` tokens and ``steps_x_rows`` decode steps x rows per run,
    ``runs_s`` the runs' wall seconds."""
    return {"useful_tokens": int(useful), "seconds": sum(runs_s), "runs_s": list(runs_s),
            "useful_tokens_per_s": useful * len(runs_s) / sum(runs_s),
            "slot_utilisation": useful / steps_x_rows}


def run_static(sampler, state, prompts, params, budgets, per_call: int):
    """(SampleOutput rows concatenated, wall seconds, sum of decode steps x rows)."""
    t0 = time.perf_counter()
    outs, cost = [], 0
    for i in range(0, len(prompts), per_call):
        rows = slice(i * params.n, (i + per_call) * params.n)
        out = sampler.generate(state, prompts[i:i + per_call], params, seed=0,
                               budgets=budgets[rows])
        outs.append(out)
        cost += sampler.last_decode_steps * len(out.lengths)
    seconds = time.perf_counter() - t0
    return np.concatenate([o.tokens for o in outs]), np.concatenate([o.lengths for o in outs]), \
        seconds, cost


def run_rollout(preset: str = "small") -> dict:
    p = PRESETS[preset]
    cfg = ModelConfig(**p.model)
    graphdef, state = nnx.split(create_model(cfg, seed=0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (p.prompts, p.prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=p.max_new_tokens, n=p.n)
    N = p.prompts * p.n
    budgets = lognormal_budgets(N, p.max_new_tokens, p.mean_frac)
    per_call = max(1, p.slots // p.n)
    sampler = Sampler(graphdef, pad_id=0, max_prompt_len=p.prompt_len)
    engine = Engine(graphdef, pad_id=0, max_prompt_len=p.prompt_len, slots=p.slots,
                    chunk=p.chunk, insert_rows=p.insert_rows)

    # warm-up on the timed shapes (compilation excluded): 1-3 token budgets
    short = np.minimum(budgets, rng.integers(1, 4, N)).astype(np.int32)
    t0 = time.perf_counter()
    run_static(sampler, state, prompts, params, short, per_call)
    engine.warmup(state, params, p.prompt_len)
    warm_s = time.perf_counter() - t0

    # ABBA: static, engine, engine, static, so that a drift in the box's speed (a shared
    # host) hits both sides alike; each side's rate is its tokens over its seconds.
    secs = {"static": [], "engine": []}
    for side in ("static", "engine", "engine", "static"):
        if side == "static":
            s_tokens, s_lengths, sec, s_cost = run_static(sampler, state, prompts, params,
                                                          budgets, per_call)
        else:
            out = engine.generate(state, prompts, params, seed=0, budgets=budgets)
            est, sec = engine.last_stats, engine.last_stats["total_s"]
        secs[side].append(sec)
    useful = int(budgets.sum())
    static = _side(int(s_lengths.sum()), secs["static"], s_cost)
    eng = _side(int(out.lengths.sum()), secs["engine"], est["decode_steps"] * p.slots)
    eng.update({k: est[k] for k in ("chunks", "inserts", "cache_length", "first_chunk_s")})
    return {"preset": preset, "model": p.model, "prompts": p.prompts, "n": p.n,
            "prompt_len": p.prompt_len, "max_new_tokens": p.max_new_tokens, "slots": p.slots,
            "chunk": p.chunk, "insert_rows": p.insert_rows, "static_rows_per_call": per_call * p.n,
            "lengths": {"mean": float(budgets.mean()), "max": int(budgets.max()),
                        "mean_over_max": float(budgets.mean() / p.max_new_tokens),
                        "p50": float(np.median(budgets)), "sigma": SIGMA, "useful": useful},
            "tokens_equal": bool((s_tokens == out.tokens).all()
                                 and (s_lengths == out.lengths).all()),
            "static": static, "engine": eng,
            "engine_vs_static": eng["useful_tokens_per_s"] / static["useful_tokens_per_s"],
            "warmup_s": warm_s, "platform": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()[:1]], "peak_rss_bytes": peak_rss_bytes()}


def rollout_lines(ro: dict) -> list[str]:
    """The rollout workload's lines of the bench table (none when it did not run)."""
    if "engine" not in ro:
        return []
    ln = ro["lengths"]
    out = [f"rollout ({ro['preset']}: {ro['prompts']} x {ro['n']} samples, prompt "
           f"{ro['prompt_len']}, lengths mean {ln['mean']:.0f} / max {ro['max_new_tokens']} = "
           f"{ln['mean_over_max']:.2f}, {ro['slots']} slots)"]
    for side in ("static", "engine"):
        out.append(row(f"{side} useful tokens/s (slot utilisation)",
                       f"{ro[side]['useful_tokens_per_s']:.0f} ({ro[side]['slot_utilisation']:.0%})"))
    out.append(row("engine / static",
                   f"{ro['engine_vs_static']:.2f}x, tokens equal: {ro['tokens_equal']}"))
    return out
