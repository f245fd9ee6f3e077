"""Policy losses (GPPO and relatives), SFT losses and loss aggregation, as pure JAX functions.

Every loss has two forms:

* a *terms* form returning ``(loss_sum, denom)`` (plus metric sums for policy losses). Sums
  and denominators add across micro-batches and devices; the train step accumulates them
  (lax.scan over micro-batches, global sum across devices) and divides once with
  :func:`finalize`. Denominators depend on the mask alone (:func:`agg_denominator`), so a
  trainer may compute the global denominator first and scale each micro-batch by it.
* a convenience form (:func:`policy_loss`) = the scalar for one batch.

Aggregation modes (``agg``) and how their (sum, denom) pair is formed, with m the 0/1 mask,
l the per-token loss, n_b = sum_t m[b, t] and S = #{b : n_b > 0} (non-empty sequences):

=========================  ====================================  ==========
agg                        sum                                   denom
=========================  ====================================  ==========
token-mean                 sum_bt m*l                            sum_bt m
seq-mean-token-mean        sum_b (sum_t m*l) / n_b               S
seq-mean-token-sum         sum_bt m*l                            S
seq-mean-token-sum-norm    sum_bt m*l / norm_length              S
=========================  ====================================  ==========

Each row is a sum over sequences of something that depends only on that sequence, so
splitting a batch along B and adding the pairs is exact. ``seq-mean-token-sum-norm`` is
Dr.GRPO: 1/(B*L) with a constant L (``norm_length``, required). Rows with an empty mask
(micro-batch padding) contribute nothing to any sum or denominator.

Per-token policy losses (minimised; r = exp(logp - old_logp), A the advantage, F the
gradient factor of the paper (arXiv 2508.07629) section 2 so that d loss_t / d logp_t = -A * F):

* ``gppo``      Eq. 11 (GPPO), general form: the clipped branches are beta1*(1-eps_low)
                (A<0, r<1-eps_low) and beta2*(1+eps_high) (A>0, r>1+eps_high) in value and
                in F; everywhere else r*A with F=r. With beta1=beta2=1 this is exactly
                -min(r*A, clip(r, (1-eps_l)/sg(r)*r, (1+eps_h)/sg(r)*r)*A).
* ``gppo_high`` zero-gradient (standard) clipping on the low side, gradient-preserving
                (beta2) on the high side, as in the authors' code.
* ``clip``      PPO with asymmetric clip-higher bounds: -min(r*A, clip(r,1-el,1+eh)*A).
* ``cispo``     -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp.
* ``gspo``      GSPO-token: the sequence ratio s_b = exp(mean_t(logp-old_logp)) replaces r
                (value s_b, F = s_b for every token of the sequence), then PPO clipping on
                s_b. The GSPO paper's bounds are much tighter: when kind="gspo" and eps_low /
                eps_high are left at None they default to 3e-4 / 4e-4 (:data:`DEFAULT_EPS`).
* ``pg``        unclipped importance-weighted policy gradient -r*A (F=r; REINFORCE on-policy).

Dual clip (``dual_clip=c``, c > 1): for A<0 the per-token loss is min(loss, -c*A) (verl's
dual clip), so tokens whose ratio exceeds c get zero gradient. For ``cispo``, whose loss value
is not a ratio, those tokens keep their value but get zero gradient.

Numerics: every log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp, and
ratios enter the graph as sg(r) * exp(logp - sg(logp)) (value r, d/dlogp = r), so the
table's gradients hold even where the clamp is active. Masked tokens are removed with
jnp.where on the inputs and on the per-token loss: their gradient is exactly zero even if
their logp / old_logp hold NaN or Inf. The mask is treated as boolean (mask > 0).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

LOG_RATIO_CLAMP = 20.0
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# (eps_low, eps_high) used when the caller passes None; GSPO's come from the GSPO paper.
DEFAULT_EPS = {"gppo": (0.2, 0.28), "gppo_high": (0.2, 0.28), "clip": (0.2, 0.28),
               "cispo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "pg": (0.2, 0.28)}

sg = jax.lax.stop_gradient


class TokenTerms(NamedTuple):
    """Per-token output of a policy-loss kind, all [B, T]."""

    loss: jax.Array        # loss to minimise, before masking / dual clip
    ratio: jax.Array       # ratio value the clipping acts on (token r, or sequence s for gspo)
    clip_low: jax.Array    # bool: the low-side clip is active
    clip_high: jax.Array   # bool: the high-side clip is active


class _Ctx(NamedTuple):
    logp: jax.Array        # [B, T] masked (0 where masked), differentiable
    log_ratio: jax.Array   # [B, T] clamped logp - old_logp value (no gradient), 0 where masked
    unit: jax.Array        # [B, T] exp(logp - sg(logp)): value 1, d/dlogp = 1
    adv: jax.Array         # [B, T] advantages (no gradient)
    mask: jax.Array        # [B, T] bool
    eps_low: float
    eps_high: float
    beta1: float
    beta2: float


def _regions(ctx: _Ctx, r_val):
    pos, neg = ctx.adv > 0, ctx.adv < 0
    return neg & (r_val < 1.0 - ctx.eps_low), pos & (r_val > 1.0 + ctx.eps_high)


def _ppo_clip(ctx: _Ctx, r_val) -> TokenTerms:
    r = sg(r_val) * ctx.unit
    a = ctx.adv
    obj = jnp.minimum(r * a, jnp.clip(r, 1.0 - ctx.eps_low, 1.0 + ctx.eps_high) * a)
    low, high = _regions(ctx, r_val)
    return TokenTerms(-obj, r_val, low, high)


def _clip(ctx: _Ctx) -> TokenTerms:
    return _ppo_clip(ctx, jnp.exp(ctx.log_ratio))


def _gppo(ctx: _Ctx) -> TokenTerms:
    r_val = jnp.exp(ctx.log_ratio)
    low, high = _regions(ctx, r_val)
    a, unit = ctx.adv, ctx.unit
    # (1 +- eps)/sg(r)*r of Eq. 11 == (1 +- eps) * unit: value 1 +- eps, gradient 1 +- eps.
    obj = jnp.where(high, ctx.beta2 * (1.0 + ctx.eps_high) * unit * a,
                    jnp.where(low, ctx.beta1 * (1.0 - ctx.eps_low) * unit * a, sg(r_val) * unit * a))
    return TokenTerms(-obj, r_val, low, high)


def _gppo_high(ctx: _Ctx) -> TokenTerms:
    r_val = jnp.exp(ctx.log_ratio)
    low, high = _regions(ctx, r_val)
    a, unit = ctx.adv, ctx.unit
    obj = jnp.where(high, ctx.beta2 * (1.0 + ctx.eps_high) * unit * a,
                    jnp.where(low, (1.0 - ctx.eps_low) * a, sg(r_val) * unit * a))
    return TokenTerms(-obj, r_val, low, high)


def _cispo(ctx: _Ctx) -> TokenTerms:
    r_val = jnp.exp(ctx.log_ratio)
    weight = jnp.clip(r_val, 1.0 - ctx.eps_low, 1.0 + ctx.eps_high)
    loss = -sg(weight * ctx.adv) * ctx.logp
    return TokenTerms(loss, r_val, r_val < 1.0 - ctx.eps_low, r_val > 1.0 + ctx.eps_high)


def _gspo(ctx: _Ctx) -> TokenTerms:
    m = ctx.mask.astype(jnp.float32)
    n = jnp.sum(m, axis=-1, keepdims=True)
    seq_log_ratio = jnp.sum(ctx.log_ratio * m, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)
    s_val = jnp.broadcast_to(jnp.exp(seq_log_ratio), ctx.log_ratio.shape)
    return _ppo_clip(ctx, s_val)


def _pg(ctx: _Ctx) -> TokenTerms:
    r_val = jnp.exp(ctx.log_ratio)
    none = jnp.zeros(r_val.shape, bool)
    return TokenTerms(-(sg(r_val) * ctx.unit * ctx.adv), r_val, none, none)


# name -> per-token kind function; policy_loss(kind=name) selects from it.
POLICY_LOSSES: dict[str, Callable[[_Ctx], TokenTerms]] = {
    "gppo": _gppo, "gppo_high": _gppo_high, "clip": _clip,
    "cispo": _cispo, "gspo": _gspo, "pg": _pg,
}
RATIO_VALUED = ("gppo", "gppo_high", "clip", "gspo", "pg")  # kinds whose loss value is ratio*A


# ----------------------------------------------------------------------------- aggregation
def _check_agg(agg: str, norm_length):
    if agg not in AGG_MODES:
        raise ValueError(f"losses: unknown agg {agg!r}; allowed: {', '.join(AGG_MODES)}")
    if agg == "seq-mean-token-sum-norm" and (norm_length is None or norm_length <= 0):
        raise ValueError("losses: agg='seq-mean-token-sum-norm' needs a constant norm_length > 0 "
                         f"(Dr.GRPO's L), got {norm_length!r}")


def agg_denominator(mask, agg: str = "token-mean", norm_length=None) -> jax.Array:
    """Denominator of ``agg`` for mask [B, T] (float32 scalar); see the module table."""
    _check_agg(agg, norm_length)
    m = jnp.asarray(mask) > 0
    if agg == "token-mean":
        return jnp.sum(m, dtype=jnp.float32)
    return jnp.sum(jnp.any(m, axis=-1), dtype=jnp.float32)


def aggregate_terms(per_token, mask, agg: str = "token-mean", norm_length=None,
                    row_weights=None):
    """(sum, denom) of per-token values [B, T] under ``agg``; masked entries never leak.
    ``row_weights`` [B] (optional) multiply each row's contribution to the sum (not the
    denominator): per-row normalisations such as the authors' micro-batch token-mean."""
    _check_agg(agg, norm_length)
    m = jnp.asarray(mask) > 0
    x = jnp.where(m, per_token, 0.0)
    if row_weights is not None:
        x = x * jnp.asarray(row_weights, jnp.float32)[:, None]
    denom = agg_denominator(m, agg, norm_length)
    if agg == "seq-mean-token-mean":
        n = jnp.sum(m, axis=-1, dtype=jnp.float32)
        return jnp.sum(jnp.sum(x, axis=-1) / jnp.maximum(n, 1.0)), denom
    total = jnp.sum(x)
    if agg == "seq-mean-token-sum-norm":
        total = total / norm_length
    return total, denom


