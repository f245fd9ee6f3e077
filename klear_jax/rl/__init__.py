"""GPPO reinforcement learning on verifiable math and code rewards.

    python -m klear_jax.rl --config=configs/gppo_tiny.py --config.workdir=DIR \\
        --config.data.dir=TFDS_DIR --config.data.name=NAME --config.data.tokenizer=TOK

One step samples G responses to each of P prompts on the training mesh, scores them, builds
group-relative advantages and runs K mini-batch updates (``klear_jax.rl.loop``). Schema:
``klear_jax.rl.config``; the update's wiring: ``klear_jax.rl.step``. A run restarted with
the same workdir resumes; SIGTERM saves at the next step boundary and exits 0. Writes
DIR/metrics.jsonl (one row per RL step), TensorBoard logs in DIR/tb and checkpoints in
DIR/checkpoints.
"""

__all__ = ["run"]


def __getattr__(name):
    # The loop pulls in the data pipeline (TFDS, grain) and the trainer; the update's wiring
    # (rl.step, rl.loss, rl.config) is used without them (AOT, the benchmarks), so the loop
    # is imported on first use of ``klear_jax.rl.run``.
    if name == "run":
        from klear_jax.rl.loop import run
        return run
    raise AttributeError(name)
