"""Optimizer and learning-rate schedules (optax), built from the ``optim`` config block.

Choices:
- AdamW with decoupled weight decay applied only to weight *matrices*: any parameter whose
  path contains "norm" or whose leaf name is "bias" or "scale" is not decayed (RMSNorm
  scales, biases). Embeddings and the LM head are decayed, like every other kernel. The mask
  goes by path, not by rank, because layers are stacked ([L, D] norm scales are rank 2).
- Global-norm clipping runs first, on the already-normalised gradient.
- Schedules: "cosine" = linear warmup 0 -> lr, then cosine from lr to ``end_lr`` (a floor,
  not zero) over the remaining ``decay_steps - warmup_steps`` steps, then flat at end_lr;
  "constant" = linear warmup 0 -> lr, then flat.
- Master weights: whatever dtype the params are stored in (float32 by default; the model's
  compute dtype is separate). ``mu_dtype`` can store Adam's first moment in bfloat16.
- One fused update (``clipped_adamw``): the same arithmetic and the same state pytree as
  ``optax.chain(optax.clip_by_global_norm(c), optax.adamw(...))`` (checkpoints are
  interchangeable), written so that XLA touches each parameter's gradient, moments and weight
  a minimal number of times: the clip factor folds into the moment updates, the moments are
  materialised once (an optimisation barrier) and the weight update reads them, and the
  train step's skip of a non-finite step is part of the update (``ok``) instead of a select
  over every array afterwards. The optax chain made about 20 array passes per parameter on
  CPU (copies of both moments among them); this makes 11.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "constant")


def make_schedule(lr: float, schedule: str = "cosine", warmup_steps: int = 0,
                  decay_steps: int = 0, end_lr: float | None = None) -> optax.Schedule:
    """step -> learning rate. ``decay_steps`` counts from step 0 and includes the warmup."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule: unknown schedule {schedule!r}; allowed {SCHEDULES}")
    warmup_steps = int(warmup_steps)
    if schedule == "constant":
        if warmup_steps == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)],
            [warmup_steps])
    end_lr = lr if end_lr is None else end_lr
    cosine_steps = max(int(decay_steps) - warmup_steps, 1)
    # alpha = floor / peak: cosine_decay_schedule decays to init_value * alpha.
    cosine = optax.cosine_decay_schedule(lr, cosine_steps, alpha=end_lr / lr if lr else 0.0)
    if warmup_steps == 0:
        return cosine
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), cosine],
                                [warmup_steps])


def decay_mask(params: Any) -> Any:
    """Pytree of bools: True where weight decay applies (see module docstring)."""
    def keep(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        if any("norm" in n.lower() for n in names):
            return False
        return names[-1] not in ("bias", "scale") if names else True
    return jax.tree_util.tree_map_with_path(keep, params)


class SkippingTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation whose ``update(grads, state, params, *, ok=True)`` takes the
    train step's verdict ``ok`` (bool []): when False it returns zero updates and the state
    unchanged, so the caller needs no select over params and state afterwards."""


def _find_state(state: Any, kind: type) -> Any:
    found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
             if isinstance(x, kind)]
    if len(found) != 1:
        raise ValueError(f"optimizer state: expected one {kind.__name__}, found {len(found)}")
    return found[0]


def _replace_state(state: Any, kind: type, new: Any) -> Any:
    return jax.tree.map(lambda x: new if isinstance(x, kind) else x, state,
                        is_leaf=lambda x: isinstance(x, kind))


def clipped_adamw(schedule: optax.Schedule, b1: float, b2: float, eps: float,
                  weight_decay: float, mask: Callable[[Any], Any], clip_norm: float = 0.0,
                  mu_dtype: Any = None) -> SkippingTransformation:
    """``optax.chain(clip_by_global_norm(clip_norm), adamw(schedule, ...))`` (no clip when
    ``clip_norm`` <= 0) as one update: same state pytree (its ``init`` is the chain's), same
    arithmetic up to float rounding (the clip is a multiply by min(1, clip / norm); with
    ``mu_dtype`` the update reads the stored, rounded first moment)."""
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm > 0 else []
    reference = optax.chain(*parts, optax.adamw(schedule, b1=b1, b2=b2, eps=eps,
                                                weight_decay=weight_decay, mask=mask,
                                                mu_dtype=mu_dtype))

    def update(grads, state, params=None, *, ok=True, **_):
        if params is None:
            raise ValueError("clipped_adamw.update needs params (weight decay)")
        ok = jnp.asarray(ok, bool)
        adam = _find_state(state, optax.ScaleByAdamState)
        sched = _find_state(state, optax.ScaleByScheduleState)
        factor = jnp.float32(1.0)
        if clip_norm > 0:
            norm = optax.global_norm(grads)
            factor = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
        count = optax.safe_increment(adam.count)
        corr1, corr2 = 1 - b1 ** count, 1 - b2 ** count
        lr = schedule(sched.count)

        clipped = lambda g: g.astype(jnp.float32) * factor
        mu = jax.tree.map(lambda g, m: jnp.where(ok, (1 - b1) * clipped(g) + b1 * m, m)
                          .astype(m.dtype), grads, adam.mu)
        nu = jax.tree.map(lambda g, v: jnp.where(ok, (1 - b2) * clipped(g) ** 2 + b2 * v, v)
                          .astype(v.dtype), grads, adam.nu)
        # The weight update reads the stored moments; left to itself XLA recomputes them from
        # the old ones inside the weight update, and must copy both (donated) moment buffers.
        mu, nu = jax.lax.optimization_barrier((mu, nu))

        def weight_update(m, v, p, decayed):
            u = (m / corr1) / (jnp.sqrt(v / corr2) + eps)
            if decayed:
                u = u + weight_decay * p
            return jnp.where(ok, -lr * u, 0.0).astype(p.dtype)
        updates = jax.tree.map(weight_update, mu, nu, params, mask(params))
        keep_or_step = lambda old, new: jnp.where(ok, new, old)
        new_adam = adam._replace(count=keep_or_step(adam.count, count), mu=mu, nu=nu)
        new_sched = sched._replace(
            count=keep_or_step(sched.count, optax.safe_increment(sched.count)))
        state = _replace_state(state, optax.ScaleByAdamState, new_adam)
        return updates, _replace_state(state, optax.ScaleByScheduleState, new_sched)

    return SkippingTransformation(reference.init, update)


def make_optimizer(optim_cfg: Mapping[str, Any], total_steps: int
                   ) -> tuple[SkippingTransformation, optax.Schedule]:
    """(optimizer, schedule) from the ``optim`` config block (schema in config_utils)."""
    c = dict(optim_cfg)
    decay_steps = c.get("decay_steps") or total_steps
    schedule = make_schedule(c["lr"], c["schedule"], c["warmup_steps"], decay_steps,
                             c.get("end_lr"))
    mu_dtype = {"": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[c.get("mu_dtype", "")]
    return clipped_adamw(schedule, c["b1"], c["b2"], c["eps"], c["weight_decay"], decay_mask,
                         c.get("clip_norm", 0) or 0.0, mu_dtype), schedule


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_opt_state: Any,
                        param_shardings: Any, replicated: Any) -> Any:
    """Shardings for an optimizer state: param-shaped parts (Adam moments) follow the params'
    shardings; everything else (step counts, masked placeholders) gets ``replicated``."""
    return optax.tree_map_params(
        optimizer, lambda _, s: s, abstract_opt_state, param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode))

