"""Group-relative advantages (GRPO, RLOO) and the zero-advantage group filter.

Rewards arrive as [P, G]: P prompts, G sampled responses each. Every function works on numpy
arrays (host side, returns numpy) and on JAX arrays, also under jit (returns jax arrays).
Flattening [P, G] row-major gives response index p * G + g.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _xp_rewards(rewards, name: str):
    xp = jnp if isinstance(rewards, jax.Array) else np
    r = xp.asarray(rewards)
    if r.ndim != 2:
        raise ValueError(f"advantages.{name}: rewards must be [P, G] (prompts x group), got shape {r.shape}")
    if not xp.issubdtype(r.dtype, xp.floating):
        r = r.astype(xp.float32)
    return xp, r


def grpo_advantages(rewards, eps: float = 1e-6, use_std: bool = True):
    """GRPO: (R - group mean) / (unbiased group std + eps); use_std=False drops the division
    (Dr.GRPO). rewards [P, G] with G >= 2 -> advantages [P, G]."""
    xp, r = _xp_rewards(rewards, "grpo_advantages")
    if r.shape[1] < 2:
        raise ValueError(f"advantages.grpo_advantages: need G >= 2 responses per prompt for a "
                         f"group baseline / unbiased std, got rewards shape {r.shape}")
    centred = r - xp.mean(r, axis=1, keepdims=True)
    if not use_std:
        return centred
    return centred / (xp.std(r, axis=1, ddof=1, keepdims=True) + eps)


def rloo_advantages(rewards):
    """RLOO: R_i minus the mean of the other G-1 rewards of its group = G/(G-1) (R_i - mean).
    rewards [P, G] with G >= 2 -> advantages [P, G]."""
    xp, r = _xp_rewards(rewards, "rloo_advantages")
    g = r.shape[1]
    if g < 2:
        raise ValueError(f"advantages.rloo_advantages: need G >= 2, got rewards shape {r.shape}")
    loo_mean = (xp.sum(r, axis=1, keepdims=True) - r) / (g - 1)
    return r - loo_mean


def group_filter_mask(rewards, atol: float = 0.0):
    """bool [P]: True for groups whose rewards are not all equal (within atol), i.e. groups
    that carry a learning signal; all-right / all-wrong groups are False."""
    xp, r = _xp_rewards(rewards, "group_filter_mask")
    return (xp.max(r, axis=1) - xp.min(r, axis=1)) > atol


def max_reward_mask(rewards, max_reward: float):
    """bool [P, G]: responses whose reward reached ``max_reward`` (the positive-sample SFT set)."""
    xp, r = _xp_rewards(rewards, "max_reward_mask")
    return r >= max_reward
