"""The jitted train step: micro-batch invariance, non-finite skipping, packing, optimizer."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from klear_jax import backend, losses, optim, sharding as shd, train_step as ts
from klear_jax.trainer import SkipGuard
from klear_jax.models import ModelConfig, create_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, logprob_chunk_size=16)
OPTIM = dict(lr=1e-3, end_lr=1e-4, schedule="cosine", warmup_steps=2, decay_steps=0, b1=0.9,
             b2=0.999, eps=1e-8, weight_decay=0.1, clip_norm=1.0, mu_dtype="")


def weighted_sft_loss(model, mb):
    """SFT NLL with a per-row weight w [B] (w = nan poisons the loss to test skipping)."""
    logp, _ = model.token_logprobs(mb["input_ids"], mb["targets"], mb["positions"],
                                   mb["segment_ids"])
    m = mb["loss_mask"] > 0
    nll = jnp.where(m, -logp, 0.0) * mb["w"][:, None]
    return jnp.sum(nll), jnp.sum(m, dtype=jnp.float32), {"nll_sq": jnp.sum(nll * nll)}


def make_batch(B=32, T=16, seed=0):
    r = np.random.default_rng(seed)
    seg = np.where(np.arange(T)[None] < r.integers(T // 2, T + 1, (B, 1)), 1, 0).astype(np.int32)
    return dict(input_ids=r.integers(0, 64, (B, T)).astype(np.int32),
                targets=r.integers(0, 64, (B, T)).astype(np.int32),
                loss_mask=(seg * (r.random((B, T)) > 0.3)).astype(np.float32),
                segment_ids=seg, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
                w=np.ones((B,), np.float32))


_MODELS = {}
_STEPS = {}
SGD = optax.sgd(0.5)
ADAM, ADAM_SCHEDULE = optim.make_optimizer(OPTIM, total_steps=10)


def setup(mesh, M, optimizer, loss_fn=weighted_sft_loss, **kw):
    """(fresh state, step fn); the model and the compiled steps are shared across tests
    (states are not donated, so one compiled step serves several states)."""
    if id(mesh) not in _MODELS:
        _MODELS[id(mesh)] = create_model(CFG, seed=0, mesh=mesh)
    graphdef, state, sh = ts.init_train_state(_MODELS[id(mesh)], optimizer, mesh)
    key = (id(mesh), M, id(optimizer), loss_fn, tuple(sorted(kw)))
    if key not in _STEPS:
        _STEPS[key] = ts.make_train_step(graphdef, optimizer, loss_fn, mesh, M, sh,
                                         schedule=ADAM_SCHEDULE if optimizer is ADAM else None,
                                         donate=False, **kw)
    return state, _STEPS[key]


@pytest.fixture(scope="module")
def mesh8():
    return shd.make_mesh(fsdp=4, data=2)


@pytest.mark.parametrize("variants", [
    ("m4",), pytest.param(("m4", "d1"), marks=pytest.mark.slow)])
def test_microbatch_and_device_invariance(mesh8, variants):
    """1 vs 4 micro-batches on 8 devices (slow: and 2 micro-batches on 1 device): the same
    update, to float32 rounding."""
    opt = SGD
    batch = make_batch()
    mesh1 = shd.make_mesh(fsdp=1, devices=jax.devices()[:1])
    out = {}
    runs = {"m1": (mesh8, 1), "m4": (mesh8, 4), "d1": (mesh1, 2)}
    for name in ("m1",) + variants:
        mesh, M = runs[name]
        state, step = setup(mesh, M, opt)
        p0 = jax.device_get(state.params)
        state, m = step(state, batch)
        out[name] = (jax.device_get(state.params), jax.device_get(m))
    ref_p, ref_m = out["m1"]
    moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), ref_p, p0)))
    assert moved > 1e-4  # the step really changed the params
    for name in variants:
        p, m = out[name]
        for k in ("loss", "grad_norm", "tokens", "nll_sq"):
            np.testing.assert_allclose(m[k], ref_m[k], rtol=2e-6, err_msg=f"{name} {k}")
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-7), p, ref_p)


def test_global_denominator_not_per_microbatch(mesh8):
    """Micro-batches with very different token counts: the loss is the global token mean."""
    batch = make_batch()
    batch["loss_mask"][::4] = 0.0  # micro-batch 0 (rows 0, 4, ...) has no loss tokens
    state, step = setup(mesh8, 4, SGD)
    model = create_model(CFG, seed=0)
    logp, _ = model.token_logprobs(batch["input_ids"], batch["targets"], batch["positions"],
                                   batch["segment_ids"])
    want = losses.finalize(*losses.sft_loss_terms(logp, batch["loss_mask"]))
    _, m = step(state, batch)
    np.testing.assert_allclose(m["loss"], want, rtol=1e-5)
    assert m["tokens"] == batch["loss_mask"].sum()


def test_nonfinite_skips_update_and_guard_stops(mesh8):
    state, step = setup(mesh8, 2, ADAM)
    good = make_batch()
    state, m = step(state, good)
    assert m["skipped"] == 0
    before = jax.device_get((state.params, state.opt_state))
    bad = make_batch(seed=1)
    bad["w"][3] = np.nan
    state, m = step(state, bad)
    assert m["skipped"] == 1 and m["skipped_total"] == 1 and int(state.step) == 2
    after = jax.device_get((state.params, state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    bad["w"][3] = np.inf
    state, m = step(state, bad)
    assert m["skipped"] == 1 and m["skipped_total"] == 2
    state, m = step(state, good)  # recovers
    assert m["skipped"] == 0 and np.isfinite(m["loss"])

    guard = SkipGuard(max_consecutive=3)
    assert guard.update(1, 1) and guard.update(2, 1)
    assert not guard.update(3, 0)
    guard.update(4, 1), guard.update(5, 1)
    with pytest.raises(RuntimeError, match="3 consecutive steps.*max_consecutive_skips = 3"):
        guard.update(6, 1)


@pytest.mark.parametrize("splits", [(4,), pytest.param((1, 4), marks=pytest.mark.slow)])
def test_multi_term_denominators(mesh8, splits):
    """denom_fn path: w1 * mean over all tokens + w2 * mean over a subset equals the
    whole-batch value with 4 micro-batches (slow: and the update equals 1 micro-batch's)."""
    def loss_fn(model, mb):
        logp, _ = model.token_logprobs(mb["input_ids"], mb["targets"], mb["positions"],
                                       mb["segment_ids"])
        a = losses.sft_loss_terms(logp, mb["loss_mask"])
        b = losses.positive_sft_terms(logp, mb["loss_mask"], mb["w"] > 1)
        return {"a": a[0], "b": b[0]}, {"a": a[1], "b": b[1]}, {}

    def denom_fn(batch):
        m = batch["loss_mask"] > 0
        return {"a": jnp.sum(m, dtype=jnp.float32),
                "b": jnp.sum(m & (batch["w"][:, None] > 1), dtype=jnp.float32)}

    batch = make_batch()
    batch["w"][:5] = 2.0
    res = []
    for M in splits:
        state, step = setup(mesh8, M, SGD, loss_fn=loss_fn, denom_fn=denom_fn,
                            loss_weights={"a": 1.0, "b": 0.1})
        state, m = step(state, batch)
        res.append((jax.device_get(state.params), jax.device_get(m)))
    model = create_model(CFG, seed=0)
    logp, _ = model.token_logprobs(batch["input_ids"], batch["targets"], batch["positions"],
                                   batch["segment_ids"])
    want = (losses.finalize(*losses.sft_loss_terms(logp, batch["loss_mask"]))
            + 0.1 * losses.finalize(*losses.positive_sft_terms(logp, batch["loss_mask"],
                                                               batch["w"] > 1)))
    for _, m in res:
        np.testing.assert_allclose(m["loss"], want, rtol=1e-5)
    if len(res) == 2:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-7), res[0][0],
                     res[1][0])


