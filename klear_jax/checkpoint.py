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
"""

from __future__ import annotations

import dataclasses
import json
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

from klear_jax.models import ModelConfig, Qwen, param_shardings

CHECKPOINT_SUBDIR = "checkpoints"


def _manager(ckpt_dir, keep: int | None = None, async_save: bool = False,
             read_only: bool = False) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=not read_only,
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


def restore_params(ckpt_dir, mesh=None, step: int | None = None, **config_overrides):
    """Model with parameters from a checkpoint (params-only or full train state), placed per
    the logical rules on ``mesh`` (or on one device). ``config_overrides`` set ModelConfig
    fields that do not change shapes (dtype, remat_policy, attention_impl, ...)."""
    d = resolve_dir(ckpt_dir)
    mngr = _manager(d, read_only=True)
    step = mngr.latest_step() if step is None or step < 0 else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint found in {d}")
    meta = mngr.restore(step, args=ocp.args.Composite(model_config=ocp.args.JsonRestore()))
    cfg = model_config_from_dict(meta["model_config"], **config_overrides)
    graphdef, abstract = abstract_model(cfg, mesh)
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract)))
    mngr.close()
    return nnx.merge(graphdef, nnx.State(restored["params"]))


# --------------------------------------------------------------------- full train state
class TrainCheckpointer:
    """Saves / restores the TrainState, data-iterator state, RNG and configs of a run."""

    def __init__(self, workdir, keep: int = 3, async_save: bool = True):
        self.dir = epath.Path(workdir) / CHECKPOINT_SUBDIR
        self.mngr = _manager(self.dir, keep=keep, async_save=async_save)

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def model_config(self, step: int | None = None, **overrides):
        """The ModelConfig saved with ``step`` (latest by default)."""
        step = self.latest_step() if step is None else step
        d = self.mngr.restore(step, args=ocp.args.Composite(model_config=ocp.args.JsonRestore()))
        return model_config_from_dict(d["model_config"], **overrides)

    def save(self, state, *, data_iter: Mapping | None = None, rng=None, config=None,
             model_config=None, force: bool = True) -> None:
        """Starts an (async) save of everything at ``int(state.step)``."""
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
        self.mngr.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, abstract_state, step: int | None = None, with_rng: bool = False):
        """(state, data_iter_state, rng or None). ``abstract_state``: a TrainState of
        ShapeDtypeStructs carrying the target shardings (any mesh)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.dir}")
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
        return state, dict(r["data_iter"]), rng

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of ``tree`` (arrays or abstract) with the given shardings."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


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
        flag = self._event.is_set()
        if jax.process_count() > 1:
            flag = bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
        return flag

    def restore_handlers(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
