"""The RL objective for ``train_step.make_train_step`` and the old-log-prob pass.

Two loss terms, each normalised by its own GLOBAL mini-batch denominator (computed by
``denom_fn`` from the whole mini-batch before the micro-batch scan):

    loss = policy_sum / D_pg  +  sft_alpha * sft_sum / D_sft

``policy_sum`` / ``D_pg``: ``losses.policy_loss_terms`` (gppo by default) over the response
tokens (loss_mask); ``sft_sum`` / ``D_sft``: NLL over the response tokens of max-reward
responses (``positive``), ``losses.positive_sft_terms``. Batch keys: see ``klear_jax.rl.batch``; plus
``old_logp`` [B, T] from :func:`make_logprob_fn` on the pre-update params.

``normalize`` (config ``loss.normalize``):
  "minibatch"   (default; the paper's equations) D_pg = the ``agg`` denominator of the whole
                mini-batch (token-mean: its response tokens), D_sft = its positive tokens.
  "microbatch"  (the authors' verl run) rows carry ``pg_scale`` / ``sft_scale``
                (``rl.batch.verl_microbatch_scales``): policy_sum = sum_r pg_scale_r x
                (row r's token sum), sft_sum likewise, and D_pg = D_sft = the mini-batch's
                rows R: each emulated verl micro-batch is a token-mean weighted by its rows.
``partial_minibatch`` (config ``train.partial_minibatch``), for a mini-batch holding fewer
real rows than its nominal B (the last one of a short step): "full" takes a full-size step;
"scaled" multiplies the loss by real / B (verl's ``len(data) / ppo_mini_batch_size``; under
"microbatch" R = B then); "drop" never sees one (``rl.loop`` drops it; R = B as "scaled").
A mini-batch with no response token has denominators 0, so the train step skips it.

Log-probs use the sampling temperature (logits / T), as the sampler's do, so the ratio is
taken between the same distributions the responses were drawn from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from klear_jax import backend, losses
from klear_jax import sharding as shd
from klear_jax import train_step as ts

sg = jax.lax.stop_gradient
NORMALIZE = ("minibatch", "microbatch")
PARTIAL_MINIBATCH = ("full", "scaled", "drop")


@dataclasses.dataclass(frozen=True)
class RLLossConfig:
    """The RL objective's settings, built once from the ``loss`` / ``rollout`` blocks."""

    policy: losses.PolicyLoss = losses.PolicyLoss(dual_clip=10.0)
    sft_alpha: float = 0.1
    temperature: float = 1.0   # the sampling temperature: log-probs of logits / T
    normalize: str = "minibatch"       # NORMALIZE (module docstring)
    partial_minibatch: str = "full"    # PARTIAL_MINIBATCH (module docstring)

    def __post_init__(self):
        if self.normalize not in NORMALIZE:
            raise ValueError(f"RLLossConfig.normalize must be one of {NORMALIZE}, "
                             f"got {self.normalize!r}")
        if self.partial_minibatch not in PARTIAL_MINIBATCH:
            raise ValueError(f"RLLossConfig.partial_minibatch must be one of "
                             f"{PARTIAL_MINIBATCH}, got {self.partial_minibatch!r}")

    @classmethod
    def from_config(cls, cfg) -> "RLLossConfig":
        lc = cfg.loss
        policy = losses.PolicyLoss(kind=lc.kind, eps_low=lc.eps_low, eps_high=lc.eps_high,
                                   beta1=lc.beta1, beta2=lc.beta2,
                                   dual_clip=lc.dual_clip or None, agg=lc.agg,
                                   norm_length=lc.norm_length or None)
        return cls(policy, float(lc.sft_alpha), float(cfg.rollout.temperature),
                   lc.normalize, cfg.train.partial_minibatch)


class RLLoss(NamedTuple):
    loss_fn: Callable
    denom_fn: Callable
    loss_weights: dict
    finalize_metrics: Callable


def make_rl_loss(lc: RLLossConfig = RLLossConfig()) -> RLLoss:
    """The four pieces ``make_train_step`` takes for the RL objective (module docstring).

    Metrics (finalised): pg_loss, clipfrac_low / clipfrac_high / dual_clipfrac, ratio_mean /
    ratio_min / ratio_max, approx_kl, tokens (policy tokens), sft_nll (mean NLL of the
    positive responses), sft_tokens."""
    policy = lc.policy
    micro = lc.normalize == "microbatch"

    def loss_fn(model, mb):
        logp, _ = model.token_logprobs(mb["input_ids"], mb["targets"], None, mb["segment_ids"],
                                       temperature=lc.temperature)
        mask = mb["loss_mask"]
        pg_sum, pg_den, sums = losses.policy_loss_terms(
            logp, mb["old_logp"], mb["advantages"], mask, policy,
            row_weights=mb["pg_scale"] if micro else None)
        sft_sum, sft_den = losses.positive_sft_terms(logp, mask,
                                                     mb["sft_scale"] if micro else mb["positive"])
        sums = dict(sums, sft_nll=sg(sft_sum))
        return {"pg": pg_sum, "sft": sft_sum}, {"pg": pg_den, "sft": sft_den}, sums

    def denom_fn(batch):
        m = batch["loss_mask"] > 0
        B = m.shape[0]
        real = jnp.sum(jnp.any(batch["segment_ids"] > 0, axis=-1), dtype=jnp.float32)
        if micro:
            rows = real if lc.partial_minibatch == "full" else jnp.float32(B)
            d = jnp.where(jnp.any(m), rows, 0.0)
            return {"pg": d, "sft": d}
        w = batch["positive"].astype(jnp.float32)[:, None]
        sft = jnp.sum(jnp.where(m & (w > 0), jnp.broadcast_to(w, m.shape), 0.0))
        pg = losses.agg_denominator(m, policy.agg, policy.norm_length)
        if lc.partial_minibatch != "full":  # loss x real / B
            pg, sft = pg * B / jnp.maximum(real, 1.0), sft * B / jnp.maximum(real, 1.0)
        return {"pg": pg, "sft": sft}

    def finalize_metrics(sums, denom):
        out = losses.finalize_metrics({k: v for k, v in sums.items() if k != "sft_nll"},
                                      denom["pg"])
        out["sft_nll"] = losses.finalize(sums["sft_nll"], denom["sft"])
        out["sft_tokens"] = denom["sft"]
        return out

    return RLLoss(loss_fn, denom_fn, {"pg": 1.0, "sft": lc.sft_alpha}, finalize_metrics)


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
        logp, ent = model.token_logprobs(mb["input_ids"], mb["targets"], None, mb["segment_ids"],
                                         return_entropy=True, temperature=temperature)
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
                     compiler_options=backend.compiler_options(mesh))

    def run(params, mb):
        with shd.use_mesh(mesh):
            return jitted(params, mb)
    return run
