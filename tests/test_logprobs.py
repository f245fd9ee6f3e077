"""chunked_token_logprobs equals the unchunked computation (values and gradients) and its
compiled backward needs far less temporary memory than the [B, T, V] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klear_jax.models.logprobs import chunked_token_logprobs, token_logprobs_reference


def _inputs(B, T, D, V, dtype=jnp.float32, seed=0):
    r = np.random.RandomState(seed)
    hidden = jnp.asarray(r.randn(B, T, D), dtype)
    unembed = jnp.asarray(r.randn(D, V) / np.sqrt(D), jnp.float32)
    targets = jnp.asarray(r.randint(0, V, size=(B, T)), jnp.int32)
    return hidden, unembed, targets


def _loss(fn, **kw):
    # Weighted sums so every position's gradient matters and differs.
    def loss(h, w, t):
        logp, ent = fn(h, w, t, **kw)
        wts = jnp.cos(jnp.arange(logp.size, dtype=jnp.float32)).reshape(logp.shape)
        return jnp.sum(wts * logp) + 0.3 * jnp.sum(wts[::-1] * ent)
    return loss


@pytest.mark.parametrize("B,T,chunk,remat", [(1, 37, 8, True),    # T not divisible by chunk
                                             (3, 20, 64, True),   # chunk >= T
                                             (2, 32, 8, True),    # divisible, B > 1
                                             (1, 37, 8, False)])  # chunks' softmax saved
def test_matches_reference_float32(B, T, chunk, remat):
    h, w, t = _inputs(B, T, 16, 50)
    lp, ent = jax.jit(lambda h, w, t: chunked_token_logprobs(h, w, t, chunk_size=chunk,
                                                             remat=remat))(h, w, t)
    rlp, rent = token_logprobs_reference(h, w, t)
    assert lp.shape == ent.shape == (B, T) and lp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, rlp, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(ent, rent, rtol=1e-6, atol=1e-5)
    # Sanity of the reference itself: logp <= 0, 0 <= entropy <= log V.
    assert float(rlp.max()) <= 0.0 and float(rent.min()) >= -1e-5
    assert float(rent.max()) <= np.log(50) + 1e-5

    g = jax.jit(jax.grad(_loss(chunked_token_logprobs, chunk_size=chunk, remat=remat),
                         argnums=(0, 1)))(h, w, t)
    rg = jax.grad(_loss(token_logprobs_reference), argnums=(0, 1))(h, w, t)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert float(jnp.abs(b).max()) > 1e-3  # the gradient is not trivially zero


def test_matches_reference_bfloat16_hidden():
    h, w, t = _inputs(2, 45, 32, 64, dtype=jnp.bfloat16, seed=1)
    w = w.astype(jnp.bfloat16)
    lp, ent = chunked_token_logprobs(h, w, t, chunk_size=16)
    rlp, rent = token_logprobs_reference(h, w, t)
    assert lp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, rlp, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(ent, rent, rtol=1e-2, atol=1e-2)
    # And close to the all-float32 computation on the same (rounded) inputs.
    flp, _ = token_logprobs_reference(h.astype(jnp.float32), w.astype(jnp.float32), t)
    np.testing.assert_allclose(lp, flp, rtol=2e-2, atol=2e-2)
    g = jax.grad(_loss(chunked_token_logprobs, chunk_size=16), argnums=(0, 1))(h, w, t)
    rg = jax.grad(_loss(token_logprobs_reference), argnums=(0, 1))(h, w, t)
    for a, b in zip(g, rg):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=5e-2, atol=5e-2)


def test_temperature_and_no_entropy():
    h, w, t = _inputs(2, 19, 8, 30, seed=2)
    lp, ent = chunked_token_logprobs(h, w, t, chunk_size=5, return_entropy=False,
                                     temperature=0.7)
    assert ent is None
    rlp, _ = token_logprobs_reference(h / 0.7, w, t)
    np.testing.assert_allclose(lp, rlp, rtol=1e-5, atol=1e-5)
    # Traced temperature (the sampler passes an array) gives the same.
    lp2, _ = jax.jit(lambda temp: chunked_token_logprobs(h, w, t, chunk_size=5,
                                                         temperature=temp))(jnp.float32(0.7))
    np.testing.assert_allclose(lp2, lp, rtol=1e-6, atol=1e-6)


def test_bad_inputs_name_the_tensor():
    h, w, t = _inputs(1, 4, 8, 10)
    with pytest.raises(ValueError, match="unembed"):
        chunked_token_logprobs(h, w.T, t)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(h, w, t[:, :3])
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(h, w, t.astype(jnp.float32))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(h, w, t, chunk_size=0)


def _backward_temp_bytes(fn, B, T, D, V):
    args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32),
            jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32))
    compiled = jax.jit(jax.grad(_loss(fn), argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_backward_memory_well_below_full_logits():
    B, T, D, V, c = 2, 2048, 64, 32000, 128
    chunked_fn = lambda h, w, t: chunked_token_logprobs(h, w, t, chunk_size=c)  # noqa: E731
    full_logits = B * T * V * 4
    one_chunk = B * c * V * 4
    chunked = _backward_temp_bytes(chunked_fn, B, T, D, V)
    unchunked = _backward_temp_bytes(token_logprobs_reference, B, T, D, V)
    assert unchunked >= full_logits            # the reference does hold [B, T, V]
    assert chunked < unchunked / 10, (chunked, unchunked)
    # Bounded by a handful of chunk-sized blocks (logits, probs, their cotangents)...
    assert chunked <= 6 * one_chunk, (chunked, one_chunk)
    # ...and independent of T: doubling the sequence does not grow the temporaries.
    chunked_2t = _backward_temp_bytes(chunked_fn, B, 2 * T, D, V)
    assert chunked_2t < 1.1 * chunked + 2 * B * T * D * 4, (chunked_2t, chunked)
