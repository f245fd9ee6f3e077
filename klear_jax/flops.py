"""Analytical model FLOPs (the one place they are counted: AOT reports and benchmarks) and
accelerator chip specs.

XLA's ``cost_analysis`` counts the body of a scan / while loop once, so for a layer-scanned
model its FLOPs are low by about the layer count; these formulas count everything.

Per token, forward, 2 FLOPs per multiply-add:
    dense  = 2 * (L * (D*H*hd + 2*D*K*hd + H*hd*D + 3*D*F) + D*V)      (the "6N" N, x2)
    attn   = L * 4 * H * hd * c            (q.k and p.v against c context tokens)
Model FLOPs (the MFU numerator) count causal attention at its average context T / 2: a
packed or RL row of length T is taken as ONE sequence (an upper bound for packed rows). Training =
3 x forward; hardware FLOPs add one more forward when the layers are rematerialised.
The sampler's XLA attention runs over the whole cache (S slots, masked), so its hardware
attention FLOPs use c = S.
"""

from __future__ import annotations

import jax.numpy as jnp

# bf16 dense peak per chip, HBM per chip, HBM bandwidth per chip (Cloud TPU public specs).
CHIPS = {
    "v5p": {"peak_flops": 459e12, "hbm_gib": 95.0, "hbm_bw": 2765e9},
    "v6e": {"peak_flops": 918e12, "hbm_gib": 32.0, "hbm_bw": 1640e9},
}


def dense_flops_per_token(m, with_head: bool = True) -> float:
    D, H, K, hd, F, L, V = (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
                            m.intermediate_size, m.num_layers, m.vocab_size)
    per_layer = D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F
    return 2.0 * (L * per_layer + (D * V if with_head else 0))


def attn_flops_per_token(m, context: float) -> float:
    return 4.0 * m.num_layers * m.num_heads * m.head_dim * context


def train_flops_per_token(m, seq: int) -> float:
    """Model FLOPs per trained token of a row of length ``seq``: 3 x (dense + attention)."""
    return 3.0 * (dense_flops_per_token(m) + attn_flops_per_token(m, seq / 2))


def param_count(m) -> int:
    D, H, K, hd, F, L, V = (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
                            m.intermediate_size, m.num_layers, m.vocab_size)
    layer = D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F + 2 * D + (2 * hd if m.qk_norm else 0)
    return L * layer + D * V * (1 if m.tie_word_embeddings else 2) + D


def analytical_flops(m, kind: str, rows: int, seq: int, cache: int = 0) -> dict:
    """kind "train": rows x seq tokens, fwd + bwd (+ remat forward in hardware FLOPs);
    "prefill": rows x seq prompt tokens into a ``cache``-slot cache, head on the last token;
    "decode": rows x seq generated tokens, each against the cache (context ~ cache - seq/2)."""
    tokens = rows * seq
    out = {"kind": kind, "tokens": tokens, "params": param_count(m)}
    if kind == "train":
        out["model_flops"] = tokens * train_flops_per_token(m, seq)
        out["hw_flops"] = out["model_flops"] * (4 / 3 if m.remat_policy != "none" else 1.0)
    elif kind == "prefill":
        dense = tokens * dense_flops_per_token(m, with_head=False) + rows * 2.0 * m.hidden_size * m.vocab_size
        out["model_flops"] = dense + tokens * attn_flops_per_token(m, (seq + 1) / 2)
        out["hw_flops"] = dense + tokens * attn_flops_per_token(m, cache)
    elif kind == "decode":
        dense = tokens * dense_flops_per_token(m)
        out["model_flops"] = dense + tokens * attn_flops_per_token(m, cache - seq / 2)
        out["hw_flops"] = dense + tokens * attn_flops_per_token(m, cache)
        # Per step each chip reads every (all-gathered) weight and its share of the cache.
        kv_bytes = 2 * m.num_layers * rows * cache * m.num_kv_heads * m.head_dim * jnp.dtype(m.dtype).itemsize
        out["steps"] = seq
        out["bytes_per_step_weights"] = param_count(m) * jnp.dtype(m.param_dtype).itemsize
        out["bytes_per_step_kv_total"] = kv_bytes
    else:
        raise ValueError(f"analytical_flops: unknown kind {kind!r}")
    return out


def roofline(flops: dict, chip: str, n_chips: int) -> dict:
    """Time at the chips' peak FLOP/s (and, for decode, at HBM bandwidth) and implied MFU =
    model FLOPs / (chips * peak * estimated time): an upper bound, not a measurement."""
    spec = CHIPS[chip]
    t_flops = flops["hw_flops"] / (n_chips * spec["peak_flops"])
    t_mem = 0.0
    if flops["kind"] == "decode":
        per_chip = flops["bytes_per_step_weights"] + flops["bytes_per_step_kv_total"] / n_chips
        t_mem = flops["steps"] * per_chip / spec["hbm_bw"]
    t = max(t_flops, t_mem)
    return {"time_at_peak_s": t_flops, "time_at_hbm_bw_s": t_mem, "est_time_s": t,
            "implied_mfu": flops["model_flops"] / (n_chips * spec["peak_flops"] * t) if t else 0.0}
