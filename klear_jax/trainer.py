"""The side effects every training loop shares: checkpoints, resume, metrics, the progress
bar, the non-finite skip guard, preemption, stop reasons and clean-up.

SFT and RL loops read as their own steps around it::

    with Trainer(cfg, total_steps=N) as t:
        model_cfg, graphdef, state, shardings, extra = t.initial_state(optimizer, mesh)
        t.start(step)
        while step < N:
            ...
            step += 1
            t.check_skipped(step, skipped)
            if t.end_of_step(step, metrics, save):
                break
        t.finish(step, save)
    t.stopped   # "done" | "preempted" | "data_exhausted"

``save`` is a zero-argument callable the loop provides (it knows what to save). Only
process 0 writes metrics and the progress bar; every process takes part in checkpoints and
in the preemption vote (``PreemptionFlag.should_stop`` is a collective).
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from klear_jax import checkpoint as ckpt
from klear_jax import config as cfglib
from klear_jax import metrics as metrics_lib
from klear_jax import policy
from klear_jax import train_step as ts

log = logging.getLogger(__name__)


class SkipGuard:
    """Counts consecutive skipped updates (non-finite loss or gradient, or no loss tokens);
    raises after ``max_consecutive``."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    def update(self, step: int, skipped: int) -> bool:
        """True when this update was skipped; RuntimeError past the limit."""
        if not skipped:
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise RuntimeError(
                f"step {step}: {self.consecutive} consecutive steps had a non-finite loss or "
                f"gradient (or no loss tokens) and were skipped; stopping "
                f"(train.max_consecutive_skips = {self.max_consecutive})")
        return True


class Trainer:
    """See the module docstring. ``cfg`` needs workdir, checkpoint.*, train.log_every and
    train.max_consecutive_skips."""

    def __init__(self, cfg, total_steps: int):
        self.cfg = cfg
        self.total_steps = int(total_steps)
        self.checkpointer = ckpt.TrainCheckpointer(cfg.workdir, keep=cfg.checkpoint.keep,
                                                   async_save=cfg.checkpoint.async_save)
        self.guard = SkipGuard(cfg.train.max_consecutive_skips)
        self.preempt = ckpt.PreemptionFlag()
        self.writer: metrics_lib.MetricWriter | None = None
        self.wandb: metrics_lib.WandbWriter | None = None
        self.bar: metrics_lib.ProgressBar | None = None
        self.stopped = "done"
        self.start_step = 0
        self.abstract_state = None  # the restore target, once resumed

    # ------------------------------------------------------------------ resume
    @property
    def resuming(self) -> bool:
        return self.checkpointer.latest_step() is not None

    def initial_state(self, optimizer, mesh):
        """(model config, graphdef, TrainState on ``mesh``, its shardings, the checkpoint's
        JSON item or None) to start from: the latest checkpoint when resuming (its
        architecture, with ``cfg.model``'s runtime fields), else the model ``cfg.init``
        names (``policy.model_from_init``)."""
        if not self.resuming:
            model = policy.model_from_init(self.cfg, mesh)
            graphdef, state, shardings = ts.init_train_state(model, optimizer, mesh)
            return model.config, graphdef, state, shardings, None
        model_cfg = self.checkpointer.model_config(**cfglib.runtime_model_fields(self.cfg))
        graphdef, abstract_params = ckpt.abstract_model(model_cfg, mesh)
        self.abstract_state, shardings = ts.abstract_train_state(abstract_params, optimizer, mesh)
        state, extra, _ = self.restore(self.abstract_state)
        return model_cfg, graphdef, state, shardings, extra

    def restore(self, abstract_state, with_rng: bool = False):
        """(state, extra JSON dict, rng or None) of the latest checkpoint, onto the shardings
        ``abstract_state`` carries."""
        state, extra, rng = self.checkpointer.restore(abstract_state, with_rng=with_rng)
        log.info("resumed from %s at step %d", self.checkpointer.dir, int(state.step))
        return state, extra, rng

    # ------------------------------------------------------------------ the loop
    def start(self, step: int) -> None:
        """Opens the metric writers (dropping rows an interrupted run wrote after ``step``)
        and the progress bar."""
        self.start_step = step
        self.writer = metrics_lib.MetricWriter(self.cfg.workdir, start_step=step)
        m = self.cfg.get("metrics")
        if m is not None and m.wandb:
            self.wandb = metrics_lib.WandbWriter(
                self.cfg.workdir, m.wandb_project, m.wandb_name, m.wandb_entity, m.wandb_mode,
                config=self.cfg.to_dict())
        self.bar = metrics_lib.ProgressBar(self.total_steps)

    def check_skipped(self, step: int, skipped) -> None:
        if self.guard.update(step, int(skipped)):
            log.warning("step %d: update skipped (non-finite or empty), %d in a row", step,
                        self.guard.consecutive)

    def end_of_step(self, step: int, metrics: Mapping[str, float], save: Callable[[], None],
                    bar_metrics: Mapping[str, float] | None = None) -> bool:
        """Logs ``metrics`` when due and saves on the checkpoint cadence; True when the loop
        must stop (preemption: the final save happens in ``finish``)."""
        if step % self.cfg.train.log_every == 0 or step == self.total_steps:
            self.writer.write(step, metrics)
            if self.wandb is not None:
                self.wandb.write(step, metrics)
            self.bar.update(step, bar_metrics if bar_metrics is not None else metrics)
        if self.preempt.should_stop():
            self.stopped = "preempted"
            return True
        if step % self.cfg.checkpoint.every_steps == 0 and step < self.total_steps:
            save()
        return False

    def data_exhausted(self, step: int, what: str = "data") -> None:
        self.stopped = "data_exhausted"
        log.warning("%s exhausted after %d steps (data.num_epochs = %s)", what, step,
                    self.cfg.data.num_epochs)

    def finish(self, step: int, save: Callable[[], None]) -> None:
        """Saves the last step unless it is saved already."""
        if step > self.start_step and self.checkpointer.latest_step() != step:
            save()
        if self.stopped == "preempted":
            log.warning("SIGTERM: saved a checkpoint at step %d in %s; exiting", step,
                        self.checkpointer.dir)

    # ------------------------------------------------------------------ clean-up
    def close(self) -> None:
        self.checkpointer.close()
        for sink in (self.writer, self.wandb, self.bar):
            if sink is not None:
                sink.close()
        self.preempt.restore_handlers()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
