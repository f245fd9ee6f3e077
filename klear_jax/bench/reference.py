"""The PyTorch reference for ``klear_jax.bench``: transformers' Qwen3 on the same CPU.

Same model shape as the JAX workload (random init, float32, untied embeddings, sdpa
attention), same batch, AdamW. The train loss is a PPO-style clipped surrogate on the
per-token log-probabilities (the same masks, advantages and asymmetric clip range as the
GPPO workload; the clipped-gradient details of GPPO change no FLOPs) plus 0.1 x the NLL of
the positive rows, so both sides do the same work: full logits [B, T, V], log-softmax,
gather, backward, optimizer update. ``generate`` samples (temperature 1, no top-k/top-p)
with ``use_cache=True`` and ``min_new_tokens`` = ``max_new_tokens``, so every row decodes
every token, as the JAX sampler does with no stop tokens.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from klear_jax.bench.measure import bracket_peak


def torch_matmul_peak(n: int, reps: int, device: str = "cpu", dtype=None) -> dict:
    """[n, n] @ [n, n] throughput (float32 unless ``dtype``): best and median of ``reps``
    timed calls on ``device``."""
    import torch
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype or torch.float32)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype or torch.float32)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n ** 3
    return {"n": n, "peak_flops": flops / min(times),
            "median_flops": flops / statistics.median(times)}


def _sync(device: str) -> None:
    import torch
    if device != "cpu":
        torch.cuda.synchronize()


def make_model(cfg):
    """transformers Qwen3ForCausalLM with the shape of ``cfg`` (a klear_jax ModelConfig)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                     max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                     pad_token_id=0, bos_token_id=None, eos_token_id=None)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(hf).float()


def train_loss(model, batch, eps_low=0.2, eps_high=0.28, sft_alpha=0.1):
    import torch
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, batch["targets"][..., None])[..., 0]
    m = batch["loss_mask"]
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    pg = -torch.minimum(adv * ratio, adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    pos = batch["positive"][:, None] * m
    return ((pg * m).sum() / m.sum().clamp(min=1)
            + sft_alpha * (-logp * pos).sum() / pos.sum().clamp(min=1))


def _torch_batch(model, host: dict, dev: str, autocast: bool) -> dict:
    """The numpy batch as torch tensors on ``dev`` (token ids int64), with ``old_logp`` from
    one no-grad forward (under bf16 autocast when ``autocast``)."""
    import torch
    batch = {k: torch.from_numpy(np.asarray(v)).to(dev) for k, v in host.items()}
    for k in ("input_ids", "targets"):
        batch[k] = batch[k].long()
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits.float()
        batch["old_logp"] = torch.log_softmax(logits, -1).gather(
            -1, batch["targets"][..., None])[..., 0]
    return batch


def _time_train(model, opt, batch, dev: str, steps: int, autocast: bool) -> list[float]:
    """Seconds of each of ``steps`` train steps (zero grad, loss, backward, AdamW update)
    after one untimed warm-up step (allocator, AdamW state)."""
    import torch

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            loss = train_loss(model, batch)
        loss.backward()
        opt.step()

    step()
    times = []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def _generate_timer(model, prompts: np.ndarray, dev: str):
    """``gen(n)``: the seconds of one ``generate`` call of exactly n new tokens per prompt
    (sampling at temperature 1, no top-k/top-p, KV cache), after a 2-token warm-up call."""
    import torch
    ids = torch.from_numpy(np.asarray(prompts)).long().to(dev)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
              top_p=1.0, use_cache=True, pad_token_id=0)

    def gen(n):
        _sync(dev)
        t0 = time.perf_counter()
        o = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(dev)
        assert o.shape[1] == ids.shape[1] + n, o.shape
        return time.perf_counter() - t0

    gen(2)  # warm-up
    return gen


def run_reference(cfg, batch_np: dict, prompts: np.ndarray, new_tokens: int, steps: int,
                  matmul_n: int, matmul_reps: int, threads: int) -> dict:
    """Reference train tokens/s + MFU vs torch's matmul peak, generate tokens/s + TTFT."""
    import torch
    import transformers
    torch.set_num_threads(threads)
    out = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
           "torch_threads": torch.get_num_threads(), "attn_implementation": "sdpa",
           "loss": "ppo-clip surrogate on token logprobs + 0.1 x positive-row NLL"}
    peak_before = torch_matmul_peak(matmul_n, matmul_reps)
    model = make_model(cfg)
    batch = _torch_batch(model, batch_np, "cpu", autocast=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    times = _time_train(model, opt, batch, "cpu", steps, autocast=False)
    B, T = batch["input_ids"].shape
    med = statistics.median(times)
    out["train_step_s"] = med
    out["train_step_times_s"] = times
    out["matmul"] = bracket_peak(peak_before, torch_matmul_peak(matmul_n, matmul_reps))
    out["train_tokens_per_s"] = B * T / med
    out["n_params"] = sum(p.numel() for p in model.parameters())

    model.eval()
    gen = _generate_timer(model, prompts, "cpu")
    out["ttft_s"] = statistics.median(gen(1) for _ in range(3))
    out["generate_s"] = statistics.median([gen(new_tokens) for _ in range(2)])
    out["generate_tokens_per_s"] = len(prompts) * new_tokens / out["generate_s"]
    out["decode"] = "sampling T=1, no top-k/top-p, use_cache=True"
    return out


def run_reference_accelerator(cfg, batches: list[dict], prompts: np.ndarray, new_tokens: int,
                              steps: int, matmul_n: int, matmul_reps: int, threads: int) -> dict:
    """The GPU reference: f32 weights under bf16 autocast, sdpa, gradient checkpointing,
    fused AdamW; the train step at each batch's shape, then ``generate`` with bf16 weights."""
    import torch
    import transformers
    torch.set_num_threads(threads)
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"  # CPU: the --quick smoke test of this same code
    peak = lambda: torch_matmul_peak(matmul_n, matmul_reps, dev, torch.bfloat16)  # noqa: E731
    before = peak()
    model = make_model(cfg).to(dev)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1, fused=gpu)
    out = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
           "attn_implementation": "sdpa", "precision": "autocast bf16 over f32 weights",
           "device": torch.cuda.get_device_name() if gpu else "cpu", "shapes": []}
    for host in batches:
        batch = _torch_batch(model, host, dev, autocast=True)
        times = _time_train(model, opt, batch, dev, steps, autocast=True)
        B, T = batch["input_ids"].shape
        med = statistics.median(times)
        out["shapes"].append({"batch": B, "seq_len": T, "step_s": med, "step_times_s": times,
                              "tokens_per_s": B * T / med,
                              "max_memory_bytes": torch.cuda.max_memory_allocated() if gpu else 0})
        del batch
    out["matmul"] = bracket_peak(before, peak())
    del opt
    model = model.to(torch.bfloat16).eval()
    model.config.use_cache = True
    out["generate_s"] = _generate_timer(model, prompts, dev)(new_tokens)
    out["generate_tokens_per_s"] = len(prompts) * new_tokens / out["generate_s"]
    return out