def finalize(loss_sum, denom) -> jax.Array:
    """sum / denom, and 0 (with zero gradient) when the denominator is 0."""
    safe = jnp.where(denom > 0, denom, 1.0)
    return jnp.where(denom > 0, loss_sum / safe, 0.0)


# ----------------------------------------------------------------------------- metric sums
# Metric sums are a flat dict. "tokens" counts masked-in tokens; "ratio_min" / "ratio_max"
# combine by min / max; "pg_loss" is a sum under the loss's agg, finalised with the loss's
# denominator; every other key is a token sum finalised as sum / tokens.
_MIN_KEYS = ("ratio_min",)
_MAX_KEYS = ("ratio_max",)
_AGG_KEYS = ("pg_loss",)


def combine_metric_sums(a: Mapping, b: Mapping) -> dict:
    """Merge metric sums of two micro-batches (or devices' results)."""
    out = {}
    for k in a:
        if k in _MIN_KEYS:
            out[k] = jnp.minimum(a[k], b[k])
        elif k in _MAX_KEYS:
            out[k] = jnp.maximum(a[k], b[k])
        else:
            out[k] = a[k] + b[k]
    return out


def empty_metric_sums(like: Mapping) -> dict:
    """Identity element of :func:`combine_metric_sums` (a lax.scan carry's initial value)."""
    out = {}
    for k, v in like.items():
        fill = jnp.inf if k in _MIN_KEYS else -jnp.inf if k in _MAX_KEYS else 0.0
        out[k] = jnp.full(jnp.shape(v), fill, jnp.float32)
    return out


