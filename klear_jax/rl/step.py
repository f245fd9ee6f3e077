"""The one wiring of the RL update: optimizer (with RL-step schedules), loss, train step,
old-log-prob pass, and the mini-batch's shapes. The RL loop, ahead-of-time compilation and
the benchmarks all build their step here, so they cannot drift apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from klear_jax import optim
from klear_jax import train_step as ts
from klear_jax.rl import loss as rl_loss

# One mini-batch row per response: see klear_jax.rl.batch for the layout.
BATCH_KEYS_2D = {"input_ids": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.float32,
                 "segment_ids": jnp.int32, "old_logp": jnp.float32}
BATCH_KEYS_1D = {"advantages": jnp.float32, "positive": jnp.float32}
SCALE_KEYS = {"pg_scale": jnp.float32, "sft_scale": jnp.float32}  # loss.normalize microbatch


def rl_optimizer(cfg):
    """(optimizer, schedule) of an RL config. Schedules count RL steps, as verl steps its
    scheduler once per RL step; the optimizer counts updates, up to K = num_minibatches per
    step, so warm-up and decay lengths are scaled by K here."""
    K = cfg.train.num_minibatches
    o = cfg.optim.to_dict()
    o.update(warmup_steps=o["warmup_steps"] * K, decay_steps=o["decay_steps"] * K)
    return optim.make_optimizer(o, cfg.train.total_steps * K)


def build_rl_step(cfg, graphdef, optimizer, schedule, mesh, shardings):
    """The jitted ``(state, minibatch) -> (state, metrics)`` of ``cfg`` (an RL config)."""
    loss = rl_loss.make_rl_loss(rl_loss.RLLossConfig.from_config(cfg))
    return ts.make_train_step(graphdef, optimizer, loss.loss_fn, mesh,
                              cfg.train.num_microbatches, shardings, schedule=schedule,
                              denom_fn=loss.denom_fn, loss_weights=loss.loss_weights,
                              finalize_metrics=loss.finalize_metrics)


def build_logprob_fn(cfg, graphdef, mesh, shardings):
    """The jitted old-log-prob pass ``(params, minibatch) -> (old_logp, stats)``."""
    return rl_loss.make_logprob_fn(graphdef, mesh, shardings.params, cfg.rollout.temperature,
                                   cfg.train.num_microbatches)


def build_rollout_cast(cfg, model_cfg, shardings):
    """Jitted ``params -> params`` in the rollout dtype (``rollout.weights_dtype``; "auto" =
    the model's compute dtype), sharded like the params; None when the params are stored in
    that dtype already (the sampler reads them as they are)."""
    wd = cfg.rollout.weights_dtype
    dtype = jnp.dtype(model_cfg.dtype if wd == "auto" else wd)
    if dtype == jnp.dtype(model_cfg.param_dtype):
        return None
    cast = lambda p: jax.tree.map(  # noqa: E731
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
    return jax.jit(cast, out_shardings=shardings.params)


def minibatch_rows(cfg) -> int:
    """Global rows of one mini-batch: batch_prompts / num_minibatches groups of G."""
    tr = cfg.train
    return tr.batch_prompts // tr.num_minibatches * cfg.rollout.group_size


def batch_shapes(cfg, seq_len: int | None = None) -> dict:
    """{key: (shape, dtype)} of one global mini-batch at row length ``seq_len`` (default the
    longest bucket, max_prompt_len + max_new_tokens)."""
    R = minibatch_rows(cfg)
    T = seq_len or cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
    out = {k: ((R, T), dt) for k, dt in BATCH_KEYS_2D.items()}
    keys_1d = BATCH_KEYS_1D
    if cfg.loss.normalize == "microbatch":
        keys_1d = dict(keys_1d, **SCALE_KEYS)
    out.update({k: ((R,), dt) for k, dt in keys_1d.items()})
    return out


def verl_rows_per_device(cfg) -> int:
    """Rows one emulated verl device holds per mini-batch (loss.normalize = microbatch)."""
    return minibatch_rows(cfg) // cfg.loss.verl_devices
