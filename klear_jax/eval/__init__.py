"""Evaluation: avg@k / pass@k of a checkpoint on math and code benchmarks.

    python -m klear_jax.eval --config=configs/eval_tiny.py --config.checkpoint=DIR \\
        --config.benchmarks.math.path=held_out_math.jsonl [--config.out_dir=OUT]

Schema: ``klear_jax.eval.config``; the Python API (``evaluate``, ``Benchmark``,
``Setting``) and the results layout: ``klear_jax.eval.run``; metrics:
``klear_jax.eval.metrics``.
"""

from klear_jax.eval.run import Benchmark, Setting, evaluate, load_problems, run

__all__ = ["Benchmark", "Setting", "evaluate", "load_problems", "run"]
