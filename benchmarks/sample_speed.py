"""Sampler speed: generated tokens/s, time to first token, compile time, and the per-token
decode cost with 64 vs 1024 cached prompt positions, for a random Qwen3-architecture model.

Default workload (issue 8's bench-small sample workload): vocab 32000, hidden 512, 8 layers,
8 heads, 4 KV heads, head_dim 64, MLP 1536, float32; 8 prompts x 64 tokens, 256 new tokens,
sampling at temperature 1.0 with no stop token (every row runs the full length).

    JAX_PLATFORMS=cpu python benchmarks/sample_speed.py --out /tmp/sample_speed.json

Per-token decode cost = decode wall time / decode steps (the first token comes from the
prefill). The decode attends over the whole preallocated cache (prompt bucket + new tokens)
each step, so "cached positions" here is the prompt length that fills it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from klear_jax.models import ModelConfig, create_model  # noqa: E402
from klear_jax.sampler import Sampler, SamplingParams  # noqa: E402


def run_case(sampler, state, prompts, params, repeats):
    """First call (compile + run) then ``repeats`` timed calls; medians of the latter."""
    sampler.generate(state, prompts, params, seed=0)
    first = dict(sampler.last_timings)
    runs = []
    for r in range(repeats):
        out = sampler.generate(state, prompts, params, seed=r + 1)
        assert sampler.last_decode_steps == params.max_new_tokens, "decode exited early"
        runs.append(dict(sampler.last_timings))
    med = {k: statistics.median(t[k] for t in runs) for k in runs[0]}
    n_tokens = int(out.lengths.sum())
    return {
        "first_call_s": first["total_s"],
        "compile_s": max(first["total_s"] - med["total_s"], 0.0),  # noisy on a loaded host
        "ttft_s": med["ttft_s"],
        "decode_s": med["decode_s"],
        "total_s": med["total_s"],
        "tokens_per_s": n_tokens / med["total_s"],
        "decode_tokens_per_s": (n_tokens - len(prompts) * params.n) / med["decode_s"],
        "per_token_decode_ms": 1e3 * med["decode_s"] / (params.max_new_tokens - 1),
        "generated_tokens": n_tokens,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--long-prompt-len", type=int, default=1024)
    ap.add_argument("--cost-new-tokens", type=int, default=64,
                    help="new tokens for the 64 vs 1024 cached-positions decode-cost cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, dtype=args.dtype, param_dtype=args.dtype)
    graphdef, state = nnx.split(create_model(cfg, seed=0))
    sampler = Sampler(graphdef, pad_id=0, max_prompt_len=max(args.prompt_len, args.long_prompt_len))
    rng = np.random.RandomState(0)

    def prompts(length):
        return [list(rng.randint(1, args.vocab, length)) for _ in range(args.batch)]

    results = {"config": {k: v for k, v in vars(args).items() if k != "out"},
               "device": str(jax.devices()[0]), "backend": jax.default_backend()}
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    results["sample"] = run_case(sampler, state, prompts(args.prompt_len), params, args.repeats)
    cost = SamplingParams(temperature=1.0, max_new_tokens=args.cost_new_tokens)
    for L in (args.prompt_len, args.long_prompt_len):
        results[f"decode_at_{L}"] = run_case(sampler, state, prompts(L), cost, args.repeats)
    short, long = (results[f"decode_at_{L}"]["per_token_decode_ms"]
                   for L in (args.prompt_len, args.long_prompt_len))
    results["decode_cost_ratio"] = long / short

    s = results["sample"]
    print(f"sampler, {args.layers}L hidden {args.hidden} vocab {args.vocab} {args.dtype}, "
          f"{args.batch} prompts x {args.prompt_len} tokens, {args.new_tokens} new "
          f"({jax.default_backend()})")
    print(f"{'metric':<38}{'value':>12}")
    rows = [("generated tokens/s (end to end)", s["tokens_per_s"]),
            ("decode tokens/s", s["decode_tokens_per_s"]),
            ("time to first token (s)", s["ttft_s"]),
            ("first call incl. compile (s)", s["first_call_s"]),
            ("compile estimate (s)", s["compile_s"]),
            ("per-token decode ms", s["per_token_decode_ms"])]
    for L in (args.prompt_len, args.long_prompt_len):
        rows.append((f"per-token decode ms @ {L} cached", results[f"decode_at_{L}"]["per_token_decode_ms"]))
    rows.append((f"decode cost ratio {args.long_prompt_len}/{args.prompt_len}", results["decode_cost_ratio"]))
    for name, v in rows:
        print(f"{name:<38}{v:>12.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
