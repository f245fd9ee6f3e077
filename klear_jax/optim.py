"""Optimizer and learning-rate schedules (optax), built from the ``optim`` config block.

Choices:
- AdamW with decoupled weight decay. ``weight_decay_mask`` "matrices" (default) decays only
  weight *matrices*: any parameter whose path contains "norm" or whose leaf name is "bias"
  or "scale" is not decayed (RMSNorm scales, biases). Embeddings and the LM head are
  decayed, like every other kernel. The mask goes by path, not by rank, because layers are
  stacked ([L, D] norm scales are rank 2). "all" decays every parameter, as torch's AdamW
  over ``model.parameters()`` does in the authors' code.
- Global-norm clipping runs first, on the already-normalised gradient.
- Schedules: "cosine" = linear warmup 0 -> lr, then cosine from lr to ``end_lr`` (a floor,
  not zero) over the remaining ``decay_steps - warmup_steps`` steps, then flat at end_lr;
  "constant" = linear warmup 0 -> lr, then flat.
- Master weights: whatever dtype the params are stored in (float32 by default; the model's
  compute dtype is separate). ``mu_dtype`` can store Adam's first moment in bfloat16.
- The train step skips a non-finite step itself (params and optimizer state kept), so the
  chain needs no ``apply_if_finite``.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "constant")
DECAY_MASKS = ("matrices", "all")


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


def make_optimizer(optim_cfg: Mapping[str, Any], total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule) from the ``optim`` config block (schema in klear_jax.config):
    ``optax.chain(clip_by_global_norm(clip_norm), adamw(schedule, ...))``, no clip when
    clip_norm is 0."""
    c = dict(optim_cfg)
    decay_steps = c.get("decay_steps") or total_steps
    schedule = make_schedule(c["lr"], c["schedule"], c["warmup_steps"], decay_steps,
                             c.get("end_lr"))
    mu_dtype = {"": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[c.get("mu_dtype", "")]
    clip = c.get("clip_norm", 0) or 0.0
    parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
    which = c.get("weight_decay_mask", "matrices")
    if which not in DECAY_MASKS:
        raise ValueError(f"optim.weight_decay_mask: unknown mask {which!r}; allowed {DECAY_MASKS}")
    adamw = optax.adamw(schedule, b1=c["b1"], b2=c["b2"], eps=c["eps"],
                        weight_decay=c["weight_decay"],
                        mask=decay_mask if which == "matrices" else None, mu_dtype=mu_dtype)
    return optax.chain(*parts, adamw), schedule


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_opt_state: Any,
                        param_shardings: Any, replicated: Any) -> Any:
    """Shardings for an optimizer state: param-shaped parts (Adam moments) follow the params'
    shardings; everything else (step counts, masked placeholders) gets ``replicated``."""
    return optax.tree_map_params(
        optimizer, lambda _, s: s, abstract_opt_state, param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode))