def finalize_metrics(sums: Mapping, denom) -> dict:
    """Means per token; pg_loss / denom (the loss's denominator); ratio_min / ratio_max as
    they are (0 when there were no tokens)."""
    tokens = sums["tokens"]
    out = {}
    for k, v in sums.items():
        if k == "tokens":
            out[k] = v
        elif k in _AGG_KEYS:
            out[k] = finalize(v, denom)
        elif k in _MIN_KEYS or k in _MAX_KEYS:
            out[k] = jnp.where(tokens > 0, v, 0.0)
        else:
            out[k] = finalize(v, tokens)
    return out


# ----------------------------------------------------------------------------- policy loss
def _as_2d(name: str, x, shape=None) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 2 or (shape is not None and x.shape != shape):
        want = f"{shape}" if shape is not None else "[B, T]"
        raise ValueError(f"losses: {name} must have shape {want}, got {x.shape}")
    return x.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """The settings of a policy loss, built once (from a config) and passed whole.

    kind: a key of POLICY_LOSSES; eps_low / eps_high None -> DEFAULT_EPS[kind]; beta1 /
    beta2: GPPO-general scales of the clipped branches; dual_clip: None (off) or c > 1;
    agg / norm_length: the aggregation (module table)."""

    kind: str = "gppo"
    eps_low: float | None = None
    eps_high: float | None = None
    beta1: float = 1.0
    beta2: float = 1.0
    dual_clip: float | None = None
    agg: str = "token-mean"
    norm_length: float | None = None

    def __post_init__(self):
        if self.kind not in POLICY_LOSSES:
            raise ValueError(f"losses: unknown policy loss kind {self.kind!r}; allowed: "
                             f"{', '.join(POLICY_LOSSES)}")
        _check_agg(self.agg, self.norm_length)
        d_low, d_high = DEFAULT_EPS[self.kind]
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", d_low)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", d_high)
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError(f"losses: need 0 <= eps_low < 1 and eps_high >= 0, got "
                             f"{self.eps_low}, {self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"losses: dual_clip must be > 1 (it caps A<0 tokens at ratio c), "
                             f"got {self.dual_clip}")


