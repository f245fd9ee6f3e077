"""Policy losses: the PAPER.md section 2 gradient table case by case, aggregation, micro-batch
exactness, extras, metrics and property-based numerical safety."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klear_jax import losses as L

EL, EH = 0.2, 0.28
KINDS = tuple(L.POLICY_LOSSES)
# ratios covering the five regions (A>0/A<0 x r above/below the trust region, inside), one
# between 1+eh and the dual-clip c, one above c.
RATIOS = np.array([2.0, 0.5, 1.1, 0.9, 1.0, 5.0, 1.5, 0.3])
DUAL_C = 3.0


def reduce_metric_sums(sums, axis_name):
    """Cross-device reduction of metric sums inside shard_map (psum, pmin, pmax by key)."""
    ops = {"ratio_min": jax.lax.pmin, "ratio_max": jax.lax.pmax}
    return {k: ops.get(k, jax.lax.psum)(v, axis_name) for k, v in sums.items()}


def table_F(kind, r, a, b1=1.0, b2=1.0, c=None):
    """Gradient factor F of PAPER.md section 2 (+ the kinds the table leaves out)."""
    if c is not None and a < 0 and r > c:
        return 0.0
    hi, lo = r > 1 + EH, r < 1 - EL
    if kind == "pg":
        return r
    if kind == "cispo":
        return 1 + EH if hi else 1 - EL if lo else r
    if kind in ("clip", "gspo"):
        return 0.0 if (a > 0 and hi) or (a < 0 and lo) else r
    if kind == "gppo":
        return b2 * (1 + EH) if a > 0 and hi else b1 * (1 - EL) if a < 0 and lo else r
    if kind == "gppo_high":
        return b2 * (1 + EH) if a > 0 and hi else 0.0 if a < 0 and lo else r
    raise AssertionError(kind)


def table_value(kind, r, a, logp, b1=1.0, b2=1.0, c=None):
    """Per-token loss value (to minimise) implied by the definitions."""
    hi, lo = r > 1 + EH, r < 1 - EL
    if kind == "cispo":
        return -np.clip(r, 1 - EL, 1 + EH) * a * logp
    if kind == "pg":
        v = -r * a
    elif kind in ("clip", "gspo"):
        v = -min(r * a, np.clip(r, 1 - EL, 1 + EH) * a)
    elif kind == "gppo":
        v = -a * (b2 * (1 + EH) if a > 0 and hi else b1 * (1 - EL) if a < 0 and lo else r)
    else:  # gppo_high
        v = -a * (b2 * (1 + EH) if a > 0 and hi else (1 - EL) if a < 0 and lo else r)
    if c is not None and a < 0:
        v = min(v, -c * a)
    return v


def _batch_for(kind):
    """logp/old_logp/mask with the test ratios; for gspo one sequence per ratio whose tokens'
    log-ratios average to log r. A trailing masked column holds NaN / -inf garbage."""
    n = len(RATIOS)
    if kind == "gspo":
        jitter = np.array([-0.05, 0.0, 0.05])
        lr = np.log(RATIOS)[:, None] + jitter[None, :]
    else:
        lr = np.log(RATIOS)[None, :]
    old = -1.5 + 0.1 * np.arange(lr.size).reshape(lr.shape)
    logp = old + lr
    pad = lambda x, v: np.concatenate([x, np.full((x.shape[0], 1), v)], axis=1)
    mask = pad(np.ones(lr.shape), 0.0)
    return (jnp.asarray(pad(logp, np.nan), jnp.float32), jnp.asarray(pad(old, -np.inf), jnp.float32),
            jnp.asarray(mask, jnp.float32), n)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("a", [1.5, -0.7])
@pytest.mark.parametrize("dual_clip", [None, DUAL_C])
@pytest.mark.parametrize("betas", [(1.0, 1.0), (0.25, 0.5), (0.5, 1.7)])
def test_gradient_table(kind, a, dual_clip, betas):
    b1, b2 = betas
    logp, old, mask, n = _batch_for(kind)
    adv = jnp.full((logp.shape[0],), a)
    kw = dict(kind=kind, eps_low=EL, eps_high=EH, beta1=b1, beta2=b2, dual_clip=dual_clip)
    loss_fn = lambda lp: L.policy_loss(lp, old, adv, mask, **kw)[0]
    loss, grad = jax.value_and_grad(loss_fn)(logp)
    grad = np.asarray(grad)
    denom = float(mask.sum())
    valid = np.asarray(mask) > 0
    assert np.all(grad[~valid] == 0.0), "masked tokens must get exactly zero gradient"
    lp_np = np.asarray(logp)
    want_grad, want_vals = np.zeros_like(grad), []
    for (i, j) in zip(*np.nonzero(valid)):
        r = RATIOS[i] if kind == "gspo" else RATIOS[j]
        tok_r = np.exp(lp_np[i, j] - np.asarray(old)[i, j])
        want_grad[i, j] = -a * table_F(kind, r, a, b1, b2, dual_clip) / denom
        want_vals.append(table_value(kind, r if kind != "cispo" else tok_r, a, lp_np[i, j], b1, b2,
                                     dual_clip if kind != "cispo" else None))
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(float(loss), sum(want_vals) / denom, rtol=2e-5, atol=1e-6)


def _eq11_literal(logp, old, adv, mask):
    """Eq. 11 written literally with raw exp, sg(r) bounds, clip and min (token-mean)."""
    r = jnp.exp(logp - old)
    lo = (1 - EL) / jax.lax.stop_gradient(r) * r
    hi = (1 + EH) / jax.lax.stop_gradient(r) * r
    obj = jnp.minimum(r * adv[:, None], jnp.clip(r, lo, hi) * adv[:, None])
    return -jnp.sum(obj * mask) / jnp.sum(mask)


def _random_batch(seed, b=6, t=7, scale=0.6):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 0.5, (b, t))
    lr = rng.uniform(-scale, scale, (b, t))
    # keep away from the region boundaries where min/clip gradients are ambiguous
    for edge in (np.log(1 - EL), np.log(1 + EH)):
        lr = np.where(np.abs(lr - edge) < 1e-3, lr + 3e-3, lr)
    mask = (rng.uniform(size=(b, t)) < 0.8).astype(np.float32)
    mask[1] = 0.0  # an empty sequence
    adv = rng.normal(size=(b,))
    f = lambda x: jnp.asarray(x, jnp.float32)
    return f(old + lr), f(old), f(adv), f(mask)


def test_gppo_is_eq11_and_matches_clip_forward():
    logp, old, adv, mask = _random_batch(0)
    gppo = lambda lp: L.policy_loss(lp, old, adv, mask, kind="gppo", eps_low=EL, eps_high=EH)[0]
    clip = lambda lp: L.policy_loss(lp, old, adv, mask, kind="clip", eps_low=EL, eps_high=EH)[0]
    lit = lambda lp: _eq11_literal(lp, old, adv, mask)
    vg, gg = jax.value_and_grad(gppo)(logp)
    vc, gc = jax.value_and_grad(clip)(logp)
    vl, gl = jax.value_and_grad(lit)(logp)
    np.testing.assert_allclose(vg, vc, rtol=1e-6)
    np.testing.assert_allclose(vg, vl, rtol=1e-6)
    np.testing.assert_allclose(gg, gl, rtol=1e-5, atol=1e-8)
    r = np.exp(np.asarray(logp - old))
    inside = (r >= 1 - EL) & (r <= 1 + EH) & (np.asarray(mask) > 0)
    np.testing.assert_allclose(np.asarray(gg)[inside], np.asarray(gc)[inside], rtol=1e-6)
    clipped = ((np.asarray(adv)[:, None] > 0) & (r > 1 + EH)) | ((np.asarray(adv)[:, None] < 0) & (r < 1 - EL))
    clipped &= np.asarray(mask) > 0
    assert clipped.any() and np.all(np.asarray(gc)[clipped] == 0) and np.all(np.asarray(gg)[clipped] != 0)


def test_dual_clip_caps_value_and_zeroes_gradient():
    logp = jnp.log(jnp.array([[4.0, 12.0, 1.0]]))
    old = jnp.zeros((1, 3))
    adv = jnp.array([-2.0])
    mask = jnp.ones((1, 3))
    for kind in ("clip", "gppo"):
        f = lambda lp: L.policy_loss(lp, old, adv, mask, kind=kind, dual_clip=10.0)[0]
        v, g = jax.value_and_grad(f)(logp)
        # tokens: -rA = 8 (kept), 24 -> capped at -cA = 20, 2
        np.testing.assert_allclose(v, (8 + 20 + 2) / 3, rtol=1e-6)
        np.testing.assert_allclose(g, [[2 * 4 / 3, 0.0, 2 * 1 / 3]], rtol=1e-6)
    _, _, sums = L.policy_loss_terms(logp, old, adv, mask, kind="gppo", dual_clip=10.0)
    assert float(sums["dual_clipfrac"]) == 1.0


def test_gspo_sequence_ratio_and_default_eps():
    # tokens of one sequence with different ratios share F = s = geometric mean ratio
    lr = jnp.array([[0.3, -0.1, 0.1, 5.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    old = jnp.zeros((1, 4))
    s = float(np.exp(0.1))
    f = lambda lp: L.policy_loss(lp, old, jnp.array([-1.0]), mask, kind="gspo", eps_low=0.2, eps_high=0.2)[0]
    v, g = jax.value_and_grad(f)(lr)
    np.testing.assert_allclose(v, s, rtol=1e-6)
    np.testing.assert_allclose(g, [[s / 3, s / 3, s / 3, 0.0]], rtol=1e-6)
    # with the GSPO paper's default bounds (3e-4, 4e-4) s = e^0.1 is clipped for A > 0
    g_def = jax.grad(lambda lp: L.policy_loss(lp, old, jnp.array([1.0]), mask, kind="gspo")[0])(lr)
    assert np.all(np.asarray(g_def) == 0.0)
    assert L.DEFAULT_EPS["gspo"] == (3e-4, 4e-4)


AGGS = L.AGG_MODES


def _agg_weights(mask, agg, norm_length):
    m = np.asarray(mask) > 0
    n = m.sum(-1, keepdims=True)
    seqs = (n > 0).sum()
    if agg == "token-mean":
        return m / m.sum()
    if agg == "seq-mean-token-mean":
        return m / np.maximum(n, 1) / seqs
    if agg == "seq-mean-token-sum":
        return m / seqs
    return m / (norm_length * seqs)


@pytest.mark.parametrize("agg", AGGS)
def test_agg_gradient_weights(agg):
    # pg on-policy: F = 1, so d loss / d logp = -A * weight of the token under agg
    _, _, adv, mask = _random_batch(1)
    logp = jnp.full(mask.shape, -1.0)
    f = lambda lp: L.policy_loss(lp, lp * 0 - 1.0, adv, mask, kind="pg", agg=agg, norm_length=16)[0]
    g = jax.grad(f)(logp)
    want = -np.asarray(adv)[:, None] * _agg_weights(mask, agg, 16)
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(f(logp), np.sum(-np.asarray(adv)[:, None] * _agg_weights(mask, agg, 16)),
                               rtol=1e-5, atol=1e-7)


def _split_vs_whole(logp, old, adv, mask, kind, agg, splits):
    kw = dict(kind=kind, agg=agg, norm_length=10.0, dual_clip=3.0, beta1=0.5)

    def whole(lp):
        s, d, sums = L.policy_loss_terms(lp, old, adv, mask, **kw)
        return L.finalize(s, d), sums

    (lw, sw), gw = jax.value_and_grad(whole, has_aux=True)(logp)
    bounds = np.cumsum((0,) + splits)
    sl = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    # eager on purpose: 24 kind x agg compilations cost far more than running tiny ops
    denom = sum(L.agg_denominator(mask[s], agg, 10.0) for s in sl)  # known before the pass

    def micro(lp, s):
        ls, _, sums = L.policy_loss_terms(lp, old[s], adv[s], mask[s], **kw)
        return ls / denom, sums

    loss, grads, sums = 0.0, [], None
    for s in sl:
        (l, sm), g = jax.value_and_grad(micro, has_aux=True)(logp[s], s)
        loss, sums = loss + l, sm if sums is None else L.combine_metric_sums(sums, sm)
        grads.append(g)
    return lw, gw, sw, loss, jnp.concatenate(grads), sums


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_split_is_exact(kind, agg):
    logp, old, adv, mask = _random_batch(2, b=6, t=5, scale=1.5)
    # the empty row 1 sits in the first micro-batch
    lw, gw, sw, lm, gm, sm = _split_vs_whole(logp, old, adv, mask, kind, agg, (3, 3))
    np.testing.assert_allclose(lm, lw, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gm, gw, rtol=1e-5, atol=1e-8)
    for k in sw:
        np.testing.assert_allclose(sm[k], sw[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_scan_accumulation_pattern():
    """The trainer's pattern: lax.scan over micro-batches from empty_metric_sums."""
    logp, old, adv, mask = _random_batch(4, b=6, t=5)
    k = 3
    mb = lambda x: x.reshape((k, -1) + x.shape[1:])

    def step(carry, xs):
        s, d, sums = L.policy_loss_terms(*xs, kind="gppo")
        return (carry[0] + s, carry[1] + d, L.combine_metric_sums(carry[2], sums)), None

    _, _, like = L.policy_loss_terms(logp[:2], old[:2], adv[:2], mask[:2])
    init = (0.0, 0.0, L.empty_metric_sums(like))
    (s, d, sums), _ = jax.lax.scan(step, init, (mb(logp), mb(old), mb(adv), mb(mask)))
    loss, metrics = L.policy_loss(logp, old, adv, mask, kind="gppo")
    np.testing.assert_allclose(L.finalize(s, d), loss, rtol=1e-6)
    for name, v in L.finalize_metrics(sums, d).items():
        np.testing.assert_allclose(v, metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_metrics_known_values():
    logp = jnp.log(jnp.array([[2.0, 0.5, 1.0], [0.5, 2.0, 9.0]]))
    old = jnp.zeros((2, 3))
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = jnp.array([1.0, -1.0])
    _, m = L.policy_loss(logp, old, adv, mask, kind="clip")
    r = np.array([2.0, 0.5, 1.0, 0.5, 2.0])
    assert float(m["tokens"]) == 5
    np.testing.assert_allclose(m["clipfrac_high"], 1 / 5)  # A>0, r=2
    np.testing.assert_allclose(m["clipfrac_low"], 1 / 5)   # A<0, r=0.5
    np.testing.assert_allclose(m["ratio_mean"], r.mean(), rtol=1e-6)
    np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_max"], 2.0, rtol=1e-6)  # the masked 9.0 is ignored
    np.testing.assert_allclose(m["approx_kl"], np.mean(r - 1 - np.log(r)), rtol=1e-5)
    np.testing.assert_allclose(m["pg_loss"], (-1.28 - 0.5 - 1 + 0.8 + 2) / 5, rtol=1e-5)


def test_sft_losses_and_positive_term():
    logp = jnp.array([[-1.0, -3.0, -7.0], [-2.0, -4.0, -6.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    np.testing.assert_allclose(L.finalize(*L.sft_loss_terms(logp, mask)), 16 / 5)
    np.testing.assert_allclose(L.finalize(*L.sft_loss_terms(logp, mask, "seq-mean-token-mean")), (2 + 4) / 2)
    np.testing.assert_allclose(L.finalize(*L.sft_loss_terms(logp, mask, "seq-mean-token-sum")), (4 + 12) / 2)
    np.testing.assert_allclose(L.finalize(*L.sft_loss_terms(logp, mask, "seq-mean-token-sum-norm", 4)), 16 / 8)
    s, d = L.positive_sft_terms(logp, mask, jnp.array([False, True]))
    assert (float(s), float(d)) == (12.0, 3.0)
    adv, old = jnp.array([0.0, 0.0]), logp
    loss_fn = lambda lp: L.policy_loss(lp, old, adv, mask, sft_alpha=0.1, positive=jnp.array([False, True]))
    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    np.testing.assert_allclose(loss, 0.1 * 4.0, rtol=1e-6)
    np.testing.assert_allclose(m["sft_positive_nll"], 4.0, rtol=1e-6)
    np.testing.assert_allclose(g, [[0, 0, 0], [-0.1 / 3] * 3], rtol=1e-6, atol=1e-9)
    # no positive response at all: zero term, zero (finite) gradient
    g0 = jax.grad(lambda lp: L.policy_loss(lp, old, adv, mask, sft_alpha=0.1, positive=jnp.zeros(2, bool))[0])(logp)
    assert np.all(np.asarray(g0) == 0.0)


def test_bad_inputs_raise():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="gppo_high"):
        L.policy_loss(x, x, jnp.zeros(2), x, kind="ppo")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        L.policy_loss(x, x, jnp.zeros(2), x, agg="sum")
    with pytest.raises(ValueError, match="norm_length"):
        L.policy_loss(x, x, jnp.zeros(2), x, agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="advantages"):
        L.policy_loss(x, x, jnp.zeros(3), x)
    with pytest.raises(ValueError, match="old_logp"):
        L.policy_loss(x, jnp.zeros((2, 4)), jnp.zeros(2), x)
    with pytest.raises(ValueError, match="dual_clip"):
        L.policy_loss(x, x, jnp.zeros(2), x, dual_clip=0.5)
    with pytest.raises(ValueError, match="unknown options"):
        L.policy_loss(x, x, jnp.zeros(2), x, kl_cof=0.1)
    with pytest.raises(ValueError, match="positive"):
        L.positive_sft_terms(x, x, jnp.zeros(3))


# ----------------------------------------------------------------------------- properties
@jax.jit
def _all_kinds(logp, old, adv, mask):
    """Every kind x agg in one compiled function (one compilation per shape)."""
    out = {}
    for kind in KINDS:
        for agg in AGGS:
            f = lambda lp: L.policy_loss(lp, old, adv, mask, kind=kind, agg=agg, norm_length=7.0,
                                         dual_clip=10.0, beta1=0.25)
            (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(logp)
            out[kind, agg] = (loss, g, metrics)
    return out


_SHAPES = [(1, 1), (3, 5)]
_extreme = st.one_of(st.floats(-1e4, 1e4, width=32), st.sampled_from([0.0, 30.0, -30.0, 1e30, -1e30]))


@st.composite
def _batches(draw):
    b, t = draw(st.sampled_from(_SHAPES))
    n = b * t
    old = np.array(draw(st.lists(st.floats(-50, 0, width=32), min_size=n, max_size=n)), np.float32)
    lr = np.array(draw(st.lists(_extreme, min_size=n, max_size=n)), np.float32)
    mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.float32)
    adv = np.array(draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=b, max_size=b)), np.float32)
    logp = (old + lr).reshape(b, t)
    logp = np.where(mask.reshape(b, t) > 0, logp, np.nan)  # garbage where masked
    return logp, old.reshape(b, t), adv, mask.reshape(b, t)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_property_finite_and_masked_zero(batch):
    logp, old, adv, mask = batch
    out = _all_kinds(*(jnp.asarray(x) for x in batch))
    for kind, (loss, g, metrics) in out.items():
        assert np.isfinite(float(loss)), kind
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), kind
        assert np.all(g[mask == 0] == 0.0), kind
        assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values()), kind
        if mask.sum() == 0:
            assert float(loss) == 0.0


def test_cross_device_sums_match_whole_batch():
    """Each of 8 devices holds one row; psum of (sum, denom) and reduced metric sums equal the
    single-device result for the whole batch."""
    from jax.sharding import Mesh, PartitionSpec as P

    logp, old, adv, mask = _random_batch(5, b=8, t=4, scale=1.0)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def per_device(lp, o, a, m):
        s, d, sums = L.policy_loss_terms(lp, o, a, m, kind="gppo", agg="seq-mean-token-mean", dual_clip=3.0)
        s, d = jax.lax.psum(s, "data"), jax.lax.psum(d, "data")
        return L.finalize(s, d), L.finalize_metrics(reduce_metric_sums(sums, "data"), d)

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P("data")),
                               out_specs=P()))
    loss_d, metrics_d = fn(logp, old, adv, mask)
    loss, metrics = L.policy_loss(logp, old, adv, mask, kind="gppo", agg="seq-mean-token-mean", dual_clip=3.0)
    np.testing.assert_allclose(loss_d, loss, rtol=1e-5)
    for k, v in metrics.items():
        np.testing.assert_allclose(metrics_d[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
