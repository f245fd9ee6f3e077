"""Qwen2 / Qwen3 decoder, its config, and HF weights in and out."""

from klear_jax.models.config import ModelConfig
from klear_jax.models.qwen import (CACHE_LOGICAL_AXES, Qwen, cache_shardings, create_model,
                                   init_cache, init_slot_cache, param_logical_axes,
                                   param_shardings)

__all__ = ["ModelConfig", "Qwen", "create_model", "init_cache", "init_slot_cache", "param_shardings",
           "param_logical_axes", "cache_shardings", "CACHE_LOGICAL_AXES", "from_hf", "to_hf"]


def __getattr__(name):  # hf.py pulls in safetensors; import it on first use
    if name in ("from_hf", "to_hf"):
        from klear_jax.models import hf
        return getattr(hf, name)
    raise AttributeError(name)
