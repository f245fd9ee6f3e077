"""klear_jax.backend + models.kernels: the platform choices, and the generic (accelerator)
forms against the CPU-tuned ones on the same model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klear_jax import backend
from klear_jax import sharding as shd
from klear_jax.aot import parse_topology, topology_devices
from klear_jax.models import ModelConfig, create_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                  dtype="float32", param_dtype="float32", logprob_chunk_size=16)


def test_attention_impl_per_platform():
    assert backend.target_platform() == "cpu"
    assert backend.attention_impl("auto") == "xla"
    assert backend.attention_impl("splash") == "splash"
    with pytest.raises(ValueError, match="unknown"):
        backend.attention_impl("flash3")
    tpu = shd.make_mesh(fsdp=8, devices=topology_devices(parse_topology("v5p:2x2x2")))
    with shd.use_mesh(tpu):
        assert backend.target_platform() == "tpu"
        assert backend.attention_impl("auto") == "splash"
        assert not backend.cpu_kernels() and not backend.pallas_interpret()
    assert backend.compiler_options(tpu) is None


@pytest.mark.parametrize("remat", ["none", "full"])
def test_generic_forms_match_cpu_forms(monkeypatch, remat):
    """The model's loss and every parameter's gradient through the accelerator forms (plain
    einsums, autodiff, jax.checkpoint attention) equal the CPU-tuned forms' on packed rows."""
    model = create_model(CFG.replace(remat_policy=remat), seed=0)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 24)), jnp.int32)
    seg = jnp.asarray([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4], jnp.int32)

    def loss(p):
        m = nnx.merge(graphdef, p)
        logp, _ = m.token_logprobs(ids, jnp.roll(ids, -1, 1), None, seg)
        return jnp.sum(jnp.where(seg > 0, logp, 0.0))

    cpu = jax.jit(jax.value_and_grad(loss))(params)
    monkeypatch.setattr(backend, "cpu_kernels", lambda: False)
    generic = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(float(generic[0]), float(cpu[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(generic[1]), jax.tree.leaves(cpu[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                   atol=1e-5 * float(np.abs(np.asarray(b)).max()))


def test_gpu_flash_impl_runs_the_pallas_kernel_where_cudnn_cannot(caplog):
    """attention_impl "gpu_flash" on CPU: cuDNN reports why it cannot run, the Pallas kernel
    runs in interpret mode, and matches the XLA path on packed rows with GQA."""
    from klear_jax.models import kernels
    from klear_jax.models.attention import positions_from_segment_ids, xla_attention
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 128, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 128, 2, 16)), jnp.float32) for _ in range(2))
    seg = jnp.asarray([[1] * 60 + [2] * 68, [0] * 8 + [1] * 120], jnp.int32)
    pos = positions_from_segment_ids(seg)
    got = kernels.attention(q, k, v, pos, pos, seg, seg, impl="gpu_flash")
    want = xla_attention(q, k, v, pos, pos, seg, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
