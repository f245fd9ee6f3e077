"""models.kernels.project: the einsum's values and gradients, through the CPU custom VJP."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klear_jax.models.cpu_kernels import leading_contraction
from klear_jax.models.kernels import project


def test_leading_contraction_accepts_only_trailing_with_leading():
    assert leading_contraction("btd,dhk->bthk") == 1
    assert leading_contraction("bthk,hkd->btd") == 2
    assert leading_contraction("...d,dv->...v") == 1
    assert leading_contraction("btd,vd->btv") is None       # tied embedding: w contracted last
    assert leading_contraction("bthk,khd->btd") is None     # contracted dims out of order
    assert leading_contraction("btd,df->bft") is None       # output reordered
    assert leading_contraction("bkgtd,bksd->bkgts") is None  # batched


@pytest.mark.parametrize("eqn, xshape, wshape", [
    ("btd,dhk->bthk", (2, 5, 6), (6, 3, 4)),
    ("bthk,hkd->btd", (2, 5, 3, 4), (3, 4, 6)),
    ("...d,dv->...v", (3, 2, 5, 6), (6, 7)),
])
@pytest.mark.parametrize("dtype, pet", [(jnp.float32, None), (jnp.bfloat16, jnp.float32)])
def test_project_matches_einsum_values_and_grads(eqn, xshape, wshape, dtype, pet):
    assert jax.default_backend() == "cpu"  # the custom-VJP path
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(xshape), dtype)
    w = jnp.asarray(rng.standard_normal(wshape), dtype)
    cot = jnp.asarray(rng.standard_normal(jnp.einsum(eqn, x, w).shape), jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(f(eqn, x, w, preferred_element_type=pet).astype(jnp.float32)
                                    * cot)
    y, y_ref = project(eqn, x, w, pet), jnp.einsum(eqn, x, w, preferred_element_type=pet)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), **tol)
    got = jax.jit(jax.grad(loss(project), argnums=(0, 1)))(x, w)
    ref = jax.jit(jax.grad(loss(jnp.einsum), argnums=(0, 1)))(x, w)
    for g, r, name in zip(got, ref, ("dx", "dw")):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), **tol,
                                   err_msg=name)