def test_packed_loss_equals_unpacked():
    """A row packing two sequences (segment ids, restarted positions) gives the same SFT
    loss sum and denominator as the two sequences in separate padded rows."""
    model = create_model(CFG, seed=1)
    r = np.random.default_rng(0)
    la, lb, T = 7, 5, 16
    a, b = r.integers(1, 64, la + 1), r.integers(1, 64, lb + 1)
    ma, mb = (r.random(la) > 0.3).astype(np.float32), (r.random(lb) > 0.3).astype(np.float32)

    def row(parts):
        ids, tg, seg, pos = (np.zeros(T, np.int32) for _ in range(4))
        mk = np.zeros(T, np.float32)
        o = 0
        for s, (x, m) in enumerate(parts, 1):
            n = len(x) - 1
            ids[o:o + n], tg[o:o + n], mk[o:o + n] = x[:-1], x[1:], m
            seg[o:o + n], pos[o:o + n] = s, np.arange(n)
            o += n
        return ids, tg, mk, seg, pos

    packed = [row([(a, ma), (b, mb)])]
    separate = [row([(a, ma)]), row([(b, mb)])]
    out = []
    for rows in (packed, separate):
        ids, tg, mk, seg, pos = (np.stack(x) for x in zip(*rows))
        logp, _ = model.token_logprobs(ids, tg, pos, seg)
        out.append(losses.sft_loss_terms(logp, mk))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5)
    assert float(out[0][1]) == float(out[1][1]) == ma.sum() + mb.sum()


