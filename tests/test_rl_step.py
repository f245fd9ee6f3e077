"""klear_jax.rl.step: the one RL-update wiring, and the same warm-up / decay scaling for the
RL loop, ahead-of-time compilation and the benchmarks."""
import jax
import numpy as np
import pytest

from klear_jax import config as C
from klear_jax import optim, sharding as shd
from klear_jax.rl import step as rl_step
from sample_helpers import sequences


def _cfg(**over):
    c = C.load_config("configs/gppo_tiny.py")
    return C.apply_overrides(c, [f"{k}={v}" for k, v in over.items()])


def test_schedules_count_rl_steps():
    """warmup_steps / decay_steps count RL steps; the optimizer counts updates (K per step)."""
    c = _cfg(**{"optim.warmup_steps": 3, "optim.schedule": '"cosine"', "optim.decay_steps": 5,
                "optim.lr": 1e-3, "optim.end_lr": 1e-4, "train.num_minibatches": 2})
    _, schedule = rl_step.rl_optimizer(c)
    K = 2
    np.testing.assert_allclose(float(schedule(3 * K - 1)), 1e-3 * (3 * K - 1) / (3 * K), rtol=1e-5)
    np.testing.assert_allclose(float(schedule(3 * K)), 1e-3, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(5 * K)), 1e-4, rtol=1e-5)


def _record_optimizer_configs(monkeypatch):
    seen = []
    make = optim.make_optimizer

    def spy(ocfg, total_steps):
        seen.append((dict(ocfg), total_steps))
        return make(ocfg, total_steps)
    monkeypatch.setattr(optim, "make_optimizer", spy)
    return seen


def test_aot_and_bench_build_the_loop_s_optimizer(monkeypatch):
    """AOT and the bench build their RL step's optimizer through rl_optimizer, so warm-up
    and decay are scaled by K there exactly as in the RL loop."""
    from klear_jax.aot import build_jobs
    from klear_jax.bench import workloads
    c = _cfg(**{"optim.warmup_steps": 3, "optim.decay_steps": 7, "train.num_minibatches": 2})
    seen = _record_optimizer_configs(monkeypatch)
    want = rl_step.rl_optimizer(c)
    mesh = shd.make_mesh(fsdp=-1, devices=jax.devices()[:1])
    build_jobs(c, mesh, ("rl_step",))
    assert seen[0] == seen[1] and seen[0][0]["warmup_steps"] == 6 and seen[0][0]["decay_steps"] == 14
    assert seen[0][1] == c.train.total_steps * 2
    del want
    seen.clear()
    rc = workloads.rl_config()
    rl_step.rl_optimizer(rc)
    workloads.build_train(workloads.model_config(quick=True), 2, 8, model_old_logp=False)
    assert len(seen) == 2 and seen[0] == seen[1]


@pytest.mark.parametrize("seq_len", [None, 24])
def test_batch_shapes(seq_len):
    c = _cfg()
    shapes = rl_step.batch_shapes(c, seq_len)
    R = c.train.batch_prompts // c.train.num_minibatches * c.rollout.group_size
    T = seq_len or c.rollout.max_prompt_len + c.rollout.max_new_tokens
    assert shapes["input_ids"][0] == (R, T) and shapes["advantages"][0] == (R,)
    assert rl_step.minibatch_rows(c) == R


def test_rollout_weights_bf16_copy_and_logprob_gap():
    """rollout.weights_dtype "auto" under bf16 compute: the sampler gets a bf16 copy sharded
    like the f32 masters; the log-probs it reports for its own tokens stay within 0.01 nats
    (mean 0.002; measured 5.7e-4 / 1.9e-4) of the trainer's (f32 masters, bf16 compute) on the same tokens."""
    from flax import nnx
    from klear_jax import train_step as ts
    from klear_jax.models import ModelConfig, create_model
    from klear_jax.sampler import Sampler, SamplingParams
    mcfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                       dtype="bfloat16", param_dtype="float32", logprob_chunk_size=16)
    mesh = shd.make_mesh(fsdp=-1, devices=jax.devices()[:4])
    model = create_model(mcfg, seed=3, mesh=mesh)
    optimizer, _ = rl_step.rl_optimizer(_cfg())
    graphdef, state, shardings = ts.init_train_state(model, optimizer, mesh)
    assert rl_step.build_rollout_cast(_cfg(**{"rollout.weights_dtype": '"float32"'}), mcfg,
                                      shardings) is None
    cast = rl_step.build_rollout_cast(_cfg(), mcfg, shardings)
    weights = cast(state.params)
    for w, p in zip(jax.tree.leaves(weights), jax.tree.leaves(state.params)):
        assert w.dtype == jax.numpy.bfloat16 and w.sharding == p.sharding
    prompts = np.random.default_rng(0).integers(1, 128, (4, 8)).tolist()
    out = Sampler(graphdef, mesh=mesh, pad_id=0, max_prompt_len=8).generate(
        nnx.State(weights), prompts, SamplingParams(temperature=1.0, max_new_tokens=16), 0)
    seq = {k: jax.numpy.asarray(v) for k, v in sequences(out).items()}
    targets = jax.numpy.roll(seq["input_ids"], -1, axis=1)
    with shd.use_mesh(mesh):
        logp, _ = nnx.merge(graphdef, nnx.State(state.params)).token_logprobs(
            seq["input_ids"], targets, None, seq["segment_ids"])
    mask = np.asarray(seq["response_mask"])[:, 1:] > 0
    trainer = np.asarray(logp)[:, :-1][mask]
    sampler = np.asarray(seq["old_logprobs"])[:, 1:][mask]
    gap = np.abs(trainer - sampler)
    assert gap.max() < 0.01 and gap.mean() < 0.002, (gap.max(), gap.mean())
