"""Supervised fine-tuning (long chain-of-thought SFT).

    python -m klear_jax.sft --config=configs/sft_tiny.py --config.workdir=DIR \\
        --config.data.dir=TFDS_DIR --config.data.name=NAME \\
        --config.train.total_steps=N --config.checkpoint.every_steps=M

Any config key is overridable with ``--config.<key>=value`` (schema:
``klear_jax.sft.config``); unknown keys and bad values fail before anything heavy starts. A
run restarted with the same workdir resumes from its latest checkpoint. SIGTERM saves at
the next step boundary and exits 0. Writes DIR/metrics.jsonl, TensorBoard logs in DIR/tb
and checkpoints in DIR/checkpoints.
"""

from klear_jax.sft.train import run

__all__ = ["run"]