def test_schedule_and_decay_mask():
    sch = optim.make_schedule(8e-5, "cosine", warmup_steps=10, decay_steps=110, end_lr=4e-5)
    np.testing.assert_allclose([sch(0), sch(5), sch(10), sch(60), sch(110), sch(500)],
                               [0, 4e-5, 8e-5, 6e-5, 4e-5, 4e-5], rtol=1e-5, atol=1e-12)
    const = optim.make_schedule(1e-6, "constant", warmup_steps=10)
    np.testing.assert_allclose([const(0), const(5), const(10), const(1000)],
                               [0, 5e-7, 1e-6, 1e-6], rtol=1e-6)
    with pytest.raises(ValueError, match="optim.schedule"):
        optim.make_schedule(1e-3, "linear")
    params = ts.split_model(create_model(CFG, seed=0))[1]
    mask = optim.decay_mask(params)
    assert mask["embed"]["embedding"] and mask["layers"]["mlp"]["up_proj"]["kernel"]
    assert not mask["final_norm"]["scale"] and not mask["layers"]["input_norm"]["scale"]
    assert not mask["layers"]["attn"]["q_norm"]["scale"]


def test_weight_decay_skips_norms():
    """With zero gradients, AdamW only decays the masked-in (matrix) params."""
    params = ts.split_model(create_model(CFG, seed=0))[1]
    opt, _ = optim.make_optimizer(dict(OPTIM, warmup_steps=0, schedule="constant"), 10)
    @jax.jit
    def one_update(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        upd, _ = opt.update(zeros, opt.init(params), params)
        return optax.apply_updates(params, upd)
    new = one_update(params)
    np.testing.assert_array_equal(new["final_norm"]["scale"], params["final_norm"]["scale"])
    np.testing.assert_allclose(new["embed"]["embedding"],
                               params["embed"]["embedding"] * (1 - 1e-3 * 0.1), rtol=1e-6)


def test_train_step_learns(mesh8):
    """A few steps on one fixed batch lower the loss (the whole pipeline optimises)."""
    state, step = setup(mesh8, 2, ADAM)
    batch = make_batch()
    first, lrs = None, []
    for _ in range(10):
        state, m = step(state, batch)
        first = first if first is not None else float(m["loss"])
        lrs.append(float(m["lr"]))
    assert float(m["loss"]) < first - 0.1
    # warmup 0 -> 1e-3 over 2 steps, then cosine towards the 1e-4 floor
    np.testing.assert_allclose(lrs[:3], [0.0, 5e-4, 1e-3], rtol=1e-5)
    assert 1e-4 < lrs[-1] < lrs[3] < 1e-3


def test_cpu_train_step_leaves_dots_to_eigen(mesh8):
    """On a CPU mesh the train step compiles with CPU_TRAINING_COMPILER_OPTIONS: plain XLA
    dots, none handed to YNNPACK (the default, which the sampler keeps); reductions go to
    YNNPACK, with their elementwise producers fused in."""
    import re
    from klear_jax.aot import parse_topology, topology_devices
    assert backend.compiler_options(mesh8) == backend.CPU_TRAINING_COMPILER_OPTIONS
    tpu_mesh = shd.make_mesh(fsdp=8, devices=topology_devices(parse_topology("v5p:2x2x2")))
    assert backend.compiler_options(tpu_mesh) is None
    state, step = setup(mesh8, 1, SGD)
    hlo = step.lower(state, make_batch()).compile().as_text()
    ynn_bodies = re.findall(r"kind=kCustom, calls=%([\w.\-]+)[^\n]*__ynn_fusion", hlo)
    assert " dot(" in hlo and ynn_bodies
    for name in ynn_bodies:  # each YNN fusion is a reduction, none holds a dot
        body = hlo[hlo.index(f"%{name} "):]
        body = body[:body.index("\n}")]
        assert " reduce(" in body and " dot(" not in body, body
    plain = jax.jit(lambda a, b: a @ b).lower(jnp.ones((64, 64)), jnp.ones((64, 64)))
    assert "__ynn_fusion" in plain.compile().as_text()  # what the option turns off
