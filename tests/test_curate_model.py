"""Pass rates from k samples of a reference model (pass_rate.source 'model'): a tiny random
Qwen3 saved with checkpoint.save_params, sampled with klear_jax.sampler, scored with the
project's math reward."""
import json
import os

import pytest

from data_fixtures import tok, tok_dir, write_jsonl  # noqa: F401  (fixtures)
from klear_jax import curate as C
from klear_jax.config import ConfigError
from klear_jax.curate.pipeline import model_samples
from klear_jax.rewards import MathRewardConfig
from klear_jax.rewards.scorers import Scorers

K = 3
MATH = [{"problem": f"What is {a} + {b}? the cat sat", "answer": str(a + b)}
        for a, b in [(2, 3), (7, 1), (12, 30), (4, 4), (9, 9)]] + [
    {"problem": "the cat sat on the mat " * 20, "answer": "1"}]  # longer than max_prompt_len


@pytest.fixture(scope="module")
def ref_ckpt(tmp_path_factory, tok_dir):
    from klear_jax import checkpoint as ckpt
    from klear_jax.data.tokenizer import load_tokenizer
    from klear_jax.models import ModelConfig, create_model
    n = len(load_tokenizer(tok_dir))
    cfg = ModelConfig(vocab_size=-(-n // 64) * 64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      rope_theta=10000.0, max_position_embeddings=256)
    d = tmp_path_factory.mktemp("ref") / "orbax"
    ckpt.save_params(str(d), create_model(cfg, seed=0))
    return str(d)


def cfg(tmp_path, ref_ckpt, tok_dir, out="out", seed=0, **model):
    c = C.curate_base()
    c.kind = "rl_math"
    c.dedup.response = False
    c.sources.m = C.source([write_jsonl(tmp_path / "rl.jsonl", MATH)], "math")
    c.pass_rate.source = "model"
    c.pass_rate.model.update(dict(checkpoint=ref_ckpt, tokenizer=tok_dir, num_samples=K,
                                  temperature=1.0, top_p=0.95, max_new_tokens=16,
                                  batch_prompts=2, seed=seed, max_prompt_len=64,
                                  keep_samples=True), **model)
    c.label.update(math_workers=1)
    c.output.update(dir=str(tmp_path / out), name="ref", tfds=False, drop_fields=(),
                    prompt_template="Solve: {problem}")
    return c


def read(rep):
    with open(rep["curated_jsonl"]) as f:
        return [json.loads(x) for x in f]


def test_model_pass_rate_k_samples_deterministic(tmp_path, ref_ckpt, tok_dir, tok):
    rep = C.run(cfg(tmp_path, ref_ckpt, tok_dir))
    st = {s["step"]: s for s in rep["steps"]}["pass_rate"]
    assert st["dropped"] == {"prompt_too_long": 1} and st["kept"] == 5
    assert st["info"]["samples_scored"] == 5 * K   # exactly k scored samples per rated problem
    out = read(rep)
    assert [r["answer"] for r in out] == ["5", "8", "42", "8", "18"]
    for r in out:
        assert 0.0 <= r["pass_rate"] <= 1.0 and r["pass_samples"] == K
        assert len(r["samples"]) == K and all(isinstance(s, str) for s in r["samples"])
    # the pass rate is the fraction of the k samples the math reward calls correct
    scorers = Scorers(MathRewardConfig(num_workers=1))
    try:
        for r in out:
            ok = scorers.submit("math", r["samples"], [r["answer"]] * K)().correct
            assert r["pass_rate"] == sum(ok) / K
    finally:
        scorers.close()
    # the prompts are the RL data path's (prepare.rl_example with output.prompt_template):
    # the first batch re-sampled directly with the sampler and the same seed gives the same text
    ms = model_samples(cfg(tmp_path, ref_ckpt, tok_dir))
    from klear_jax.data.prepare import rl_example
    from klear_jax.data.records import rl_fields
    ids = [rl_example(tok, rl_fields(d, "rl_math"), None, "Solve: {problem}")[0]["prompt_ids"]
           for d in MATH[:2]]
    ids = [[int(t) for t in i] for i in ids]
    assert [ms.prompt_ids(d, "math") for d in MATH[:2]] == ids
    assert ms.sample(ids) == [r["samples"] for r in out[:2]]
    ms.seed, ms.calls = 1, 0   # another seed samples differently (same compiled shape)
    assert ms.sample(ids) != [r["samples"] for r in out[:2]]
    # determinism for a fixed seed: a second run writes the same records
    assert read(C.run(cfg(tmp_path, ref_ckpt, tok_dir, out="out2"))) == out


def test_model_source_config_errors(tmp_path, ref_ckpt, tok_dir):
    c = cfg(tmp_path, ref_ckpt, tok_dir, checkpoint="")
    with pytest.raises(ConfigError, match=r"pass_rate\.model\.checkpoint"):
        C.validate_curate_config(c)
    c = cfg(tmp_path, ref_ckpt, tok_dir, checkpoint=os.path.join(str(tmp_path), "missing"))
    with pytest.raises(ConfigError, match=r"pass_rate\.model\.checkpoint.*does not exist"):
        C.validate_curate_config(c)
    with pytest.raises(ConfigError, match=r"pass_rate\.model\.num_samples"):
        C.validate_curate_config(cfg(tmp_path, ref_ckpt, tok_dir, num_samples=0))
    with pytest.raises(ConfigError, match=r"pass_rate\.model\.top_p"):
        C.validate_curate_config(cfg(tmp_path, ref_ckpt, tok_dir, top_p=0.0))
    with pytest.raises(ConfigError, match=r"pass_rate\.model\.mesh\.fsdp"):
        C.validate_curate_config(cfg(tmp_path, ref_ckpt, tok_dir, mesh=dict(data=1, fsdp=0, tensor=1)))
