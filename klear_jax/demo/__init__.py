"""The embedded default: the paper's pipeline (SFT -> GPPO -> eval) in miniature on a CPU.

    python -m klear_jax.demo --workdir DIR [--seed N] [--size default|tiny]
    python -m klear_jax.demo --ablation --workdir DIR [--seeds 3]

Stages and outputs: ``klear_jax.demo.run``; configs: ``klear_jax.demo.config``.
"""

from klear_jax.demo.run import main, run_ablation, run_demo

__all__ = ["main", "run_ablation", "run_demo"]
