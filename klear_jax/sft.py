"""Supervised fine-tuning entry point.

    python -m klear_jax.sft --config=configs/sft_tiny.py --config.workdir=DIR \
        --config.data.dir=TFDS_DIR --config.data.name=NAME \
        --config.train.total_steps=N --config.checkpoint.every_steps=M

Any config key is overridable with ``--config.<key>=value``; unknown keys and bad values fail
before anything heavy starts. A run restarted with the same workdir resumes from its latest
checkpoint (train state, optimizer, data-iterator position). SIGTERM saves at the next step
boundary and exits 0. Writes DIR/metrics.jsonl, TensorBoard logs in DIR/tb and checkpoints
in DIR/checkpoints.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from klear_jax import checkpoint as ckpt
from klear_jax import config_utils, metrics as metrics_lib, optim, train_step as ts
from klear_jax import sharding as shd

log = logging.getLogger("klear_jax.sft")


def runtime_fields(cfg) -> dict:
    """ModelConfig fields the run's config decides even when shapes come from a checkpoint."""
    return {k: cfg.model[k] for k in ("dtype", "param_dtype", "remat_policy",
                                      "attention_impl", "logprob_chunk_size",
                                      "logprob_remat")}


def build_model(cfg, mesh):
    """(model, ModelConfig) per ``cfg.init`` (scratch / hf / orbax)."""
    from klear_jax.models import ModelConfig, create_model, from_hf
    m = config_utils.model_kwargs(cfg.model)
    src = cfg.init.source
    runtime = runtime_fields(cfg)
    if src == "scratch":
        model = create_model(ModelConfig(**m), seed=cfg.seed, mesh=mesh)
    elif src == "hf":
        model = from_hf(cfg.init.path, mesh=mesh, **runtime)
    else:
        model = ckpt.restore_params(cfg.init.path, mesh=mesh, step=cfg.init.step, **runtime)
    return model, model.config


def build_data(cfg, state: dict | None = None, rows=None):
    """This process's ``rows`` of every global packed batch (default: an even split by
    process; see pipeline.local_rows), positioned at ``state`` when resuming. The global
    batches do not depend on the process count, so neither does ``state``."""
    import tensorflow_datasets as tfds
    from klear_jax.data.pipeline import sft_batches
    d = cfg.data
    src = tfds.data_source(d.name, data_dir=d.dir or None)[d.split]
    it = sft_batches(src, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                     seed=cfg.seed, shuffle=d.shuffle,
                     num_epochs=d.num_epochs if d.num_epochs > 0 else None,
                     overlong=d.overlong, num_packing_bins=d.num_packing_bins or None, rows=rows)
    if state:
        it.set_state(state)
    return it


def run(cfg) -> dict:
    """Trains per ``cfg``; returns {"step", "stopped": "done"|"preempted"|"data_exhausted",
    "last_metrics"}. Raises RuntimeError after too many consecutive skipped steps."""
    shd.initialize_distributed()
    config_utils.validate_sft_config(cfg, jax.device_count())
    mesh = shd.mesh_from_config(cfg.mesh)
    optimizer, schedule = optim.make_optimizer(cfg.optim, cfg.train.total_steps)
    checkpointer = ckpt.TrainCheckpointer(cfg.workdir, keep=cfg.checkpoint.keep,
                                          async_save=cfg.checkpoint.async_save)
    data_state = None
    if checkpointer.latest_step() is None:
        model, model_cfg = build_model(cfg, mesh)
        graphdef, state, shardings = ts.init_train_state(model, optimizer, mesh)
        del model
    else:  # resume: shapes from the checkpoint; init weights (e.g. HF) are not read again
        model_cfg = checkpointer.model_config(**runtime_fields(cfg))
        graphdef, abstract_params = ckpt.abstract_model(model_cfg, mesh)
        abstract_state, shardings = ts.abstract_train_state(abstract_params, optimizer, mesh)
        state, data_state, _ = checkpointer.restore(abstract_state)
        log.info("resumed from %s at step %d", checkpointer.dir, int(state.step))
    from klear_jax.data.pipeline import local_rows
    bsh = ts.batch_sharding(mesh)
    data = build_data(cfg, data_state, rows=local_rows(bsh, cfg.train.batch_size))
    global_shape = (cfg.train.batch_size, cfg.train.seq_len)
    step_fn = ts.make_train_step(graphdef, optimizer, ts.make_sft_loss_fn(cfg.train.loss_agg),
                                 mesh, cfg.train.num_microbatches, shardings, schedule=schedule)
    start = int(state.step)
    writer = metrics_lib.MetricWriter(cfg.workdir, start_step=start)
    bar = metrics_lib.ProgressBar(cfg.train.total_steps, start)
    guard = ts.SkipGuard(cfg.train.max_consecutive_skips)
    preempt = ckpt.PreemptionFlag()

    def save(step_state):
        checkpointer.save(step_state, data_iter=data.get_state(), config=cfg,
                          model_config=model_cfg)

    step, stopped, m = start, "done", {}
    try:
        while step < cfg.train.total_steps:
            try:
                local = next(data)
            except StopIteration:
                stopped = "data_exhausted"
                log.warning("data exhausted after %d steps (data.num_epochs = %s)", step,
                            cfg.data.num_epochs)
                break
            batch = {k: jax.make_array_from_process_local_data(bsh, np.asarray(v), global_shape)
                     for k, v in local.items()}
            state, m = step_fn(state, batch)
            step += 1
            m = metrics_lib.to_floats(m)
            if guard.update(step, int(m["skipped"])):
                log.warning("step %d: non-finite loss/gradient, update skipped (%d in a row)",
                            step, guard.consecutive)
            if step % cfg.train.log_every == 0 or step == cfg.train.total_steps:
                writer.write(step, m)
                bar.update(step, m)
            if preempt.should_stop():
                stopped = "preempted"
                break
            if step % cfg.checkpoint.every_steps == 0 and step < cfg.train.total_steps:
                save(state)
        if step > start and checkpointer.latest_step() != step:
            save(state)
    finally:
        checkpointer.close()
        writer.close()
        bar.close()
        preempt.restore_handlers()
    if stopped == "preempted":
        log.warning("SIGTERM: saved a checkpoint at step %d in %s; exiting", step,
                    checkpointer.dir)
    return {"step": step, "stopped": stopped, "last_metrics": m}


if __name__ == "__main__":
    config_utils.run_config_cli(run, report=lambda out, cfg: log.info(
        "finished: %s", {k: out[k] for k in ("step", "stopped")}))