def policy_loss_terms(logp, old_logp, advantages, mask, loss: PolicyLoss | None = None,
                      row_weights=None, **kw):
    """(loss_sum, denom, metric_sums) of a policy loss; see the module docstring.

    logp, old_logp, mask: [B, T]; advantages: [B] or [B, T]. ``loss``: the settings, or
    PolicyLoss's fields as keywords. ``row_weights`` [B]: see :func:`aggregate_terms`.
    Metric sums (token sums unless noted): tokens, clipfrac_low, clipfrac_high,
    dual_clipfrac (if dual_clip), ratio_mean,
    ratio_min/ratio_max (min/max), approx_kl (k3 estimate of KL(pi_old || pi): (r - 1) -
    log r) and pg_loss (summed under agg: finalised with the loss's denominator). Combine
    with combine_metric_sums, finish with finalize_metrics.
    """
    if loss is None:
        unknown = sorted(set(kw) - {f.name for f in dataclasses.fields(PolicyLoss)})
        if unknown:
            raise ValueError(f"losses: unknown options {unknown}; allowed: "
                             f"{', '.join(f.name for f in dataclasses.fields(PolicyLoss))}")
    cfg = loss if loss is not None else PolicyLoss(**kw)
    logp = _as_2d("logp", logp)
    shape = logp.shape
    old_logp = _as_2d("old_logp", old_logp, shape)
    m = _as_2d("mask", mask, shape) > 0
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.shape == shape[:1]:
        adv = jnp.broadcast_to(adv[:, None], shape)
    elif adv.shape != shape:
        raise ValueError(f"losses: advantages must have shape {shape[:1]} or {shape}, got {adv.shape}")

    logp = jnp.where(m, logp, 0.0)
    old = sg(jnp.where(m, old_logp, 0.0))
    adv = sg(jnp.where(m, adv, 0.0))
    log_ratio = sg(jnp.clip(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ctx = _Ctx(logp, log_ratio, jnp.exp(logp - sg(logp)), adv, m,
               float(cfg.eps_low), float(cfg.eps_high), float(cfg.beta1), float(cfg.beta2))
    terms = POLICY_LOSSES[cfg.kind](ctx)

    per_token = terms.loss
    c = cfg.dual_clip
    if c is not None:
        dual = (adv < 0) & (terms.ratio > c)
        if cfg.kind in RATIO_VALUED:
            per_token = jnp.where(adv < 0, jnp.minimum(per_token, -c * adv), per_token)
        else:
            per_token = jnp.where(dual, sg(per_token), per_token)
    mf = m.astype(jnp.float32)
    r_val = jnp.exp(log_ratio)
    sums = {
        "tokens": jnp.sum(mf),
        "clipfrac_low": jnp.sum(terms.clip_low * mf),
        "clipfrac_high": jnp.sum(terms.clip_high * mf),
        "ratio_mean": jnp.sum(r_val * mf),
        "ratio_min": jnp.min(jnp.where(m, r_val, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(m, r_val, -jnp.inf)),
        "approx_kl": jnp.sum(((r_val - 1.0) - log_ratio) * mf),
    }
    if c is not None:
        sums["dual_clipfrac"] = jnp.sum(dual * mf)
    loss_sum, denom = aggregate_terms(per_token, m, cfg.agg, cfg.norm_length, row_weights)
    sums["pg_loss"] = sg(loss_sum)
    return loss_sum, denom, sums


def policy_loss(logp, old_logp, advantages, mask, sft_alpha: float = 0.0, positive=None, **kw):
    """Scalar policy loss to MINIMISE for this batch alone, and finalised metrics.

    ``kw``: PolicyLoss fields. The positive-sample SFT term: ``sft_alpha`` and ``positive``
    ([B] bool/weights: responses with the maximum reward) add sft_alpha * NLL token-mean
    over those responses.
    """
    if sft_alpha and positive is None:
        raise ValueError("losses.policy_loss: sft_alpha != 0 needs positive [B]")
    loss_sum, denom, sums = policy_loss_terms(logp, old_logp, advantages, mask, **kw)
    loss = finalize(loss_sum, denom)
    metrics = finalize_metrics(sums, denom)
    if positive is not None:
        sft = finalize(*positive_sft_terms(logp, mask, positive))
        metrics["sft_positive_nll"] = sg(sft)
        loss = loss + sft_alpha * sft
    return loss, metrics


# ----------------------------------------------------------------------------- SFT losses
def sft_loss_terms(logp, mask, agg: str = "token-mean", norm_length=None):
    """(sum, denom) of the negative log-likelihood; logp, mask [B, T]."""
    logp = _as_2d("logp", logp)
    m = _as_2d("mask", mask, logp.shape) > 0
    return aggregate_terms(-jnp.where(m, logp, 0.0), m, agg, norm_length)


def positive_sft_terms(logp, mask, positive):
    """(sum, denom) of the NLL token-mean over positive responses (the SFT term inside RL).

    positive: [B] bool or non-negative weights (the response got the group's maximum
    reward). sum = sum_b w_b sum_t m*(-logp), denom = sum_b w_b sum_t m, so the RL step adds
    alpha * finalize(sum, denom) with sums / denominators accumulated globally.
    """
    logp = _as_2d("logp", logp)
    m = _as_2d("mask", mask, logp.shape) > 0
    w = jnp.asarray(positive)
    if w.shape != logp.shape[:1]:
        raise ValueError(f"losses: positive must have shape {logp.shape[:1]}, got {w.shape}")
    w = jnp.broadcast_to(w.astype(jnp.float32)[:, None], logp.shape)
    keep = m & (w > 0)
    nll = -jnp.where(keep, logp, 0.0)
    return jnp.sum(jnp.where(keep, w * nll, 0.0)), jnp.sum(jnp.where(keep, w, 0.0))
