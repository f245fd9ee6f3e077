"""The workloads of ``klear_jax.bench`` (one per subprocess); see that package's docstring.

Model FLOPs are analytic (``klear_jax.flops.train_flops_per_token``: XLA's cost analysis
undercounts scanned layers). The train workloads build the real RL update through
``klear_jax.rl.step``, the wiring the RL loop uses.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klear_jax import checkpoint as ckpt
from klear_jax import sharding as shd
from klear_jax import train_step as ts
from klear_jax.bench.measure import (bracket_peak, jax_matmul_peak, peak_rss_bytes,
                                     round_orders)
from klear_jax.bench.reference import run_reference
from klear_jax.flops import train_flops_per_token
from klear_jax.models import ModelConfig, create_model
from klear_jax.rl.config import rl_base
from klear_jax.rl.step import build_logprob_fn, build_rl_step, rl_optimizer
from klear_jax.sampler import Sampler, SamplingParams

FULL = dict(model=dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8,
                       num_heads=8, num_kv_heads=4, head_dim=64),
            batch=8, seq=512, steps=9, prompts=8, prompt_len=64, new_tokens=256,
            decode_ctx=(64, 1024), decode_delta=64, decode_reps=7, scale_seqs=(512, 2048, 8192),
            scale_tokens=4096, scale_steps=2, compile_layers=(2, 8, 32), matmul_n=2048,
            matmul_reps=10)
QUICK = dict(model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16),
             batch=2, seq=32, steps=5, prompts=2, prompt_len=8, new_tokens=8,
             decode_ctx=(8, 32), decode_delta=7, decode_reps=2, scale_seqs=(16, 32), scale_tokens=32,
             scale_steps=1, compile_layers=(1, 2), matmul_n=128, matmul_reps=3)


def sizes(quick: bool) -> dict:
    return QUICK if quick else FULL


def model_config(quick: bool = False, **overrides) -> ModelConfig:
    kw = dict(sizes(quick)["model"], dtype="float32", param_dtype="float32",
              tie_word_embeddings=False, remat_policy="none", logprob_remat=False)
    kw.update(overrides)
    return ModelConfig(**kw)


def rl_config():
    """The RL config whose update is benchmarked: GPPO (dual clip 10) + 0.1 x positive NLL,
    AdamW (lr 1e-6 constant, weight decay 0.1, clip 1.0), one update, no micro-batching."""
    c = rl_base()
    c.train.update(num_minibatches=1, num_microbatches=1, total_steps=1000)
    c.rollout.update(temperature=1.0)
    c.optim.update(lr=1e-6, end_lr=1e-6, schedule="constant", warmup_steps=0,
                   weight_decay=0.1, clip_norm=1.0)
    return c


def single_device_mesh():
    return shd.make_mesh(1, -1, 1, devices=jax.devices()[:1])


def rl_batch(cfg, B: int, T: int, seed: int = 0) -> dict:
    """A synthetic RL mini-batch [B, T] in ``rl_batch``'s layout: a 1/8 prompt, the rest the
    response; advantages +-1 per row, positive = advantage > 0; sampler_logp zeros."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    mask[:, max(T // 8, 1) - 1:] = 1.0
    adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask,
            "segment_ids": np.ones((B, T), np.int32), "advantages": adv,
            "positive": adv > 0, "sampler_logp": np.zeros((B, T), np.float32)}


def reference_batch(cfg, B: int, T: int) -> dict:
    """The keys of ``rl_batch`` the PyTorch reference reads, ``positive`` as float32."""
    host = rl_batch(cfg, B, T)
    batch = {k: host[k] for k in ("input_ids", "targets", "loss_mask", "advantages")}
    batch["positive"] = host["positive"].astype(np.float32)
    return batch


