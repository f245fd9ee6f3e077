"""Data curation the Klear way: sources -> dedup -> decontamination -> labels -> retention.

    python -m klear_jax.curate --config=configs/curate_example.py \\
        [--config.output.dir=DIR --config.sources.<name>.cap=N ...]

Steps and outputs: ``klear_jax.curate.pipeline``; schema: ``klear_jax.curate.config``.
"""

from klear_jax.curate.config import curate_base, source, validate_curate_config
from klear_jax.curate.pipeline import run

__all__ = ["curate_base", "run", "source", "validate_curate_config"]
