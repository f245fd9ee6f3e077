"""The RL objective for ``train_step.make_train_step`` and the old-log-prob pass.

Two loss terms, each normalised by its own GLOBAL mini-batch denominator (computed by
``denom_fn`` from the whole mini-batch before the micro-batch scan):

    loss = policy_sum / D_pg  +  sft_alpha * sft_sum / D_sft

``policy_sum`` / ``D_pg``: ``losses.policy_loss_terms`` (gppo by default) over the response
tokens (loss_mask); ``sft_sum`` / ``D_sft``: NLL over the response tokens of max-reward
responses (``positive``), ``losses.positive_sft_terms``. Batch keys: see ``rl_batch``; plus
``old_logp`` [B, T] from :func:`make_logprob_fn` on the pre-update params.

Log-probs use the sampling temperature (logits / T), as the sampler's do, so the ratio is
taken between the same distributions the responses were drawn from.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from klear_jax import losses
from klear_jax import sharding as shd
from klear_jax import train_step as ts
from klear_jax.models.logprobs import chunked_token_logprobs

sg = jax.lax.stop_gradient


def token_logprobs(model, mb: Mapping[str, jax.Array], temperature: float = 1.0,
                   return_entropy: bool = False):
    """(logp float32 [B, T], entropy [B, T] or None) of mb["targets"] under the tempered
    policy, chunked over T (the [B, T, V] logits never exist whole)."""
    h, _ = model.hidden_states(mb["input_ids"], None, mb["segment_ids"])
    return chunked_token_logprobs(h, model.unembed_matrix(), mb["targets"],
                                  chunk_size=model.config.logprob_chunk_size,
                                  remat=model.config.logprob_remat,
                                  return_entropy=return_entropy, temperature=temperature)


class RLLoss(NamedTuple):
    loss_fn: Callable
    denom_fn: Callable
    loss_weights: dict
    finalize_metrics: Callable


def make_rl_loss(kind: str = "gppo", eps_low: float = 0.2, eps_high: float = 0.28,
                 beta1: float = 1.0, beta2: float = 1.0, dual_clip: float | None = 10.0,
                 agg: str = "token-mean", norm_length: float | None = None,
                 sft_alpha: float = 0.1, temperature: float = 1.0) -> RLLoss:
    """The four pieces ``make_train_step`` takes for the RL objective (module docstring).

    Metrics (finalised): pg_loss, clipfrac_low / clipfrac_high / dual_clipfrac, ratio_mean /
    ratio_min / ratio_max, approx_kl, tokens (policy tokens), sft_nll (mean NLL of the
    positive responses), sft_tokens."""
    dual_clip = dual_clip or None
    norm_length = norm_length or None
    losses.agg_denominator(jnp.zeros((1, 1)), agg, norm_length)  # fail early on bad agg
    if kind not in losses.POLICY_LOSSES:
        raise ValueError(f"rl_loss: unknown policy loss {kind!r}")

    def loss_fn(model, mb):
        logp, _ = token_logprobs(model, mb, temperature)
        mask = mb["loss_mask"]
        pg_sum, pg_den, sums = losses.policy_loss_terms(
            logp, mb["old_logp"], mb["advantages"], mask, kind, eps_low, eps_high, beta1,
            beta2, dual_clip, agg, norm_length)
        sft_sum, sft_den = losses.positive_sft_terms(logp, mask, mb["positive"])
        sums = dict(sums, sft_nll=sg(sft_sum))
        return {"pg": pg_sum, "sft": sft_sum}, {"pg": pg_den, "sft": sft_den}, sums

    def denom_fn(batch):
        m = batch["loss_mask"] > 0
        w = batch["positive"].astype(jnp.float32)[:, None]
        sft = jnp.sum(jnp.where(m & (w > 0), jnp.broadcast_to(w, m.shape), 0.0))
        return {"pg": losses.agg_denominator(m, agg, norm_length), "sft": sft}

    def finalize_metrics(sums, denom):
        out = losses.finalize_metrics({k: v for k, v in sums.items() if k != "sft_nll"},
                                      denom["pg"])
        out["sft_nll"] = losses.finalize(sums["sft_nll"], denom["sft"])
        out["sft_tokens"] = denom["sft"]
        return out

    return RLLoss(loss_fn, denom_fn, {"pg": 1.0, "sft": float(sft_alpha)}, finalize_metrics)


def make_logprob_fn(graphdef, mesh, params_shardings: Any, temperature: float = 1.0,
                    num_microbatches: int = 1):
    """Jitted ``(params, mb) -> (old_logp [B, T], stats)`` on the training mesh; old_logp
    keeps the batch sharding so it joins the mini-batch without leaving the devices. The
    rows are processed ``num_microbatches`` at a time (lax.map), like the train step, so
    the forward pass never holds more activations than a training micro-batch.

    stats (sums over the mask, float32 scalars): tokens, entropy (of the tempered policy),
    mismatch_abs (|sampler_logp - logp|), mismatch_kl (k3 estimate of KL(sampler || trainer))
    and, per token, max_mismatch_abs."""
    bsh = ts.batch_sharding(mesh)
    rep = NamedSharding(mesh, jax.sharding.PartitionSpec())
    M = int(num_microbatches)

    def one(params, mb):
        model = ts.merge_model(graphdef, params)
        logp, ent = token_logprobs(model, mb, temperature, return_entropy=True)
        m = mb["loss_mask"] > 0
        d = jnp.where(m, mb["sampler_logp"] - logp, 0.0)
        stats = {"tokens": jnp.sum(m, dtype=jnp.float32),
                 "entropy": jnp.sum(jnp.where(m, ent, 0.0)),
                 "mismatch_abs": jnp.sum(jnp.abs(d)),
                 "mismatch_kl": jnp.sum(jnp.where(m, jnp.exp(-d) - 1.0 + d, 0.0)),
                 "max_mismatch_abs": jnp.max(jnp.abs(d))}
        return jnp.where(m, logp, 0.0), stats

    def fn(params, mb):
        if M == 1:
            return one(params, mb)
        B, T = mb["input_ids"].shape
        logp, stats = jax.lax.map(lambda part: one(params, part), ts.split_microbatches(mb, M))
        logp = jnp.swapaxes(logp, 0, 1).reshape(B, T)  # undo the interleaved split
        stats = {k: jnp.max(v) if k.startswith("max_") else jnp.sum(v)
                 for k, v in stats.items()}
        return logp, stats

    jitted = jax.jit(fn, in_shardings=(params_shardings, bsh), out_shardings=(bsh, rep),
                     compiler_options=shd.training_compiler_options(mesh))

    def run(params, mb):
        with shd.use_mesh(mesh):
            return jitted(params, mb)
    return run