# ----------------------------------------------------------------------------- train
def build_train(cfg, B: int, T: int, seed: int = 0, model_old_logp: bool = True):
    """(run(state) -> (state, metrics), state, compiled, timings) for the real RL train step.
    old_logp comes from the real old-logprob pass, or is zeros (same step cost, one compile
    fewer) when ``model_old_logp`` is False."""
    rcfg = rl_config()
    mesh = single_device_mesh()
    optimizer, schedule = rl_optimizer(rcfg)
    model = create_model(cfg, seed=seed, mesh=mesh)
    graphdef, state, shardings = ts.init_train_state(model, optimizer, mesh)
    del model
    step = build_rl_step(rcfg, graphdef, optimizer, schedule, mesh, shardings)
    host = rl_batch(cfg, B, T, seed)
    bsh = ts.batch_sharding(mesh)
    batch = {k: jax.device_put(v, bsh) for k, v in host.items()}
    if model_old_logp:
        old_logp, _ = build_logprob_fn(rcfg, graphdef, mesh, shardings)(state.params, batch)
    else:
        old_logp = batch["sampler_logp"]
    batch = {k: v for k, v in batch.items() if k != "sampler_logp"}
    batch["old_logp"] = old_logp
    compiled, timings = timed_compile(step, state, batch)

    def run(state):
        with shd.use_mesh(mesh):
            return compiled(state, batch)
    return run, state, compiled, timings


def timed_compile(step, state, batch):
    """(compiled ``step``, {lower_s, compile_s: lower + XLA compile, xla_compile_s})."""
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, {"lower_s": t1 - t0, "compile_s": t2 - t0, "xla_compile_s": t2 - t1}


def time_train(run, state, warmup: int, steps: int):
    """(median step seconds, all step times, last metrics)."""
    for _ in range(warmup):
        state, m = run(state)
        jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = run(state)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, {k: float(v) for k, v in m.items()}


