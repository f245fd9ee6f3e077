"""Orbax checkpoints: the full train state for resuming, and parameters alone for eval/convert.

A checkpoint directory holds one sub-directory per step, each with *named items* that can be
restored on their own:

    params       pure-dict parameter tree (StandardSave; restorable onto any mesh)
    opt_state    optax state (StandardSave)
    step         JSON {"step": int, "skipped": int}
    data_iter    JSON state of the data iterator (its get_state())
    rng          {"key": uint32 key data} (StandardSave)
    config       JSON of the run's ml_collections config
    model_config JSON: the HF-style config.json dict, plus "klear_jax_config" with every
                 ModelConfig field (dtype, remat policy, ...)

Saves are asynchronous (a background thread writes while training continues) and atomic:
Orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous step as the latest restorable one. Paths may be local or
gs:// (etils.epath).

Integrity (``klear_jax.integrity``). Once Orbax has committed a step, each process hashes
the files it wrote into ``STEP/integrity.<i>.json``. Resuming picks the newest good step:
newer corrupt ones are named (step and file) in a warning and moved aside to
``STEP.corrupt`` (nothing is deleted), and the run continues from the step before. keep-K
counts only sealed steps, so the step a run resumed from is deleted only after ``keep``
newer saves were hashed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import threading
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from klear_jax.integrity import (MANIFEST_PREFIX, CorruptCheckpointError, any_process,
                                 newest_good_step, raise_if_corrupt, seal, sealed, steps, verify)
from klear_jax.models import ModelConfig, Qwen, param_shardings

CHECKPOINT_SUBDIR = "checkpoints"
log = logging.getLogger(__name__)


def _manager(ckpt_dir, async_save: bool = False, read_only: bool = False) -> ocp.CheckpointManager:
    """Orbax keeps every step: retention is TrainCheckpointer._retain's (Orbax's would count
    steps not yet sealed)."""
    opts = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save, create=not read_only,
        cleanup_tmp_directories=not read_only, read_only=read_only)
    return ocp.CheckpointManager(epath.Path(ckpt_dir), options=opts)


def resolve_dir(path) -> epath.Path:
    """A checkpoint dir, or a workdir containing ``checkpoints/``."""
    p = epath.Path(path)
    return p / CHECKPOINT_SUBDIR if (p / CHECKPOINT_SUBDIR).exists() else p


def model_config_dict(cfg) -> dict:
    d = cfg.to_hf_config()
    d["klear_jax_config"] = json.loads(json.dumps(dataclasses.asdict(cfg)))
    return d


def model_config_from_dict(d: Mapping[str, Any], **overrides):
    if "klear_jax_config" in d:
        kw = dict(d["klear_jax_config"])
        kw.update(overrides)
        return ModelConfig(**kw)
    return ModelConfig.from_hf_config(dict(d), **overrides)


def abstract_model(model_cfg, mesh=None):
    """(graphdef, abstract params pure dict with target shardings when mesh is given)."""
    abstract = nnx.eval_shape(lambda: Qwen(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = state.to_pure_dict()
    if mesh is None:
        sh = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), params)
    else:
        sh = param_shardings(state, mesh).to_pure_dict()
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          params, sh)
    return graphdef, params


# --------------------------------------------------------------------- params alone
def save_params(ckpt_dir, model, step: int = 0) -> None:
    """Writes a params-only checkpoint (items params + model_config) at ``step``."""
    state = nnx.state(model)
    mngr = _manager(ckpt_dir)
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.to_pure_dict()),
        model_config=ocp.args.JsonSave(model_config_dict(model.config))), force=True)
    mngr.wait_until_finished()
    mngr.close()
    seal(epath.Path(ckpt_dir) / str(step))


def restore_params(ckpt_dir, mesh=None, step: int | None = None, **config_overrides):
    """Model with parameters from a checkpoint (params-only or full train state), placed per
    the logical rules on ``mesh`` (or on one device). ``config_overrides`` set ModelConfig
    fields that do not change shapes (dtype, remat_policy, attention_impl, ...).

    The step is verified against its integrity manifest first: CorruptCheckpointError naming
    the step and file when it fails, a warning when it has none (saved by older code)."""
    d = resolve_dir(ckpt_dir)
    mngr = _manager(d, read_only=True)
    step = mngr.latest_step() if step is None or step < 0 else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint found in {d}")
    problem = None
    if not any((d / str(step)).glob(MANIFEST_PREFIX + "*.json")):
        log.warning("checkpoint %s step %d has no integrity manifest: not verified", d, step)
    else:
        problem = verify(d / str(step), items=("params", "model_config"))
    raise_if_corrupt(d, step, problem)
    meta = mngr.restore(step, args=ocp.args.Composite(model_config=ocp.args.JsonRestore()))
    cfg = model_config_from_dict(meta["model_config"], **config_overrides)
    graphdef, abstract = abstract_model(cfg, mesh)
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract)))
    mngr.close()
    return nnx.merge(graphdef, nnx.State(restored["params"]))


# --------------------------------------------------------------------- full train state
class TrainCheckpointer:
    """Saves / restores the TrainState, data-iterator state, RNG and configs of a run.

    ``latest_step()`` is the step to resume from: the newest good one on disk (corrupt newer
    ones are named in a warning and moved aside, see the module docstring), or, once this
    run has saved, its newest save. ``restored_step`` is the step ``restore`` loaded.
    Each save is sealed (hashed, manifest written) on a background thread after Orbax
    commits it; a sealing error is raised by the next ``save``, ``wait`` or ``close``.
    """

    def __init__(self, workdir, keep: int | None = 3, async_save: bool = True):
        self.dir = epath.Path(workdir) / CHECKPOINT_SUBDIR
        self.keep = keep
        self.mngr = _manager(self.dir, async_save=async_save)
        self.restored_step: int | None = None
        self._scanned, self._good, self._saved = False, None, None
        self._sealer: threading.Thread | None = None
        self._seal_error: BaseException | None = None

    def latest_step(self) -> int | None:
        if self._saved is not None:
            return self._saved
        if not self._scanned:
            self._good = self._find_good()
            self._scanned = True
        return self._good

    def _find_good(self) -> int | None:
        """The newest step that verifies; newer ones are logged and moved aside."""
        good, bad = newest_good_step(self.dir)
        if bad and good is None:
            raise CorruptCheckpointError(
                f"no checkpoint in {self.dir} passes verification: "
                + "; ".join(f"step {b}: {p}" for b, p in bad)
                + ". Move these step directories away to start from scratch.")
        for step, problem in bad:
            dst = self.dir / f"{step}.corrupt"
            n = 1
            while dst.exists():
                dst, n = self.dir / f"{step}.corrupt{n}", n + 1
            log.warning("CHECKPOINT STEP %d IS CORRUPT: %s/%d: %s. Moved to %s; resuming from "
                        "step %d instead.", step, self.dir, step, problem, dst.name, good)
            if jax.process_index() == 0:
                (self.dir / str(step)).rename(dst)
        if bad:
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("klear_jax.checkpoint:moved_corrupt")
            self.mngr.reload()
        return good

    def _step_for(self, step: int | None) -> int:
        """``step``, verified (CorruptCheckpointError), or the newest good step."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.dir}")
        if step == self._saved:
            self.wait()  # sealed by this run: its manifest was just computed
        elif step != self._good:
            raise_if_corrupt(self.dir, step, verify(self.dir / str(step)))
        return step

    def model_config(self, step: int | None = None, **overrides):
        """The ModelConfig saved with ``step`` (the newest good step by default)."""
        step = self._step_for(step)
        d = self.mngr.restore(step, args=ocp.args.Composite(model_config=ocp.args.JsonRestore()))
        return model_config_from_dict(d["model_config"], **overrides)

    def save(self, state, *, data_iter: Mapping | None = None, rng=None, config=None,
             model_config=None) -> None:
        """Starts an (async) save of everything at ``int(state.step)``."""
        self._join_sealer()
        step = int(state.step)
        items = dict(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            step=ocp.args.JsonSave({"step": step, "skipped": int(state.skipped)}),
            data_iter=ocp.args.JsonSave(dict(data_iter or {})),
        )
        if rng is not None:
            items["rng"] = ocp.args.StandardSave({"key": jax.random.key_data(rng)})
        if config is not None:
            items["config"] = ocp.args.JsonSave(json.loads(
                config.to_json() if hasattr(config, "to_json") else json.dumps(config)))
        if model_config is not None:
            items["model_config"] = ocp.args.JsonSave(model_config_dict(model_config))
        if not self.mngr.save(step, args=ocp.args.Composite(**items), force=True):
            return
        self._saved = step
        self._sealer = threading.Thread(target=self._seal, args=(step,), daemon=True,
                                        name=f"seal-checkpoint-{step}")
        self._sealer.start()

    def _seal(self, step: int) -> None:
        try:
            self.mngr.wait_until_finished()
            seal(self.dir / str(step))
            if jax.process_index() == 0:
                self._retain()
        except BaseException as e:  # noqa: BLE001  (raised again by _join_sealer)
            log.error("sealing checkpoint step %d in %s failed: %r", step, self.dir, e)
            self._seal_error = e

    def _join_sealer(self) -> None:
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None
        if self._seal_error is not None:
            e, self._seal_error = self._seal_error, None
            raise RuntimeError(f"checkpoint save in {self.dir} failed: {e!r}") from e

    def _retain(self) -> None:
        """Deletes steps older than the ``keep``-th newest sealed step (one whose manifests
        from all processes are written): unsealed or corrupt steps never count, so the step
        a run resumed from outlives ``keep`` newer verified saves."""
        if not self.keep:
            return
        on_disk = steps(self.dir)
        done = [s for s in on_disk if sealed(self.dir / str(s))]
        if len(done) > self.keep:
            for s in on_disk:
                if s < done[-self.keep]:
                    (self.dir / str(s)).rmtree()

    def restore(self, abstract_state, step: int | None = None, with_rng: bool = False):
        """(state, data_iter_state, rng or None) from ``step`` (the newest good step by
        default; sets ``restored_step``). ``abstract_state``: a TrainState of
        ShapeDtypeStructs carrying the target shardings (any mesh)."""
        step = self._step_for(step)
        items = dict(params=ocp.args.StandardRestore(abstract_state.params),
                     opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
                     step=ocp.args.JsonRestore(), data_iter=ocp.args.JsonRestore())
        if with_rng:
            items["rng"] = ocp.args.StandardRestore()
        r = self.mngr.restore(step, args=ocp.args.Composite(**items))
        rep = abstract_state.step.sharding if hasattr(abstract_state.step, "sharding") else None
        put = lambda v: jax.device_put(jnp.asarray(v, jnp.int32), rep)
        state = dataclasses.replace(abstract_state, step=put(r["step"]["step"]),
                                    skipped=put(r["step"]["skipped"]), params=r["params"],
                                    opt_state=r["opt_state"])
        rng = jax.random.wrap_key_data(np.asarray(r["rng"]["key"])) if with_rng else None
        self.restored_step = step
        return state, dict(r["data_iter"]), rng

    def wait(self) -> None:
        """Blocks until the last save is committed and sealed (raises if it failed)."""
        self._join_sealer()
        self.mngr.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.mngr.close()


class PreemptionFlag:
    """SIGTERM (TPU VM preemption) sets a flag; the loop checks it at each step boundary,
    saves and exits 0."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self._event = threading.Event()
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self._event.set()

    def should_stop(self) -> bool:
        """True on every host once any host got the signal (a collective when multi-host,
        so all hosts stop at the same step boundary)."""
        return any_process(self._event.is_set())

    def restore_handlers(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
