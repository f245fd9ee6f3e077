"""optim.make_optimizer: optax's clip + AdamW chain, the decay mask, the schedules."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from klear_jax import optim

OPTIM = dict(lr=1e-2, end_lr=1e-3, schedule="cosine", warmup_steps=2, decay_steps=6, b1=0.9,
             b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, mu_dtype="")


def tiny_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"layers": {"mlp": {"kernel": jax.random.normal(k[0], (2, 8, 16))},
                       "input_norm": {"scale": jnp.ones((2, 8))}},
            "lm_head": {"kernel": jax.random.normal(k[1], (8, 32)), "bias": jnp.zeros((32,))}}


def test_decay_mask_by_path():
    mask = optim.decay_mask(tiny_params())
    assert mask == {"layers": {"mlp": {"kernel": True}, "input_norm": {"scale": False}},
                    "lm_head": {"kernel": True, "bias": False}}


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])
def test_make_optimizer_is_the_optax_chain(clip_norm):
    """Same updates and state layout as optax.chain(clip_by_global_norm, adamw) written out."""
    opt, schedule = optim.make_optimizer(dict(OPTIM, clip_norm=clip_norm), total_steps=6)
    ref = optax.chain(*([optax.clip_by_global_norm(clip_norm)] if clip_norm else []),
                      optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                  mask=optim.decay_mask))
    params = tiny_params()
    s, r = opt.init(params), ref.init(params)
    assert jax.tree.structure(s) == jax.tree.structure(r)
    for i in range(4):
        g = jax.tree.map(lambda x: 10.0 * jax.random.normal(jax.random.key(i), x.shape), params)
        u, s = opt.update(g, s, params)
        v, r = ref.update(g, r, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), u, v)


def test_schedules():
    cos = optim.make_schedule(1e-2, "cosine", warmup_steps=2, decay_steps=6, end_lr=1e-3)
    np.testing.assert_allclose([float(cos(i)) for i in (0, 1, 2, 6, 50)],
                               [0.0, 5e-3, 1e-2, 1e-3, 1e-3], rtol=1e-5)
    const = optim.make_schedule(1e-3, "constant", warmup_steps=4)
    np.testing.assert_allclose([float(const(i)) for i in (0, 2, 4, 99)],
                               [0.0, 5e-4, 1e-3, 1e-3], rtol=1e-5)
    with pytest.raises(ValueError, match="unknown schedule"):
        optim.make_schedule(1e-3, "linear")
