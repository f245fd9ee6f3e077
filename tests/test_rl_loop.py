"""End to end on CPU: a tiny random Qwen3, a tokenizer trained here, arithmetic prompts
through the real data path (prepare -> TFDS -> rl_prompt_batches), math-verify rewards:
sample -> score -> advantages -> old log-probs -> updates -> metrics -> checkpoint -> resume."""
import json
import math
import random

import jax
import numpy as np
import pytest

from klear_jax import config as cu
from klear_jax.data import tokenizer as tk

REQUIRED = ["reward/mean", "reward/std", "reward/math_mean", "reward/math_std", "accuracy",
            "accuracy/math", "response/length_mean", "response/length_max",
            "response/truncation_rate", "groups/signal_frac", "groups/kept_frac",
            "train/clipfrac_low", "train/clipfrac_high", "train/ratio_mean", "train/ratio_min",
            "train/ratio_max", "train/approx_kl", "train/grad_norm", "train/lr", "train/loss",
            "train/sft_nll", "entropy", "logprob_mismatch/abs_mean", "perf/sample_tokens_per_s",
            "perf/train_tokens_per_s", "time/sample_s", "time/train_s", "time/score_s"]


@pytest.fixture
def compile_cache(tmp_path):
    """The resumed run recompiles the same functions in the same process: a persistent
    compilation cache turns that into a disk read."""
    old = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    yield
    for k, v in old.items():
        jax.config.update(k, v)


@pytest.fixture(scope="module")
def rl_setup(tmp_path_factory):
    from klear_jax.data.prepare import prepare
    root = tmp_path_factory.mktemp("rl")
    rng = random.Random(0)
    problems = []
    for _ in range(24):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        problems.append({"problem": f"What is {a} + {b}?", "answer": str(a + b), "source": "add"})
    texts = [f"<think>{p['problem']} {p['answer']}</think> \\boxed{{{p['answer']}}}"
             for p in problems] * 5
    tok_dir = str(root / "tok")
    tk.train_tokenizer(texts, vocab_size=300, out_dir=tok_dir)
    src = root / "math.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in problems))
    prepare([str(src)], str(root / "tfds"), "tiny_rl_math", "rl_math", tok_dir)
    return root, tok_dir


def _config(root, tok_dir, workdir, steps):
    c = cu.load_config("configs/gppo_tiny.py")
    n_vocab = len(tk.load_tokenizer(tok_dir))
    return cu.apply_overrides(c, [
        f"workdir={workdir}", f"data.dir={root / 'tfds'}", "data.name=tiny_rl_math",
        f"data.tokenizer={tok_dir}", f"model.vocab_size={-(-n_vocab // 64) * 64}",
        f"train.total_steps={steps}", "rollout.max_new_tokens=24", "train.length_bucket=0",
        "rollout.decode_slots=32"])


def test_rl_end_to_end_and_resume(rl_setup, tmp_path, compile_cache):
    from klear_jax import checkpoint as ckpt
    from klear_jax import rl
    from klear_jax.metrics import read_jsonl
    from klear_jax.models import ModelConfig, create_model
    import tensorflow_datasets as tfds
    from klear_jax.data.pipeline import rl_prompt_batches

    root, tok_dir = rl_setup
    work = tmp_path / "run"
    cfg = _config(root, tok_dir, work, steps=2)
    out = rl.run(cfg)
    assert out["step"] == 2 and out["stopped"] == "done"
    rows = read_jsonl(str(work / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    trained = [r for r in rows if r.get("train/num_updates", 0) > 0]
    assert trained, f"no step kept a group with a learning signal: {rows}"
    for r in trained:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert all(math.isfinite(r[k]) for k in REQUIRED), r
        assert r["groups/kept"] <= cfg.train.batch_prompts
        # sampler and trainer compute the same log-probs for the same params
        assert r["logprob_mismatch/abs_mean"] < 1e-3, r["logprob_mismatch/abs_mean"]
        # first update of a step is on-policy: ratios start at 1
        assert r["train/ratio_min"] > 0.5 and r["train/ratio_max"] < 2.0
    assert out["updates"] == sum(int(r["train/num_updates"]) for r in rows)
    # params moved away from the initialisation (weight decay is 0 in the tiny config)
    m = cu.model_kwargs(cfg.model)
    init = jax.tree.leaves(jax.device_get(
        __import__("flax").nnx.state(create_model(ModelConfig(**m), seed=cfg.seed)).to_pure_dict()))
    now = jax.tree.leaves(jax.device_get(out["params"]))
    assert any(not np.allclose(a, b) for a, b in zip(init, now))

    # ---- resume: one more step continues the step count, update count and the data order
    cfg3 = _config(root, tok_dir, work, steps=3)
    out3 = rl.run(cfg3)
    assert out3["step"] == 3 and out3["updates"] >= out["updates"]
    rows = read_jsonl(str(work / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    mngr = ckpt.TrainCheckpointer(str(work), async_save=False)
    assert mngr.latest_step() == 3
    r = mngr.mngr.restore(3, args=__import__("orbax.checkpoint").checkpoint.args.Composite(
        data_iter=__import__("orbax.checkpoint").checkpoint.args.JsonRestore()))
    mngr.close()
    saved = r["data_iter"]
    assert saved["rl_step"] == 3 and saved["updates"] == out3["updates"]
    src = tfds.data_source("tiny_rl_math", data_dir=str(root / "tfds"))["train"]
    ref = rl_prompt_batches(src, cfg.rollout.prompts_per_step, seed=cfg.seed,
                            max_prompt_length=cfg.rollout.max_prompt_len)
    for _ in range(3):
        next(ref)
    assert saved["iterator"] == ref.get_state()


def test_rl_official_semantics_step(rl_setup, tmp_path):
    """``:semantics=official`` through the real loop: verl micro-batch scales ride in every
    mini-batch (each update's two denominators are its 16 rows) and only whole mini-batches
    of groups are kept. (The untrained model never answers right, so the group filter is
    set back to reward spread here: the official one, tested in test_reproduce, would keep
    nothing.)"""
    from klear_jax import rl
    from klear_jax.metrics import read_jsonl
    root, tok_dir = rl_setup
    c = cu.load_config("configs/gppo_tiny.py:semantics=official")
    n_vocab = len(tk.load_tokenizer(tok_dir))
    cfg = cu.apply_overrides(c, [
        f"workdir={tmp_path / 'run'}", f"data.dir={root / 'tfds'}", "data.name=tiny_rl_math",
        f"data.tokenizer={tok_dir}", f"model.vocab_size={-(-n_vocab // 64) * 64}",
        "train.total_steps=3", "rollout.max_new_tokens=24", "train.length_bucket=0",
        "rollout.decode_slots=32", "loss.filter_by=reward"])
    assert rl.run(cfg)["step"] == 3
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    per_mb = cfg.train.batch_prompts // cfg.train.num_minibatches
    for r in rows:
        assert r["groups/kept"] % per_mb == 0
        assert r.get("train/num_updates", 0) == r["groups/kept"] // per_mb
    trained = [r for r in rows if r.get("train/num_updates", 0) > 0]
    assert trained, [r["groups/signal_frac"] for r in rows]
    for r in trained:
        assert r["train/tokens"] == 2 * 16 * r["train/num_updates"]
        assert math.isfinite(r["train/loss"]) and r["train/skipped"] == 0
