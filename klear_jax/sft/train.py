"""The SFT loop: packed batches from TFDS through the jitted train step.

A run restarted with the same workdir resumes from its latest checkpoint (train state,
optimizer, data-iterator position); the architecture then comes from the checkpoint and the
init weights are not read again. See ``klear_jax.sft`` for the command line.
"""

from __future__ import annotations

import jax
import numpy as np
import tensorflow_datasets as tfds

from klear_jax import metrics as metrics_lib
from klear_jax import optim
from klear_jax import sharding as shd
from klear_jax import train_step as ts
from klear_jax.data.pipeline import local_rows, sft_batches
from klear_jax.sft.config import validate_sft_config
from klear_jax.sft.step import build_sft_step
from klear_jax.trainer import Trainer


def build_data(cfg, state: dict | None = None, rows=None):
    """This process's ``rows`` of every global packed batch (default: an even split by
    process; see pipeline.local_rows), positioned at ``state`` when resuming. The global
    batches do not depend on the process count, so neither does ``state``."""
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
    validate_sft_config(cfg, jax.device_count())
    mesh = shd.mesh_from_config(cfg.mesh)
    total = cfg.train.total_steps
    optimizer, schedule = optim.make_optimizer(cfg.optim, total)
    with Trainer(cfg, total) as t:
        model_cfg, graphdef, state, shardings, data_state = t.initial_state(optimizer, mesh)
        bsh = ts.batch_sharding(mesh)
        data = build_data(cfg, data_state, rows=local_rows(bsh, cfg.train.batch_size))
        global_shape = (cfg.train.batch_size, cfg.train.seq_len)
        step_fn = build_sft_step(cfg, graphdef, optimizer, schedule, mesh, shardings)

        def save():
            t.checkpointer.save(state, data_iter=data.get_state(), config=cfg,
                                model_config=model_cfg)

        step = int(state.step)
        t.start(step)
        m = {}
        while step < total:
            try:
                local = next(data)
            except StopIteration:
                t.data_exhausted(step)
                break
            batch = {k: jax.make_array_from_process_local_data(bsh, np.asarray(v), global_shape)
                     for k, v in local.items()}
            state, m = step_fn(state, batch)
            step += 1
            m = metrics_lib.to_floats(m)
            t.check_skipped(step, m["skipped"])
            if t.end_of_step(step, m, save):
                break
        t.finish(step, save)
    return {"step": step, "stopped": t.stopped, "last_metrics": m}
