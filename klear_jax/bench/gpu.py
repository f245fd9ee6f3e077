"""The accelerator preset of ``klear_jax.bench`` (``--preset gpu-1.7b``): the Qwen3-1.7B
shape on one GPU, against transformers' PyTorch Qwen3 on the same card, in one run that
fits a device lease (about 6 minutes on an H200).

    gpu_train      the real RL update (``rl.step.build_rl_step``), bf16 compute over f32
                   params, remat full, attention "auto", at each of ``train_shapes``
                   (4 x 4096 and 1 x 16384): tokens/s, MFU vs the bf16 matmul peak measured
                   in the same process, compiled memory
    gpu_sample     the sampler with bf16 weights: 64 prompts x 256 tokens, 512 new; decode
                   step time against its roofline = (bf16 weights + the filled KV cache,
                   read once per step) / the card's measured copy bandwidth
    gpu_reference  PyTorch: sdpa, autocast bf16 over f32 weights, gradient checkpointing,
                   fused AdamW, the same PPO-clip + 0.1 SFT loss, at each train shape; then
                   ``generate`` with bf16 weights on the same prompts

``--quick`` runs the same code at tiny sizes (the CPU smoke test).
"""

from __future__ import annotations

import statistics
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from klear_jax.bench import reference
from klear_jax.bench.measure import (bracket_peak, copy_bandwidth, jax_matmul_peak, peak_rss_bytes,
                                     row)
from klear_jax.bench.workloads import QUICK, build_train, memory_stats, reference_batch, time_train
from klear_jax.flops import analytical_flops, train_flops_per_token
from klear_jax.models import ModelConfig, create_model
from klear_jax.sampler import Sampler, SamplingParams

GPU_1_7B = dict(
    model=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
               num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True,
               logprob_chunk_size=1024),
    train_shapes=((4, 4096), (1, 16384)), steps=4, prompts=64, prompt_len=256,
    new_tokens=512, sample_reps=2, matmul_n=8192, matmul_reps=10, copy_bytes=4 << 30)
GPU_QUICK = dict(
    model=dict(QUICK["model"], tie_word_embeddings=True, logprob_chunk_size=32),
    train_shapes=((2, 32), (1, 64)), steps=2, prompts=4, prompt_len=8, new_tokens=8,
    sample_reps=2, matmul_n=128, matmul_reps=3, copy_bytes=1 << 20)
WORKLOADS = ("gpu_train", "gpu_sample", "gpu_reference")


def preset(quick: bool) -> dict:
    return GPU_QUICK if quick else GPU_1_7B


def model_config(quick: bool, **overrides) -> ModelConfig:
    kw = dict(preset(quick)["model"], dtype="bfloat16", param_dtype="float32",
              remat_policy="full", attention_impl="auto", logprob_remat=True)
    kw.update(overrides)
    return ModelConfig(**kw)


def run_gpu_train(quick: bool) -> dict:
    p = preset(quick)
    cfg = model_config(quick)
    before = jax_matmul_peak(p["matmul_n"], p["matmul_reps"], jnp.bfloat16)
    rows = []
    for B, T in p["train_shapes"]:
        run, state, compiled, ct = build_train(cfg, B, T, model_old_logp=False)
        med, times, metrics = time_train(run, state, warmup=1, steps=p["steps"])
        flops = train_flops_per_token(cfg, T) * B * T
        rows.append(dict(ct, batch=B, seq_len=T, step_s=med, step_times_s=times,
                         tokens_per_s=B * T / med, model_flops_per_step=flops,
                         memory=memory_stats(compiled), loss=metrics["loss"]))
        del run, state, compiled
    mm = bracket_peak(before, jax_matmul_peak(p["matmul_n"], p["matmul_reps"], jnp.bfloat16))
    for r in rows:
        r["mfu"] = r["model_flops_per_step"] / r["step_s"] / mm["peak_flops"]
    return {"shapes": rows, "matmul": mm, "attention_impl": cfg.attention_impl,
            "model": dict(p["model"]), "peak_rss_bytes": peak_rss_bytes()}


def decode_roofline(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int,
                    bytes_per_s: float) -> dict:
    """Seconds per decode step if it only read the weights and the filled KV cache (average
    fill prompt_len + new_tokens / 2; the bytes per step of ``flops.analytical_flops``) at
    ``bytes_per_s``."""
    f = analytical_flops(cfg, "decode", rows, seq=new_tokens, cache=prompt_len + new_tokens / 2)
    weights, kv = f["bytes_per_step_weights"], f["bytes_per_step_kv_total"]
    return {"weight_bytes": weights, "kv_bytes": kv,
            "roofline_step_s": (weights + kv) / bytes_per_s}


