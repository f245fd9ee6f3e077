"""Verifiable rewards for RL: math (math-verify in a deadline pool) and code (bubblewrap sandbox).

    from klear_jax.rewards import math_reward, code_reward
    math_reward(response, answer) -> float          # +1 / -1 / format penalty
    code_reward(response, tests) -> float           # soft pass rate by default

The RL loop scores a whole step at once, concurrently:
    math_reward_batch(responses, answers, cfg=None) -> list[float]
    code_reward_batch(responses, tests_list, cfg=None) -> list[float]
or holds a MathScorer / CodeScorer (CodeScorer.submit_batch returns a Future, so sampling
can continue while programs run; score_batch_detailed gives each sample's failure reasons).
Config dataclasses: MathRewardConfig, CodeRewardConfig, SandboxConfig (all sandbox limits,
with the paper's 35 s / 16 tests). `python -m klear_jax.rewards.selfcheck` runs hostile
programs against the sandbox on this host and prints what holds.
"""
from klear_jax.rewards.code import (CodeRewardConfig, CodeScore, CodeScorer, code_reward,
                                    code_reward_batch, extract_code)
from klear_jax.rewards.math import (MathRewardConfig, MathScorer, math_reward,
                                    math_reward_batch)
from klear_jax.rewards.sandbox import RunResult, Sandbox, SandboxConfig, SandboxUnavailable

__all__ = [
    "math_reward", "math_reward_batch", "MathRewardConfig", "MathScorer",
    "code_reward", "code_reward_batch", "CodeRewardConfig", "CodeScorer", "CodeScore",
    "extract_code",
    "Sandbox", "SandboxConfig", "SandboxUnavailable", "RunResult",
]
