"""The Qwen decoder gives the same logits (and KV-cache steps) on 8 fake devices under
several meshes, with parameters really sharded by their logical names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from klear_jax import sharding as shd
from klear_jax.models import (ModelConfig, cache_shardings, create_model, init_cache,
                              param_logical_axes, param_shardings)

# dims divisible by 8 (fsdp) and 2 (tensor) so every rule really shards
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                  tie_word_embeddings=False)
MESHES = {"single": dict(data=1, fsdp=1, tensor=1), "fsdp8": dict(data=1, fsdp=8, tensor=1),
          "d2f2t2": dict(data=2, fsdp=2, tensor=2)}


def _ids():
    return jnp.asarray(np.random.RandomState(0).randint(0, 128, (8, 11)), jnp.int32)


@pytest.fixture(scope="module")
def reference():
    model = create_model(CFG, seed=0)
    return model, np.asarray(nnx.jit(lambda m, x: m(x))(model, _ids()))


_MODELS = {}


def sharded_model(name):
    """One sharded model per mesh for the whole module (compiles are the cost here)."""
    if name not in _MODELS:
        _MODELS[name] = create_model(CFG, seed=0, mesh=_mesh(name))
    return _MODELS[name]


def _mesh(name):
    kw = MESHES[name]
    n = kw["data"] * kw["fsdp"] * kw["tensor"]
    return shd.make_mesh(**kw, devices=jax.devices()[:n])


@pytest.mark.parametrize("name", list(MESHES))
def test_same_logits_on_meshes(reference, name):
    assert len(jax.devices()) == 8
    ref_model, ref = reference
    mesh = _mesh(name)
    model = sharded_model(name)
    # creation was sharded and reproduces the unsharded init exactly
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    graphdef, state = nnx.split(model)
    ids = jax.device_put(_ids(), shd.named_sharding(mesh, ("act_batch", "act_length")))

    @jax.jit
    def fwd(state, ids):
        return nnx.merge(graphdef, state)(ids)

    with shd.use_mesh(mesh):
        out = fwd(state, ids)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def test_parameters_sharded_by_logical_names():
    model = sharded_model("d2f2t2")
    q = model.layers.attn.q_proj.kernel.get_value()
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 16)
    assert model.layers.attn.o_proj.kernel.get_value().sharding.spec == P(None, "tensor", None, "fsdp")
    assert model.embed.embedding.get_value().sharding.spec == P("tensor", "fsdp")
    assert model.layers.mlp.down_proj.kernel.get_value().sharding.spec == P(None, "tensor", "fsdp")
    names = param_logical_axes(model)
    assert names["lm_head"]["kernel"] == ("embed", "vocab")
    assert names["layers"]["attn"]["k_proj"]["kernel"] == ("layers", "embed", "kv_heads", "head_dim")
    # fsdp=8 over D=64 and tensor=1: the helper maps abstract state too
    abstract = nnx.state(nnx.eval_shape(lambda: create_model(CFG)))
    sh = param_shardings(abstract, _mesh("fsdp8"))
    assert sh["layers"]["mlp"]["up_proj"]["kernel"].get_value().spec == P(None, "fsdp", "tensor")


def test_kv_cache_under_mesh_matches_full_forward(reference):
    ref_model, _ = reference
    mesh = _mesh("d2f2t2")
    model = sharded_model("d2f2t2")
    ids = _ids()[:4, :9]
    graphdef, state = nnx.split(model)
    cache = init_cache(CFG, 4, 12)
    cache = jax.device_put(cache, cache_shardings(cache, mesh))
    assert len(cache["k"]) == CFG.num_layers
    assert cache["k"][0].sharding.spec == P(("data", "fsdp"), "tensor", None, None)

    @jax.jit
    def step(state, ids, cache):
        m = nnx.merge(graphdef, state)
        h, cache = m.hidden_states(ids, cache=cache)
        return m.logits(h), cache

    with shd.use_mesh(mesh):
        a, cache = step(state, ids[:, :6], cache)
        outs = [a]
        for t in range(6, 9):
            a, cache = step(state, ids[:, t:t + 1], cache)
            outs.append(a)
    got = np.asarray(jnp.concatenate(outs, axis=1))
    ref = np.asarray(nnx.jit(lambda m, x: m(x))(ref_model, ids))
    np.testing.assert_allclose(got, ref, atol=2e-5)
