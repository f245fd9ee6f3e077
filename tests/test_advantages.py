"""GRPO / RLOO advantages and the group filter, on numpy and on JAX arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klear_jax.rl.batch import grpo_advantages, group_filter_mask, rloo_advantages

REWARDS = np.array([[1.0, -1.0, -1.0, 1.0],
                    [1.0, 1.0, 1.0, 1.0],
                    [0.0, 0.5, 1.0, 0.5]])


def test_grpo_known_values_unbiased_std():
    a = grpo_advantages(REWARDS)
    assert isinstance(a, np.ndarray) and a.shape == (3, 4)
    # row 0: mean 0, unbiased std = sqrt(4/3)
    np.testing.assert_allclose(a[0], np.array([1, -1, -1, 1]) / (np.sqrt(4 / 3) + 1e-6), rtol=1e-6)
    np.testing.assert_array_equal(a[1], 0.0)  # all equal: zero advantage, no NaN
    # row 2: mean 0.5, unbiased std = sqrt(0.5/3)
    np.testing.assert_allclose(a[2], np.array([-0.5, 0, 0.5, 0]) / (np.sqrt(0.5 / 3) + 1e-6), rtol=1e-6)


def test_grpo_no_std_and_eps():
    np.testing.assert_allclose(grpo_advantages(REWARDS, use_std=False)[2], [-0.5, 0, 0.5, 0])
    a = grpo_advantages(np.array([[0.0, 1.0]]), eps=1.0)
    s = np.std([0.0, 1.0], ddof=1)
    np.testing.assert_allclose(a, [[-0.5 / (s + 1), 0.5 / (s + 1)]], rtol=1e-6)


def test_rloo_known_values():
    a = rloo_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]))
    np.testing.assert_allclose(a[0], [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(a[1], [3 - 5 / 3, 1 - 7 / 3, 0, 0], rtol=1e-6, atol=1e-7)


def test_group_filter():
    np.testing.assert_array_equal(group_filter_mask(REWARDS), [True, False, True])
    np.testing.assert_array_equal(group_filter_mask([[1, 1], [0, 1]]), [False, True])
    np.testing.assert_array_equal(group_filter_mask([[0.0, 1e-9]], atol=1e-6), [False])


def test_jax_arrays_and_jit_match_numpy():
    r = jnp.asarray(REWARDS, jnp.float32)
    for fn in (grpo_advantages, rloo_advantages, group_filter_mask):
        out = jax.jit(fn)(r)
        assert isinstance(out, jax.Array)
        np.testing.assert_allclose(np.asarray(out), fn(REWARDS), rtol=1e-5, atol=1e-6)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        grpo_advantages(np.zeros(4))
    with pytest.raises(ValueError, match="G >= 2"):
        grpo_advantages(np.zeros((3, 1)))
    with pytest.raises(ValueError, match="G >= 2"):
        rloo_advantages(np.zeros((3, 1)))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(2, 8), st.data())
def test_property_group_stats(p, g, data):
    r = np.array(data.draw(st.lists(st.sampled_from([-1.0, 0.0, 0.25, 1.0]), min_size=p * g,
                                    max_size=p * g))).reshape(p, g)
    a = grpo_advantages(r)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a.mean(axis=1), 0.0, atol=1e-6)
    keep = group_filter_mask(r)
    # dropped groups are exactly the zero-advantage ones
    np.testing.assert_array_equal(keep, np.any(a != 0, axis=1))
    # unit unbiased std where the group varies (up to eps)
    if keep.any():
        np.testing.assert_allclose(a[keep].std(axis=1, ddof=1), 1.0, rtol=1e-4)
    np.testing.assert_allclose(rloo_advantages(r), g / (g - 1) * grpo_advantages(r, use_std=False), atol=1e-9)