def run_gpu_sample(quick: bool) -> dict:
    p = preset(quick)
    cfg = model_config(quick, param_dtype="bfloat16")
    graphdef, state = nnx.split(create_model(cfg, seed=0))
    N, P, M = p["prompts"], p["prompt_len"], p["new_tokens"]
    sampler = Sampler(graphdef, mesh=None, pad_id=0, max_prompt_len=P)
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (N, P)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=M)
    t0 = time.perf_counter()
    sampler.generate(state, prompts, params, seed=0)
    first = time.perf_counter() - t0
    totals, steps = [], []
    for r in range(p["sample_reps"]):
        out = sampler.generate(state, prompts, params, seed=r + 1)
        assert int(out.lengths.min()) == M, out.lengths
        totals.append(sampler.last_timings["total_s"])
        steps.append(sampler.last_timings["decode_s"] / (sampler.last_decode_steps - 1))
    bw = copy_bandwidth(p["copy_bytes"], 5)
    roof = decode_roofline(cfg, N, P, M, bw["bytes_per_s"])
    step = statistics.median(steps)
    return {"prompts": N, "prompt_len": P, "new_tokens": M, "first_call_s": first,
            "generate_s": statistics.median(totals),
            "tokens_per_s": N * M / statistics.median(totals), "decode_step_s": step,
            "copy_bandwidth": bw, **roof, "decode_vs_roofline": step / roof["roofline_step_s"],
            "weights_dtype": "bfloat16", "peak_rss_bytes": peak_rss_bytes()}


def run_gpu_reference(quick: bool, threads: int) -> dict:
    p = preset(quick)
    cfg = model_config(quick)
    batches = [reference_batch(cfg, B, T) for B, T in p["train_shapes"]]
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (p["prompts"], p["prompt_len"]))
    out = reference.run_reference_accelerator(cfg, batches, prompts, p["new_tokens"], p["steps"],
                                              p["matmul_n"], p["matmul_reps"], threads)
    for r, (B, T) in zip(out["shapes"], p["train_shapes"]):
        r["mfu"] = train_flops_per_token(cfg, T) * B * T / r["step_s"] / out["matmul"]["peak_flops"]
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def ratios(res: dict) -> dict:
    """klear_jax / PyTorch per train shape and for sampling; MFU; decode vs roofline."""
    out = {}
    tr, ref = res.get("gpu_train") or {}, res.get("gpu_reference") or {}
    for a, b in zip(tr.get("shapes", ()), ref.get("shapes", ())):
        key = f"{a['batch']}x{a['seq_len']}"
        out[f"train_{key}_vs_reference"] = a["tokens_per_s"] / b["tokens_per_s"]
        out[f"train_{key}_mfu"] = a["mfu"]
    sm = res.get("gpu_sample") or {}
    if "tokens_per_s" in sm and ref.get("generate_tokens_per_s"):
        out["sample_vs_reference"] = sm["tokens_per_s"] / ref["generate_tokens_per_s"]
    if "decode_vs_roofline" in sm:
        out["decode_step_vs_roofline"] = sm["decode_vs_roofline"]
    return out


TARGETS = (("train_*_vs_reference", ">=", 1.3), ("train_*_mfu", ">=", 0.45),
           ("sample_vs_reference", ">=", 5.0), ("decode_step_vs_roofline", "<=", 1.5),
           ("rollout_engine_vs_static", ">=", 2.0))


def table_lines(res: dict) -> list[str]:
    """The bench table's lines of the accelerator workloads (none when they did not run)."""
    lines = []
    tr, sm, ref = (res.get(k) or {} for k in WORKLOADS)
    for a, b in zip(tr.get("shapes", ()), ref.get("shapes", ()) or [{}] * 9):
        lines.append(f"train {a['batch']} x {a['seq_len']} (bf16 over f32, remat full)")
        lines.append(row("klear_jax tokens/s (MFU)", f"{a['tokens_per_s']:,.0f} ({a['mfu']:.1%})"))
        if b:
            lines.append(row("PyTorch tokens/s (MFU)", f"{b['tokens_per_s']:,.0f} ({b['mfu']:.1%})"))
        lines.append(row("compiled temp GiB", f"{a['memory'].get('temp', 0) / 2**30:.1f}"))
    if "tokens_per_s" in sm:
        lines.append(f"sample {sm['prompts']} x ({sm['prompt_len']} + {sm['new_tokens']} new), bf16")
        lines.append(row("klear_jax tokens/s", f"{sm['tokens_per_s']:,.0f}"))
        if ref.get("generate_tokens_per_s"):
            lines.append(row("PyTorch generate tokens/s", f"{ref['generate_tokens_per_s']:,.0f}"))
        lines.append(row("decode step ms (roofline ms)",
                         f"{sm['decode_step_s'] * 1e3:.2f} ({sm['roofline_step_s'] * 1e3:.2f})"))
    return lines
