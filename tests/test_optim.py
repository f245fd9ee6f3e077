"""optim.clipped_adamw: the fused update against the optax chain it replaces."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from klear_jax import optim

HYPER = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def tiny_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"layers": {"mlp": {"kernel": jax.random.normal(k[0], (2, 8, 16))},
                       "input_norm": {"scale": jnp.ones((2, 8))}},
            "lm_head": {"kernel": jax.random.normal(k[1], (8, 32)), "bias": jnp.zeros((32,))}}


def grads_at(params, i, scale):
    keys = jax.random.split(jax.random.key(100 + i), len(jax.tree.leaves(params)))
    leaves = [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, jax.tree.leaves(params))]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def run(opt, params, steps, scale, **extra):
    state = opt.init(params)
    update = jax.jit(lambda g, s, p: opt.update(g, s, p, **extra))
    for i in range(steps):
        updates, state = update(grads_at(params, i, scale), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("clip_norm,scale,mu_dtype", [
    (1.0, 10.0, None),      # clipped every step
    (1e6, 0.1, None),       # never clipped
    (0.0, 1.0, None),       # no clip transform at all
    (1.0, 10.0, jnp.bfloat16),
])
def test_matches_optax_chain(clip_norm, scale, mu_dtype):
    schedule = optim.make_schedule(1e-2, "cosine", warmup_steps=2, decay_steps=6, end_lr=1e-3)
    chain = optax.chain(*([optax.clip_by_global_norm(clip_norm)] if clip_norm > 0 else []),
                        optax.adamw(schedule, mask=optim.decay_mask, mu_dtype=mu_dtype, **HYPER))
    fused = optim.clipped_adamw(schedule, mask=optim.decay_mask, clip_norm=clip_norm,
                                mu_dtype=mu_dtype, **HYPER)
    params = tiny_params()
    assert (jax.tree.structure(fused.init(params)) == jax.tree.structure(chain.init(params)))
    want_p, want_s = run(chain, params, 6, scale)
    got_p, got_s = run(fused, params, 6, scale)
    tol = dict(rtol=2e-2, atol=2e-4) if mu_dtype else dict(rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), got_p, want_p)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), **tol), got_s, want_s)
    assert jax.tree.map(lambda x: x.dtype, got_s) == jax.tree.map(lambda x: x.dtype, want_s)
    # every leaf moved (the comparison above covers which of them are decayed)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got_p, params)
    assert all(v > 0 for v in jax.tree.leaves(moved))


def test_not_ok_keeps_everything():
    """ok=False (the train step's skip): zero updates and the state returned unchanged, even
    when the gradient holds NaN; the next good step continues as if it never happened."""
    schedule = optim.make_schedule(1e-2, "constant")
    fused = optim.clipped_adamw(schedule, mask=optim.decay_mask, clip_norm=1.0, **HYPER)
    params = tiny_params()
    _, state = run(fused, params, 2, 1.0)
    bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
    updates, same = jax.jit(lambda g, s, p: fused.update(g, s, p, ok=False))(bad, state, params)
    jax.tree.map(lambda u: np.testing.assert_array_equal(u, 0.0), updates)
    jax.tree.map(np.testing.assert_array_equal, same, state)
    assert int(same[1][0].count) == 2


def test_update_needs_params():
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.full((4,), 2.0)}
    fused = optim.clipped_adamw(optim.make_schedule(1e-3, "constant"), mask=optim.decay_mask,
                                **HYPER)
    with pytest.raises(ValueError, match="needs params"):
        fused.update(tree, fused.init(tree))
