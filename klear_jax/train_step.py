"""The single jitted train step, shared by SFT and RL: ``(state, batch) -> (state, metrics)``.

The model is split once into a static ``graphdef`` and a pure-dict ``params`` tree; the
``TrainState`` holds only plain arrays (params, optimizer state, counters), so it jits,
shards, donates and checkpoints like any pytree.

Normalisation. A loss function returns *sums* and their denominators for one micro-batch:

    loss_fn(model, microbatch) -> (loss_sum, denom, metric_sums)

The step scans over micro-batches accumulating grad(loss_sum), loss_sum, denom and the
metric sums, then divides by the *global* denominator once: the update equals that of the
whole batch in one piece, whatever the micro-batch split or device count.

Losses with several terms over different token sets (RL: policy term + alpha * SFT term on
all-correct responses) pass ``denom_fn(batch) -> {term: denom}``, computed from the masks of
the whole batch before the scan; ``loss_fn`` then returns dicts ``loss_sum`` / ``denom``
keyed by term, ``loss_weights`` weights them, and each micro-batch contributes
``sum_k w_k * loss_sum_k / D_k`` with the global ``D_k`` (exact for the same reason).

A non-finite loss or gradient norm, or an empty batch (denominator 0), skips the update:
params and optimizer state are kept, ``metrics["skipped"] = 1``; the host loop counts
consecutive skips (``klear_jax.trainer.SkipGuard``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from klear_jax import backend, losses
from klear_jax import sharding as shd
from klear_jax.models import param_shardings
from klear_jax.optim import opt_state_shardings

LossFn = Callable[[nnx.Module, Mapping[str, jax.Array]], tuple[Any, Any, Mapping[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    """step int32 []: steps taken (skipped ones included); skipped int32 []: total skipped;
    params: pure dict of arrays (``nnx.State.to_pure_dict`` layout); opt_state: optax state."""
    step: jax.Array
    skipped: jax.Array
    params: Any
    opt_state: Any


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """(static graphdef, params as a pure dict)."""
    graphdef, state = nnx.split(model)
    return graphdef, state.to_pure_dict()


def merge_model(graphdef: nnx.GraphDef, params: Any) -> nnx.Module:
    return nnx.merge(graphdef, nnx.State(params))


def params_shardings(model: nnx.Module, mesh: Mesh) -> dict:
    """NamedSharding per parameter (pure dict), from the params' logical axis names."""
    return param_shardings(model, mesh).to_pure_dict()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Every batch leaf is [B, ...] with B split over ('data', 'fsdp')."""
    return NamedSharding(mesh, shd.logical_to_spec(("act_batch",)))


def state_shardings(params_sh: Any, optimizer: optax.GradientTransformation,
                    abstract_params: Any, mesh: Mesh) -> TrainState:
    """TrainState of NamedShardings (works on abstract params too: usable for AOT)."""
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    rep = replicated(mesh)
    return TrainState(step=rep, skipped=rep, params=params_sh,
                      opt_state=opt_state_shardings(optimizer, abstract_opt, params_sh, rep))


def abstract_train_state(abstract_params: Any, optimizer: optax.GradientTransformation,
                         mesh: Mesh) -> tuple[TrainState, TrainState]:
    """(TrainState of ShapeDtypeStructs carrying shardings, the shardings) from abstract
    params that carry their target shardings (``checkpoint.abstract_model``): the restore
    target when resuming, and the input of ahead-of-time compilation."""
    p_sh = jax.tree.map(lambda x: x.sharding, abstract_params)
    sh = state_shardings(p_sh, optimizer, abstract_params, mesh)
    scalar = lambda: jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.step)
    opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(optimizer.init, abstract_params), sh.opt_state)
    return TrainState(step=scalar(), skipped=scalar(), params=abstract_params, opt_state=opt), sh


def init_train_state(model: nnx.Module, optimizer: optax.GradientTransformation, mesh: Mesh
                     ) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """(graphdef, state placed on the mesh, state shardings) for a (possibly sharded) model."""
    graphdef, params = split_model(model)
    p_sh = params_shardings(model, mesh)
    shardings = state_shardings(p_sh, optimizer, params, mesh)
    params = jax.device_put(params, p_sh)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return graphdef, TrainState(zero(), zero(), params, opt_state), shardings


def split_microbatches(batch: Mapping[str, jax.Array], num: int) -> dict:
    """[B, ...] leaves -> [num, B/num, ...]. Micro-batch m takes rows m, m+num, ...: each
    device's contiguous block of rows is split locally, so no data moves between devices."""
    def one(x):
        if x.shape[0] % num:
            raise ValueError(f"batch leaf of shape {x.shape}: {x.shape[0]} rows not divisible "
                             f"by num_microbatches={num}")
        x = x.reshape((x.shape[0] // num, num) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)
    return {k: one(v) for k, v in batch.items()}


def _schedule_count(opt_state) -> jax.Array:
    """The optimizer's own update count (the step its lr schedule sees)."""
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
            x, (optax.ScaleByScheduleState, optax.ScaleByAdamState))):
        if isinstance(leaf, (optax.ScaleByScheduleState, optax.ScaleByAdamState)):
            return leaf.count
    return jnp.zeros((), jnp.int32)