def memory_stats(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    d = {k: int(getattr(ma, k + "_size_in_bytes", 0) or 0)
         for k in ("argument", "output", "temp", "alias", "generated_code")}
    d["peak_estimate"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    return d


def run_train(quick: bool) -> dict:
    s = sizes(quick)
    cfg = model_config(quick)
    before = jax_matmul_peak(s["matmul_n"], s["matmul_reps"])
    run, state, compiled, ct = build_train(cfg, s["batch"], s["seq"])
    med, times, metrics = time_train(run, state, warmup=2, steps=s["steps"])
    mm = bracket_peak(before, jax_matmul_peak(s["matmul_n"], s["matmul_reps"]))
    tokens = s["batch"] * s["seq"]
    flops = train_flops_per_token(cfg, s["seq"]) * tokens
    return dict(ct, batch=s["batch"], seq_len=s["seq"], step_s=med, step_times_s=times,
                tokens_per_s=tokens / med, model_flops_per_step=flops,
                achieved_flops=flops / med, matmul=mm, mfu=flops / med / mm["peak_flops"],
                memory=memory_stats(compiled), peak_rss_bytes=peak_rss_bytes(),
                loss=metrics["loss"], remat_policy=cfg.remat_policy,
                logprob_remat=cfg.logprob_remat,
                logprob_chunk_size=cfg.logprob_chunk_size)


# ----------------------------------------------------------------------------- sample
def decode_step_runs(sampler, state, prompts_by_ctx: dict, new_tokens: int, reps: int) -> dict:
    """{context length: [decode-loop seconds per step] x reps}: the decode loop's own wall
    time (``Sampler.last_timings["decode_s"]``) over its ``new_tokens - 1`` steps (the first
    token comes from the prefill). The contexts take turns (one call each per rep, order
    reversed every other rep), so a drift in the box's speed hits every context alike; timing
    whole calls instead would add the long prefill's run-to-run noise."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    for ps in prompts_by_ctx.values():  # compile every shape first
        sampler.generate(state, ps, params, seed=0)
    runs = {c: [] for c in prompts_by_ctx}
    for r, order in enumerate(round_orders(list(runs), reps)):
        for c in order:
            out = sampler.generate(state, prompts_by_ctx[c], params, seed=r + 1)
            assert int(out.lengths.min()) == new_tokens, out.lengths
            runs[c].append(sampler.last_timings["decode_s"] / (sampler.last_decode_steps - 1))
    return runs


def run_sample(quick: bool) -> dict:
    s = sizes(quick)
    cfg = model_config(quick)
    graphdef, state = nnx.split(create_model(cfg, seed=0))
    sampler = Sampler(graphdef, mesh=None, pad_id=0, max_prompt_len=max(s["decode_ctx"]))
    rng = np.random.default_rng(0)
    prompts = lambda P: rng.integers(1, cfg.vocab_size, (s["prompts"], P)).tolist()

    def gen(P, M, reps):
        """(first-call seconds incl. compile, median of ``reps`` timed calls)."""
        params = SamplingParams(temperature=1.0, max_new_tokens=M)
        ps = prompts(P)
        t0 = time.perf_counter()
        out = sampler.generate(state, ps, params, seed=0)
        first = time.perf_counter() - t0
        assert int(out.lengths.min()) == M, out.lengths
        ts_ = []
        for r in range(reps):
            t0 = time.perf_counter()
            sampler.generate(state, ps, params, seed=r + 1)
            ts_.append(time.perf_counter() - t0)
        return first, statistics.median(ts_)

    N, P, M = s["prompts"], s["prompt_len"], s["new_tokens"]
    first, t_gen = gen(P, M, 3)
    _, ttft = gen(P, 1, 3)
    runs = decode_step_runs(sampler, state, {c: prompts(c) for c in s["decode_ctx"]},
                            1 + s["decode_delta"], s["decode_reps"])
    decode = {str(c): statistics.median(ts) for c, ts in runs.items()}
    lo, hi = (str(c) for c in s["decode_ctx"])
    return {"prompts": N, "prompt_len": P, "new_tokens": M, "generate_s": t_gen,
            "first_call_s": first, "tokens_per_s": N * M / t_gen, "ttft_s": ttft,
            "decode_step_s": decode, "decode_cost_ratio": decode[hi] / decode[lo],
            "decode_step_runs_s": {str(c): ts for c, ts in runs.items()},
            "decode_delta_tokens": s["decode_delta"], "sampling": "temperature 1, no top-k/top-p",
            "peak_rss_bytes": peak_rss_bytes()}


# ----------------------------------------------------------------------------- scale
def compile_time(cfg, B: int, T: int) -> dict:
    """Lower + compile the real train step from abstract shapes (no parameters allocated)."""
    rcfg = rl_config()
    mesh = single_device_mesh()
    optimizer, schedule = rl_optimizer(rcfg)
    graphdef, abstract_params = ckpt.abstract_model(cfg, mesh)
    state, shardings = ts.abstract_train_state(abstract_params, optimizer, mesh)
    step = build_rl_step(rcfg, graphdef, optimizer, schedule, mesh, shardings)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
             for k, v in rl_batch(cfg, B, T).items() if k != "sampler_logp"}
    batch["old_logp"] = jax.ShapeDtypeStruct((B, T), jnp.float32)
    return {"num_layers": cfg.num_layers, **timed_compile(step, state, batch)[1]}


def run_scale(quick: bool) -> dict:
    s = sizes(quick)
    rows = []
    for T in s["scale_seqs"]:
        cfg = model_config(quick, remat_policy="full", logprob_remat=True)
        B = max(1, s["scale_tokens"] // T)
        run, state, compiled, ct = build_train(cfg, B, T, model_old_logp=False)
        med, times, _ = time_train(run, state, warmup=1, steps=s["scale_steps"])
        rows.append(dict(seq_len=T, batch=B, step_s=med, step_times_s=times,
                         tokens_per_s=B * T / med, compile_s=ct["compile_s"],
                         temp_bytes=memory_stats(compiled).get("temp", 0)))
        del run, state, compiled
    compile_time(model_config(quick, num_layers=1), s["batch"], s["seq"])  # warm-up
    comp = [compile_time(model_config(quick, num_layers=n), s["batch"], s["seq"])
            for n in s["compile_layers"]]
    lo, hi = comp[0]["compile_s"], comp[-1]["compile_s"]
    return {"seq": rows, "compile": comp, "compile_ratio": hi / lo,
            "rows": f"B = max(1, {s['scale_tokens']} // T); remat_policy=full",
            "peak_rss_bytes": peak_rss_bytes()}


# ----------------------------------------------------------------------------- reference
def run_reference_workload(quick: bool, threads: int) -> dict:
    s = sizes(quick)
    cfg = model_config(quick)
    batch = reference_batch(cfg, s["batch"], s["seq"])
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (s["prompts"], s["prompt_len"]))
    out = run_reference(cfg, batch, prompts, s["new_tokens"], s["steps"], s["matmul_n"],
                        s["matmul_reps"], threads)
    flops = train_flops_per_token(cfg, s["seq"]) * s["batch"] * s["seq"]
    out["mfu"] = flops / out["train_step_s"] / out["matmul"]["peak_flops"]
    out["tokens_per_s"] = out["train_tokens_per_s"]
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out
