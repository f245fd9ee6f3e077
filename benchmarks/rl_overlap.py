"""RL step wall time with scoring overlapped with decoding vs decode-then-score, code rewards.

    JAX_PLATFORMS=cpu python benchmarks/rl_overlap.py --workdir /tmp/rl_overlap \
        [--sft_steps 500] [--steps 4] [--pairs 2] [--out rl_overlap.json]

A random model writes no code, so its responses fail the format check and the sandbox never
runs: the demo's data, tokenizer and SFT stage (``klear_jax.demo``, default size: Qwen3
shape, hidden 128, 2 layers) make a model that answers the code tasks with ```python blocks,
graded by 4 hidden function-call tests each in the bubblewrap sandbox. Then GPPO on the code
prompts with the demo's RL config as configs/gppo_tiny.py runs it (8 prompts x 8 samples a
step, 32 decode slots, chunks of 8 steps, 48 new tokens, code rewards, ``reward.code.dedupe``
off so every sample runs its tests) from the same SFT
weights, ``--steps`` steps per run, runs alternating overlap on / off (``--pairs`` of
them). Per run: the median over steps 2.. (step 1 compiles) of time/step_s, time/sample_s
(engine call, scoring submissions included when overlapped) and time/score_s (waiting for
scores after decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from klear_jax.demo import run as demo
from klear_jax.demo.config import demo_settings
from klear_jax.metrics import read_jsonl

KEYS = ("time/step_s", "time/sample_s", "time/score_s", "time/train_s", "reward/mean",
        "response/length_mean")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--sft_steps", type=int, default=500)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    info = os.path.join(a.workdir, "data_info.json")
    if os.path.exists(info):
        data = json.load(open(info))
    else:
        data = demo.build_data(a.workdir, "default", 0)
    sft_dir = os.path.join(a.workdir, "sft")
    if not os.path.isdir(os.path.join(sft_dir, "checkpoints")):
        demo.run_sft(a.workdir, data, "default", 0, a.sft_steps)
    s = demo_settings("default")
    runs = []
    for pair in range(a.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for overlap in order:
            name = f"rl_code_{'overlap' if overlap else 'serial'}_{pair}"
            demo.run_rl(a.workdir, name, sft_dir, data, "code", "default", 0, a.steps,
                        s.code_rl_overrides + ("reward.code.dedupe=false",
                                               "rollout.decode_slots=32",
                                               "rollout.decode_chunk=8",
                                               f"rollout.overlap_scoring={str(overlap).lower()}"))
            rows = read_jsonl(os.path.join(a.workdir, name, "metrics.jsonl"))[1:]
            med = {k: statistics.median(r[k] for r in rows) for k in KEYS}
            runs.append({"overlap": overlap, "pair": pair, **med})
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for overlap in (True, False):
        sel = [r for r in runs if r["overlap"] == overlap]
        summary["overlap" if overlap else "decode_then_score"] = {
            k: statistics.median(r[k] for r in sel) for k in KEYS}
    summary["step_time_ratio"] = (summary["decode_then_score"]["time/step_s"]
                                  / summary["overlap"]["time/step_s"])
    out = {"runs": runs, "summary": summary, "steps_per_run": a.steps,
           "load_average": list(os.getloadavg())}
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
