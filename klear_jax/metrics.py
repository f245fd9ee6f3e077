"""Metric sinks for training loops: TensorBoard (tensorboardX), a JSONL file, a progress bar.

Only process 0 writes (``jax.process_index() == 0``); other hosts get a no-op writer.
``metrics.jsonl`` holds one JSON object per logged step: {"step": int, <name>: float, ...}.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np
from tensorboardX import SummaryWriter


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Device scalars -> Python floats (one host sync for the whole dict)."""
    host = jax.device_get(dict(metrics))
    return {k: float(np.asarray(v)) for k, v in host.items()}


class MetricWriter:
    """Writes scalars to ``workdir/metrics.jsonl`` and TensorBoard under ``workdir/tb``.

    On resume from step ``start_step`` rows of later steps (written after that checkpoint by
    the interrupted run) are dropped, so the file reads as one uninterrupted run.
    """

    def __init__(self, workdir: str, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        _truncate_jsonl(self.path, start_step)
        self._file = open(self.path, "a")
        self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)}
        row.update({k: float(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row, allow_nan=True) + "\n")
        self._file.flush()
        for k, v in metrics.items():
            self._tb.add_scalar(k, float(v), int(step))

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


class WandbWriter:
    """The same scalars to a Weights & Biases run (config keys ``metrics.wandb*``, see
    ``klear_jax.config``). ``wandb`` is imported here only, so it stays an optional extra.

    Only process 0 logs. The run id is kept in ``workdir/wandb_run_id``, so a run resumed
    in the same workdir continues the same W&B run (W&B ignores rows for steps it already
    has). ``mode`` "offline" writes under ``workdir/wandb`` for a later ``wandb sync``.
    """

    def __init__(self, workdir: str, project: str, name: str = "", entity: str = "",
                 mode: str = "", config: Mapping[str, Any] | None = None,
                 enabled: bool | None = None):
        if enabled is None:
            enabled = jax.process_index() == 0
        self.run = None
        if not enabled:
            return
        import wandb

        os.makedirs(workdir, exist_ok=True)
        id_path = os.path.join(workdir, "wandb_run_id")
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(4)
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        self.run = wandb.init(
            project=project, entity=entity or None, mode=mode or None, dir=workdir,
            name=name or os.path.basename(os.path.normpath(workdir)), id=run_id,
            resume="allow", config=dict(config or {}), settings=wandb.Settings(quiet=True))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.run is not None:
            self.run.log({k: float(v) for k, v in metrics.items()}, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _truncate_jsonl(path: str, start_step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip()]
    keep = [r for r in rows if json.loads(r).get("step", 0) <= start_step]
    with open(path, "w") as f:
        f.writelines(keep)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """One status line: step/total, loss, tokens/s, ETA. Rewrites in place on a TTY;
    otherwise (logs) prints the first and last update and at most one line every
    ``log_interval_s`` seconds between them (on stderr, process 0 only)."""

    log_interval_s = 10.0

    def __init__(self, total_steps: int):
        self.enabled = jax.process_index() == 0
        self.total = total_steps
        self.stream = sys.stderr
        self._t0 = None
        self._tokens = 0.0
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._printed = None

    def update(self, step: int, metrics: Mapping[str, float]) -> str:
        """``step`` = steps completed. The timer starts at the first update, so compilation
        of the first step does not count towards tokens/s."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0, self._first, self._tokens = now, step, 0.0
            rate, eta = float("nan"), float("nan")
        else:
            self._tokens += metrics.get("batch_tokens", metrics.get("tokens", 0.0))
            dt = now - self._t0
            steps = step - self._first
            rate = self._tokens / dt if dt > 0 else float("nan")
            eta = dt / steps * (self.total - step) if steps > 0 else float("nan")
        tps = f"{rate:,.0f}" if math.isfinite(rate) else "--"
        line = (f"step {step}/{self.total} loss {metrics.get('loss', float('nan')):.4f} "
                f"tok/s {tps} ETA {_fmt_time(eta)}")
        if metrics.get("skipped"):
            line += " [update skipped: non-finite]"
        if self.enabled and self._tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif self.enabled and (self._printed is None or step >= self.total
                               or now - self._printed >= self.log_interval_s):
            self._printed = now
            self.stream.write(line + "\n")
            self.stream.flush()
        return line

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "--:--"
    s = int(s)
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60:02d}:{rem % 60:02d}"