def default_finalize(metric_sums: Mapping[str, jax.Array], denom) -> dict:
    """Metric sums -> means: each sum over the (single) loss denominator. Sums combine across
    micro-batches with ``losses.combine_metric_sums`` (min / max keys included); a policy
    loss passes its own ``finalize_metrics`` (``rl.loss``)."""
    return {k: losses.finalize(v, denom) for k, v in metric_sums.items()}


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    loss_fn: LossFn, mesh: Mesh, num_microbatches: int,
                    shardings: TrainState, *, schedule: optax.Schedule | None = None,
                    denom_fn: Callable[[Mapping[str, jax.Array]], Any] | None = None,
                    loss_weights: Mapping[str, float] | None = None,
                    finalize_metrics: Callable[[Mapping, Any], Mapping] = default_finalize,
                    donate: bool = True):
    """Builds the jitted ``(state, batch) -> (state, metrics)``.

    ``batch``: dict of [B, ...] arrays (B = global rows, divisible by num_microbatches and
    by data*fsdp per micro-batch). metrics: scalars loss, grad_norm, lr, tokens (loss
    denominator, summed over terms), skipped (0/1), skipped_total, plus finalize_metrics'.
    The returned function has ``.jitted`` (the jax.jit object) and ``.lower(state, batch)``.
    """
    M = int(num_microbatches)
    rep = replicated(mesh)
    data_spec = shd.logical_to_spec(("act_batch",))
    p_sh = shardings.params

    def objective(params, mb, global_denoms):
        model = merge_model(graphdef, params)
        loss_sum, denom, msums = loss_fn(model, mb)
        if global_denoms is None:
            return loss_sum, (loss_sum, denom, dict(msums))
        w = loss_weights or {}
        total = sum(w.get(k, 1.0) * loss_sum[k] / jnp.maximum(global_denoms[k], 1e-9)
                    for k in loss_sum)
        return total, (loss_sum, denom, dict(msums))

    grad_fn = jax.grad(objective, has_aux=True)

    def step(state: TrainState, batch):
        global_denoms = None
        if denom_fn is not None:
            global_denoms = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), denom_fn(batch))
        f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)

        def micro(mb):
            g, aux = grad_fn(state.params, mb, global_denoms)
            g = jax.lax.with_sharding_constraint(f32(g), p_sh)
            return g, f32(aux)

        if M == 1:
            grads, (loss_sum, denom, msums) = micro(batch)
        else:
            mbs = split_microbatches(batch, M)
            mbs = jax.lax.with_sharding_constraint(
                mbs, NamedSharding(mesh, P(None, *data_spec)))
            first = jax.tree.map(lambda x: x[0], mbs)
            g0, (l0, d0, m0) = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                            jax.eval_shape(micro, first))
            acc0 = (g0, l0, d0, losses.empty_metric_sums(m0))

            def body(acc, mb):
                g, (l, d, m) = micro(mb)
                add = lambda a, b: jax.tree.map(jnp.add, a, b)
                return (add(acc[0], g), add(acc[1], l), add(acc[2], d),
                        losses.combine_metric_sums(acc[3], m)), None
            (grads, loss_sum, denom, msums), _ = jax.lax.scan(body, acc0, mbs)

        if global_denoms is None:
            d = jnp.maximum(denom, 1e-9)
            grads = jax.tree.map(lambda g: g / d, grads)
            loss = loss_sum / d
            tokens = denom
        else:  # grads already normalised per term
            w = loss_weights or {}
            loss = sum(w.get(k, 1.0) * loss_sum[k] / jnp.maximum(global_denoms[k], 1e-9)
                       for k in loss_sum)
            tokens = sum(jax.tree.leaves(global_denoms))
            denom = global_denoms
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (tokens > 0)
        lr = schedule(_schedule_count(state.opt_state)) if schedule is not None else jnp.nan
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        new_params = keep(optax.apply_updates(state.params, updates), state.params)
        new_opt = keep(new_opt, state.opt_state)
        skipped = (~ok).astype(jnp.int32)
        new_state = TrainState(step=state.step + 1, skipped=state.skipped + skipped,
                               params=new_params, opt_state=new_opt)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32),
                   "tokens": jnp.asarray(tokens, jnp.float32), "skipped": skipped,
                   "skipped_total": new_state.skipped}
        if "segment_ids" in batch:
            metrics["batch_tokens"] = jnp.sum(batch["segment_ids"] > 0, dtype=jnp.float32)
        for k, v in finalize_metrics(msums, denom).items():
            metrics.setdefault(k, v)
        return new_state, metrics

    jitted = jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)),
                     out_shardings=(shardings, rep), donate_argnums=(0,) if donate else (),
                     compiler_options=backend.compiler_options(mesh))

    def run(state, batch):
        with shd.use_mesh(mesh):
            return jitted(state, batch)

    def lower(state, batch):
        with shd.use_mesh(mesh):
            return jitted.lower(state, batch)

    run.jitted, run.lower = jitted, lower
    return run
