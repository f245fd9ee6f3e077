"""Pure pieces of the RL step: batch layout, group selection, positives, overlong filter,
mini-batch split, RL loss normalisation, config validation."""
import numpy as np
import pytest

from klear_jax.rl import batch as rb


def test_build_rows_layout_exact():
    prompts = [np.array([5, 6, 7]), np.array([8])]
    resp = np.array([[10, 11, 2, 0], [12, 2, 0, 0]])
    out = rb.build_rows(prompts, resp, [3, 2], seq_len=8, pad_id=1)
    np.testing.assert_array_equal(out["input_ids"], [[5, 6, 7, 10, 11, 2, 1, 1],
                                                     [8, 12, 2, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(out["targets"], [[6, 7, 10, 11, 2, 0, 0, 0],
                                                   [12, 2, 0, 0, 0, 0, 0, 0]])
    # loss on targets that are response tokens: 10, 11, 2 / 12, 2
    np.testing.assert_array_equal(out["loss_mask"], [[0, 0, 1, 1, 1, 0, 0, 0],
                                                     [1, 1, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 1, 1, 1, 0, 0],
                                                       [1, 1, 1, 0, 0, 0, 0, 0]])
    assert out["loss_mask"].dtype == np.float32 and out["input_ids"].dtype == np.int32


def test_build_rows_rejects_too_long():
    with pytest.raises(ValueError, match="row 0 has 5 tokens > seq_len 4"):
        rb.build_rows([np.array([1, 2, 3])], np.array([[4, 5]]), [2], seq_len=4, pad_id=0)


def test_bucket_length():
    assert rb.bucket_length(5, 4, 32) == 8
    assert rb.bucket_length(8, 4, 32) == 8
    assert rb.bucket_length(5, 0, 32) == 32
    assert rb.bucket_length(19, 16, 20) == 20
    with pytest.raises(ValueError, match="more than the cap"):
        rb.bucket_length(21, 16, 20)


def test_select_groups_filters_and_caps():
    rewards = np.array([[1, 1, 1], [1, -1, 1], [-1, -1, -1], [0.5, 0, 1], [1, -1, -1]])
    kept, signal = rb.select_groups(rewards, batch_prompts=2)
    np.testing.assert_array_equal(signal, [False, True, False, True, True])
    np.testing.assert_array_equal(kept, [1, 3])  # capped at 2, sampling order
    kept, _ = rb.select_groups(rewards, batch_prompts=4)
    np.testing.assert_array_equal(kept, [1, 3, 4])  # too few: the batch shrinks
    kept, _ = rb.select_groups(rewards, batch_prompts=4, filter_zero_adv=False)
    np.testing.assert_array_equal(kept, [0, 1, 2, 3])
    kept, _ = rb.select_groups(np.ones((3, 4)), batch_prompts=2)
    assert kept.shape == (0,)


def test_group_advantages():
    r = np.array([[1.0, -1.0, 1.0, -1.0], [0.0, 0.0, 0.0, 1.0]])
    a = rb.group_advantages(r)
    std = np.std([1, -1, 1, -1], ddof=1)
    np.testing.assert_allclose(a[0], np.array([1, -1, 1, -1]) / (std + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(rb.group_advantages(r, use_std=False)[1], [-.25, -.25, -.25, .75])
    np.testing.assert_allclose(rb.group_advantages(r, "rloo")[1], [-1 / 3, -1 / 3, -1 / 3, 1.0],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        rb.group_advantages(r, "ppo")


def _rollout():
    # P=2 prompts, G=2: responses 0,1 of prompt 0; 2,3 of prompt 1. Tn = 3.
    prompts = [np.array([3, 4]), np.array([5])]
    tokens = np.array([[10, 2, 0], [11, 12, 13], [14, 2, 0], [15, 2, 0]])
    lengths = np.array([2, 3, 2, 2])
    truncated = np.array([False, True, False, False])
    slogp = -np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    return prompts, tokens, lengths, truncated, slogp


def test_build_train_batch_kept_groups_and_overlong_filter():
    prompts, tokens, lengths, truncated, slogp = _rollout()
    adv = np.array([[0.5, -0.5], [1.0, -1.0]], np.float32)
    pos = np.array([[1, 0], [0, 1]], bool)
    b = rb.build_train_batch(prompts, tokens, lengths, truncated, slogp, adv, pos, kept=[0],
                             seq_len=6, pad_id=0, overlong_filter=True)
    np.testing.assert_array_equal(b["input_ids"], [[3, 4, 10, 2, 0, 0], [3, 4, 11, 12, 13, 0]])
    # row 1 was truncated: masked out entirely by the overlong filter
    np.testing.assert_array_equal(b["loss_mask"], [[0, 1, 1, 0, 0, 0], [0] * 6])
    np.testing.assert_array_equal(b["advantages"], [0.5, -0.5])
    np.testing.assert_array_equal(b["positive"], [1, 0])
    np.testing.assert_allclose(b["sampler_logp"][0], [0, 0, -0.1, 0, 0, 0])
    np.testing.assert_allclose(b["sampler_logp"][1], [0, -0.3, -0.4, -0.5, 0, 0])
    b2 = rb.build_train_batch(prompts, tokens, lengths, truncated, slogp, adv, pos, kept=[1, 0],
                              seq_len=6, pad_id=0, overlong_filter=False)
    np.testing.assert_array_equal(b2["input_ids"][:2], [[5, 14, 2, 0, 0, 0], [5, 15, 2, 0, 0, 0]])
    np.testing.assert_array_equal(b2["loss_mask"][3], [0, 1, 1, 1, 0, 0])  # kept without filter
    np.testing.assert_array_equal(b2["advantages"], [1.0, -1.0, 0.5, -0.5])


def test_split_minibatches_pads_last_with_empty_rows():
    prompts, tokens, lengths, truncated, slogp = _rollout()
    adv = np.ones((2, 2), np.float32)
    b = rb.build_train_batch(prompts, tokens, lengths, truncated, slogp, adv,
                             np.zeros((2, 2)), kept=[0, 1], seq_len=6, pad_id=7)
    mbs = rb.split_minibatches({k: v[:3] for k, v in b.items()}, 2, pad_id=7)
    assert len(mbs) == 2
    last = mbs[1]
    assert all(v.shape[0] == 2 for v in last.values())
    np.testing.assert_array_equal(last["input_ids"][1], [7] * 6)
    assert last["loss_mask"][1].sum() == 0 and last["segment_ids"][1].sum() == 0
    assert last["advantages"][1] == 0 and last["positive"][1] == 0
    assert rb.split_minibatches({k: v[:0] for k, v in b.items()}, 2, 7) == []


def test_rl_loss_global_normalisation_two_terms():
    """The RL loss equals pg_sum/D_pg + alpha * sft_sum/D_sft over the whole mini-batch even
    when make_train_step splits it into micro-batches; the old-logprob pass likewise."""
    import jax
    import jax.numpy as jnp
    import optax

    from klear_jax import losses, train_step as ts
    from klear_jax import sharding as shd
    from klear_jax.models import ModelConfig, create_model
    from klear_jax.rl import loss as rl_loss

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64,
                      dtype="float32", param_dtype="float32", logprob_chunk_size=8)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    R, T = 4, 8
    mb = rb.build_rows([np.array([1, 2])] * R, rng.integers(3, 30, (R, 5)), [5, 3, 1, 4], T, 0)
    mb["advantages"] = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    mb["positive"] = np.array([1, 0, 0, 1], np.float32)
    mb["old_logp"] = (mb["loss_mask"] * -3.3).astype(np.float32)
    alpha = 0.3
    rl = rl_loss.make_rl_loss(rl_loss.RLLossConfig(sft_alpha=alpha))
    model = create_model(cfg, seed=0)
    graphdef, params = ts.split_model(model)
    jmb = {k: jnp.asarray(v) for k, v in mb.items()}

    def reference(params):  # the whole mini-batch in one piece
        lp, _ = ts.merge_model(graphdef, params).token_logprobs(
            jmb["input_ids"], jmb["targets"], None, jmb["segment_ids"])
        pg = losses.policy_loss(lp, jmb["old_logp"], jmb["advantages"], jmb["loss_mask"],
                                kind="gppo", eps_low=0.2, eps_high=0.28, dual_clip=10.0)[0]
        sft = losses.finalize(*losses.positive_sft_terms(lp, jmb["loss_mask"], jmb["positive"]))
        return pg + alpha * sft, (sft, lp)
    (want_loss, (want_sft, logp)), grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)

    # two micro-batches: loss and gradient still equal the whole-batch ones (global denominators)
    opt = optax.sgd(1.0)
    _, state, sh = ts.init_train_state(model, opt, mesh)
    step = ts.make_train_step(graphdef, opt, rl.loss_fn, mesh, 2, sh, denom_fn=rl.denom_fn,
                              loss_weights=rl.loss_weights, finalize_metrics=rl.finalize_metrics,
                              donate=False)
    new_state, m = step(state, jmb)
    np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5)
    np.testing.assert_allclose(m["sft_nll"], want_sft, rtol=1e-5)
    assert float(m["sft_tokens"]) == mb["loss_mask"][[0, 3]].sum()
    assert float(m["tokens"]) == mb["loss_mask"].sum() + mb["loss_mask"][[0, 3]].sum()
    for g, p0, p1 in zip(jax.tree.leaves(grads), jax.tree.leaves(state.params),
                         jax.tree.leaves(new_state.params)):  # sgd(1): p1 = p0 - grad
        np.testing.assert_allclose(p0 - p1, g, rtol=1e-4, atol=1e-7)

    # the old-logprob pass: same values and stats whatever the micro-batch split
    mb["sampler_logp"] = (mb["loss_mask"] * -3.0).astype(np.float32)
    p_sh = ts.params_shardings(model, mesh)
    res = [rl_loss.make_logprob_fn(graphdef, mesh, p_sh, 1.0, M)(
        params, {k: jnp.asarray(v) for k, v in mb.items()}) for M in (1, 2)]
    np.testing.assert_allclose(res[0][0], np.where(mb["loss_mask"] > 0, logp, 0.0), atol=1e-6)
    np.testing.assert_allclose(res[1][0], res[0][0], atol=1e-6)
    m = mb["loss_mask"] > 0
    want_abs = np.abs(-3.0 - np.asarray(logp))[m]
    for r in res:
        assert float(r[1]["tokens"]) == m.sum()
        np.testing.assert_allclose(r[1]["mismatch_abs"], want_abs.sum(), rtol=1e-5)
        np.testing.assert_allclose(r[1]["max_mismatch_abs"], want_abs.max(), rtol=1e-5)


def test_rl_config_validation_names_keys(tmp_path):
    from klear_jax import config as cu
    from klear_jax.rl import config as rl_config

    c = cu.load_config("configs/gppo_tiny.py")
    c = cu.apply_overrides(c, [f"workdir={tmp_path}", "data.name=x", "data.tokenizer=t"])
    rl_config.validate_rl_config(c, 8)
    for override, key in [("train.batch_prompts=100", "train.batch_prompts"),
                          ("train.num_minibatches=3", "train.num_minibatches"),
                          ("rollout.group_size=1", "rollout.group_size"),
                          ("loss.kind=ppo2", "loss.kind"),
                          ("loss.dual_clip=0.5", "loss.dual_clip"),
                          ("rollout.decode_chunk=0", "rollout.decode_chunk"),
                          ("reward.code.mode=bogus", "reward.code"),
                          ("rollout.max_new_tokens=100000", "rollout.max_new_tokens")]:
        bad = cu.apply_overrides(cu.load_config("configs/gppo_tiny.py"),
                                 [f"workdir={tmp_path}", "data.name=x", "data.tokenizer=t",
                                  override])
        with pytest.raises(cu.ConfigError, match=key.replace(".", r"\.")):
            rl_config.validate_rl_config(bad, 8)


@pytest.mark.parametrize("name", ["gppo_math_qwen3_8b", "gppo_code_qwen3_8b"])
def test_paper_configs_validate(name, tmp_path):
    from klear_jax import config as cu
    from klear_jax.rl import config as rl_config

    c = cu.apply_overrides(cu.load_config(f"configs/{name}.py"),
                           [f"workdir={tmp_path}", "init.path=/ckpt", "data.name=x",
                            "data.tokenizer=t"])
    rl_config.validate_rl_config(c, 32)
    assert (c.rollout.group_size, c.train.batch_prompts, c.rollout.temperature) == (8, 128, 1.0)
    assert (c.loss.eps_low, c.loss.eps_high, c.loss.dual_clip, c.loss.sft_alpha) == (0.2, 0.28, 10.0, 0.1)
    mb = c.train.batch_prompts // c.train.num_minibatches
    assert (mb, c.optim.lr) == ((16, 1e-6) if "math" in name else (32, 5e-7))
