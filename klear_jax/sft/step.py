"""The SFT train step: NLL of the response tokens, wired into ``train_step.make_train_step``.
One wiring, used by the SFT loop and by ahead-of-time compilation."""

from __future__ import annotations

import jax.numpy as jnp

from klear_jax import losses
from klear_jax import train_step as ts

BATCH_KEYS = {"input_ids": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.float32,
              "segment_ids": jnp.int32, "positions": jnp.int32}


def sft_loss_fn(agg: str = "token-mean") -> ts.LossFn:
    """loss_fn over batch keys input_ids, targets, loss_mask, optional positions /
    segment_ids (packed rows), all [B, T]. Sequence-level aggs treat a packed row as one
    sequence."""
    losses.agg_denominator(jnp.zeros((1, 1)), agg)  # fail early on an unknown agg

    def loss_fn(model, mb):
        logp, _ = model.token_logprobs(mb["input_ids"], mb["targets"], mb.get("positions"),
                                       mb.get("segment_ids"))
        loss_sum, denom = losses.sft_loss_terms(logp, mb["loss_mask"], agg)
        return loss_sum, denom, {}
    return loss_fn


def build_sft_step(cfg, graphdef, optimizer, schedule, mesh, shardings):
    """The jitted ``(state, batch) -> (state, metrics)`` of ``cfg`` (an SFT config)."""
    return ts.make_train_step(graphdef, optimizer, sft_loss_fn(cfg.train.loss_agg), mesh,
                              cfg.train.num_microbatches, shardings, schedule=schedule)


def batch_shapes(cfg) -> dict:
    """{key: ((B, T), dtype)} of one global SFT batch."""
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    return {k: (shape, dt) for k, dt in BATCH_KEYS.items()}
