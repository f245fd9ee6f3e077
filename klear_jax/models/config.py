"""Model configuration for the Qwen2 / Qwen3 decoder, and its HF ``config.json`` mapping.

``ModelConfig`` is a frozen (hashable) dataclass so it can be a static argument of jit.
``rope_frequencies`` derives the RoPE inverse frequencies and attention scaling exactly as
transformers' ``modeling_rope_utils`` does (default and YaRN).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import jax
import numpy as np

from klear_jax.backend import ATTENTION_IMPLS

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = {
    "none": None,
    "full": "nothing_saveable",
    "dots": "checkpoint_dots",
    "dots_no_batch": "dots_with_no_batch_dims_saveable",
    "save_everything": "everything_saveable",
}

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "attention_factor", "mscale", "mscale_all_dim", "truncate")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters. ``dtype`` is the compute dtype, ``param_dtype`` the storage one.

    ``rope_scaling`` is None (plain RoPE) or a YaRN dict with keys from ``_YARN_KEYS``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    qkv_bias: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat_policy: str = "none"
    scan_layers: bool = True  # False unrolls the layer loop (compile time grows with depth)
    attention_impl: str = "auto"  # klear_jax.backend: splash on TPU, fused on GPU, XLA on CPU
    logprob_chunk_size: int = 512
    logprob_remat: bool = True  # recompute each logprob chunk's logits in the backward pass
    model_type: str = "qwen3"

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"ModelConfig.{name}: {getattr(self, name)!r} is not one of {DTYPES}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat_policy: {self.remat_policy!r} is not one of "
                             f"{tuple(REMAT_POLICIES)}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl: {self.attention_impl!r} is not one of "
                             f"{ATTENTION_IMPLS}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type: {self.model_type!r} is not one of "
                             f"{SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "logprob_chunk_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}: must be a positive int, got "
                                 f"{getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            unknown = set(self.rope_scaling) - set(_YARN_KEYS)
            if unknown:
                raise ValueError(f"ModelConfig.rope_scaling: unknown YaRN key(s) {sorted(unknown)}")

    def __hash__(self):
        items = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            items.append(tuple(sorted(v.items())) if isinstance(v, Mapping) else v)
        return hash(tuple(items))

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def jnp_dtype(self):
        return jax.numpy.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jax.numpy.dtype(self.param_dtype)

    # ---------------------------------------------------------------- HF config.json mapping
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any] | str | os.PathLike, **overrides) -> "ModelConfig":
        """Builds a config from a HF ``config.json`` dict, file path, or model directory.

        Accepts the older style (``rope_theta`` / ``rope_scaling`` top level) and the newer
        ``rope_parameters`` dict. ``overrides`` set the non-HF fields (dtype, remat_policy...).
        """
        src = "config"
        if not isinstance(cfg, Mapping):
            path = os.fspath(cfg)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
            src = path
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{src}: unsupported model_type {mt!r}; supported: {SUPPORTED_MODEL_TYPES}")

        def need(key):
            if key not in cfg:
                raise ValueError(f"{src}: missing required field {key!r}")
            return cfg[key]

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{src}: hidden_act {act!r} unsupported (only 'silu')")
        if cfg.get("use_sliding_window", False):
            raise ValueError(f"{src}: use_sliding_window=true is not supported")
        if mt == "qwen3" and cfg.get("attention_bias", False):
            raise ValueError(f"{src}: attention_bias=true is not supported for qwen3")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        rope = dict(cfg.get("rope_parameters") or {})
        if not rope and cfg.get("rope_scaling"):
            rope = dict(cfg["rope_scaling"])
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_pos = cfg.get("max_position_embeddings", 32768)
        if rope_type == "default":
            scaling = None
        elif rope_type == "yarn":
            scaling = {k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None}
            if "original_max_position_embeddings" not in scaling:
                scaling["original_max_position_embeddings"] = cfg.get(
                    "original_max_position_embeddings", max_pos)
        else:
            raise ValueError(f"{src}: rope_type {rope_type!r} unsupported (default, yarn)")
        kw = dict(
            vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=scaling, max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=(mt == "qwen3"), qkv_bias=(mt == "qwen2"), model_type=mt)
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict (newer ``rope_parameters`` style) transformers loads."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "yarn", "rope_theta": self.rope_theta, **dict(self.rope_scaling)}
        arch = "Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen2ForCausalLM"
        out = {
            "architectures": [arch], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings, "use_sliding_window": False,
            "attention_dropout": 0.0, "dtype": self.param_dtype,
        }
        if self.model_type == "qwen3":
            out["attention_bias"] = False
        return out


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [hd/2], attention_scaling) as transformers computes them."""
    dim, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if cfg.rope_scaling is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    rs = dict(cfg.rope_scaling)
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor")
    if factor is None:
        factor = cfg.max_position_embeddings / orig

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attn = rs.get("attention_factor")
    if attn is None:
        ms, msd = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = (float(get_mscale(factor, ms) / get_mscale(factor, msd)) if ms and msd
                else get_mscale(factor))
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrap = (1 - ramp).astype(np.float32)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv_freq.astype(np.float32), float(attn)


def remat_policy(name: str):
    """Maps ``ModelConfig.remat_policy`` to a jax.checkpoint policy (None for 'none')."""
    attr = REMAT_POLICIES[name]
    return None if attr is None else getattr(jax.checkpoint_policies, attr)
