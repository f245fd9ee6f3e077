"""Evaluation: pass@k estimator, correctness definitions, JSONL validation, and end to end on
a tiny random Qwen3 saved as an Orbax params checkpoint and as a HF directory."""
import json
import math
import os
import shutil

import numpy as np
import pytest

from data_fixtures import tok, tok_dir, write_jsonl  # noqa: F401  (fixtures)
from klear_jax import config as cu
from klear_jax import eval as ev
from klear_jax import policy
from klear_jax.eval import config as ec
from klear_jax.eval import metrics as em
from klear_jax.rewards.scorers import Scorers
from klear_jax.data.records import RecordError

MATH = [{"problem": "What is 2 + 3?", "answer": "5"},
        {"problem": "What is 7 + 1?", "answer": 8, "id": "seven"},
        {"problem": "the cat sat on 12 mats", "answer": "12"}]
CODE = [{"problem": "print the sum of two numbers",
         "tests": {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}},
        {"problem": "def add(a, b)", "input_output": json.dumps(
            {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [3, 10]})}]


# ------------------------------------------------------------------------------ pure metrics
def test_pass_at_k_hand_computed():
    assert em.pass_at_k(5, 0, 1) == 0.0
    assert em.pass_at_k(5, 5, 3) == 1.0
    assert em.pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert em.pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)          # 1 - C(2,2)/C(4,2)
    assert em.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)      # 1 - C(7,5)/C(10,5)
    assert em.pass_at_k(4, 3, 2) == 1.0                                # n - c < k
    for n, c, k in [(64, 7, 1), (64, 7, 8), (64, 30, 64), (8, 1, 4)]:
        assert em.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError):
        em.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        em.pass_at_k(4, 1, 5)
    assert em.pass_ks(1) == [1] and em.pass_ks(4) == [1, 2, 4] and em.pass_ks(6) == [1, 2, 4, 6]


def test_summarize_hand_computed():
    correct = np.array([[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]], bool)
    soft = np.array([[1, .5, 0, 0], [1, 1, .5, 1], [0, 0, .25, 0]], np.float32)
    z = np.zeros(correct.shape)
    m = em.summarize(correct, soft, z, z + 3, z.astype(bool))
    assert m["accuracy"] == m["avg@k"] == pytest.approx(4 / 12)
    assert m["pass_rate"] == pytest.approx(soft.mean())
    assert m["pass@k"]["1"] == pytest.approx(4 / 12)
    # per problem pass@2: 1 - C(3,2)/C(4,2) = 0.5, 1 (n - c = 1 < 2), 0
    assert m["pass@k"]["2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["pass@k"]["4"] == pytest.approx(2 / 3)
    assert m["per_problem_accuracy"] == [0.25, 0.75, 0.0]
    assert m["num_samples"] == 12 and m["k"] == 4 and m["response_length_mean"] == 3
    with pytest.raises(ValueError, match="all arrays"):
        em.summarize(correct, soft[:, :2], z, z, z)
    assert "avg@k" in em.format_table({"b": {"s": {**m, "kind": "code"}}})


# ------------------------------------------------------------------------------ scoring
def test_correct_means_full_reward():
    from klear_jax.rewards import CodeRewardConfig, SandboxConfig
    eval_code = cu.code_reward_config(cu.load_config("configs/eval_tiny.py"))
    assert eval_code.mode == "soft"  # eval always scores code softly
    sc = Scorers(None, CodeRewardConfig(mode="soft",
                                        sandbox=SandboxConfig(timeout_s=5, num_slots=2)))
    try:
        s = sc.submit("math", ["<think>x</think> \\boxed{5}", "<think>x</think> 6",
                               "\\boxed{5}"], ["5"] * 3)()
        r, ok, soft = s.rewards, s.correct, s.pass_rate
        assert ok.tolist() == [True, False, False] and soft.tolist() == [1, 0, 0]
        assert r.tolist() == [1.0, -1.0, -2.0]  # format penalty: no <think>
        tests = {"inputs": ["1\n", "2\n"], "outputs": ["2\n", "5\n"]}
        prog = "<think>x</think>\n```python\n{}\n```"
        s = sc.submit("code", [prog.format("print(2 * int(input()))"),
                               prog.format("print(0)"), "<think>x</think> no code"], [tests] * 3)()
        r, ok, soft = s.rewards, s.correct, s.pass_rate
        assert soft.tolist() == [0.5, 0.0, 0.0] and not ok.any() and r[2] == -1.0
        s = sc.submit("code", ["<think>x</think>\n```python\nn = int(input())\n"
                               "print(2 * n + (n == 2))\n```"], [tests])()
        r, ok, soft = s.rewards, s.correct, s.pass_rate
        assert ok.tolist() == [True] and soft.tolist() == [1.0]
    finally:
        sc.close()


# ------------------------------------------------------------------------------ problems
def test_load_problems_prompts_and_errors(tmp_path, tok):
    from klear_jax.data import records as R
    from klear_jax.data.prepare import rl_example
    path = write_jsonl(tmp_path / "m.jsonl", MATH)
    b = ev.Benchmark("m", path, "math", 2, prompt_template="Solve: {problem}")
    probs = ev.load_problems(b, tok, 256)
    assert [p.id for p in probs] == ["1", "seven", "3"] and probs[1].answer == "8"
    want, _ = rl_example(tok, R.rl_fields(MATH[0], "rl_math"), None, "Solve: {problem}")
    assert probs[0].prompt_ids == want["prompt_ids"].tolist()  # the RL data path's prompt
    code = ev.load_problems(ev.Benchmark("c", write_jsonl(tmp_path / "c.jsonl", CODE), "code"),
                            tok, 256)
    assert code[1].tests["fn_name"] == "add"  # input_output as a JSON string
    bad = write_jsonl(tmp_path / "bad.jsonl", [MATH[0], MATH[1], '{"problem": "x", "answer"'])
    with pytest.raises(RecordError, match=r"bad.jsonl:3: invalid JSON"):
        ev.load_problems(ev.Benchmark("m", bad, "math"), tok, 256)
    bad = write_jsonl(tmp_path / "bad2.jsonl", [MATH[0], {"problem": "no answer"}])
    with pytest.raises(RecordError, match=r"bad2.jsonl:2: missing field 'answer'"):
        ev.load_problems(ev.Benchmark("m", bad, "math"), tok, 256)
    bad = write_jsonl(tmp_path / "bad3.jsonl", [CODE[0], {"problem": "p", "tests": "{nope"}])
    with pytest.raises(RecordError, match=r"bad3.jsonl:2: field 'tests' is not valid JSON"):
        ev.load_problems(ev.Benchmark("c", bad, "code"), tok, 256)
    with pytest.raises(RecordError, match=r"m.jsonl:1: prompt has \d+ tokens, more than"):
        ev.load_problems(b, tok, 4)
    with pytest.raises(ValueError, match="kind must be one of"):
        ev.Benchmark("x", path, "essay")
    with pytest.raises(ValueError, match="top_p"):
        ev.Setting("s", top_p=0.0)


def test_config_validation_names_the_key():
    c = cu.load_config("configs/eval_tiny.py")
    with pytest.raises(cu.ConfigError, match="'checkpoint'"):
        ec.validate_eval_config(c, 8)
    c = cu.apply_overrides(c, ["checkpoint=/x"])
    with pytest.raises(cu.ConfigError, match="no benchmark has a path"):
        ec.validate_eval_config(c, 8)
    c = cu.apply_overrides(c, ["benchmarks.math.path=m.jsonl", "settings.t0_6.top_p=1.5"])
    with pytest.raises(cu.ConfigError, match="settings.t0_6.top_p"):
        ec.validate_eval_config(c, 8)
    c = cu.apply_overrides(c, ["settings.t0_6.top_p=0.9", 'settings.t0_6.stop_strings=[""]'])
    with pytest.raises(cu.ConfigError, match="settings.t0_6.stop_strings"):
        ec.validate_eval_config(c, 8)
    c = cu.apply_overrides(c, ['settings.t0_6.stop_strings=["</answer>"]'])
    ec.validate_eval_config(c, 8)
    s = ev.Setting(**[x for x in ec.settings_from_config(c) if x["name"] == "t0_6"][0])
    assert s.sampling_params(2).stop_strings == ("</answer>",)
    p = cu.load_config("configs/eval_qwen3_8b.py")
    p = cu.apply_overrides(p, ["checkpoint=/x", "benchmarks.aime24.path=a.jsonl"])
    ec.validate_eval_config(p, 64)
    s = ev.Setting(**ec.settings_from_config(p)[0])
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_new_tokens) == (
        0.6, 0.95, 20, 1.05, 65536)
    assert {b["name"]: b["num_samples"] for b in ec.benchmarks_from_config(p)} == {"aime24": 64}
    assert p.benchmarks.lcb_v5.num_samples == 8 and p.benchmarks.lcb_v6.kind == "code"
    assert ec.model_overrides(p)["rope_scaling"] == {
        "factor": 2.5, "original_max_position_embeddings": 32768}


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def saved(tmp_path_factory, tok_dir):
    """A tiny random Qwen3 (sharpened unembedding, so greedy argmax margins clear float
    rounding across meshes) as an Orbax params checkpoint and a HF dir with the tokenizer."""
    from klear_jax import checkpoint as ckpt
    from klear_jax.data.tokenizer import load_tokenizer
    from klear_jax.models import ModelConfig, create_model, to_hf
    root = tmp_path_factory.mktemp("eval")
    n = len(load_tokenizer(tok_dir))
    cfg = ModelConfig(vocab_size=-(-n // 64) * 64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      rope_theta=10000.0, max_position_embeddings=256)
    model = create_model(cfg, seed=0)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 20.0
    ckpt.save_params(str(root / "orbax"), model)
    to_hf(model, str(root / "hf"))
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), root / "hf")
    write_jsonl(root / "math.jsonl", MATH)
    write_jsonl(root / "code.jsonl", CODE)
    return root


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def orbax_eval(saved, tok_dir, tmp_path_factory):
    """One evaluate() over both benchmarks and two settings; prompts go 2 per sampler call
    (the 3-problem file's last call is padded), so each setting compiles one shape."""
    from klear_jax.rewards import MathRewardConfig
    out = tmp_path_factory.mktemp("orbax_eval")
    benches = [ev.Benchmark("math", str(saved / "math.jsonl"), "math", num_samples=3),
               {"name": "code", "path": str(saved / "code.jsonl"), "kind": "code",
                "num_samples": 3}]
    settings = [ev.Setting("greedy", temperature=0.0, max_new_tokens=12, num_samples=2),
                {"name": "t1_0", "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12}]
    res = ev.evaluate(str(saved / "orbax"), tok_dir, benches, settings, out_dir=str(out),
                      batch_prompts=2, math_reward=MathRewardConfig(num_workers=1), log=None)
    return res, out


def test_evaluate_orbax(orbax_eval):
    from klear_jax.rewards import math_reward
    res, out = orbax_eval
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["results"] == json.loads(json.dumps(res["results"]))
    assert set(res) >= {"checkpoint", "model", "settings", "benchmarks", "results", "wall_time_s"}
    assert res["settings"]["greedy"]["greedy"] and not res["settings"]["t1_0"]["greedy"]
    assert res["benchmarks"]["math"]["num_problems"] == 3
    for bench, P in (("math", 3), ("code", 2)):
        for setting, k in (("greedy", 2), ("t1_0", 3)):
            m = res["results"][bench][setting]
            assert m["kind"] == bench and m["k"] == k and m["num_problems"] == P
            assert set(m["pass@k"]) == {str(x) for x in em.pass_ks(k)}
            for key in ("accuracy", "avg@k", "pass_rate", *m["pass@k"].values()):
                v = m[key] if isinstance(key, str) else key
                assert 0.0 <= v <= 1.0
            rows = _rows(out / "samples" / f"{bench}__{setting}.jsonl")
            assert len(rows) == P * k
            assert sorted((r["problem_id"], r["sample"]) for r in rows) == sorted(
                (pid, j) for pid in ({"math": ["1", "seven", "3"], "code": ["1", "2"]}[bench])
                for j in range(k))
            # the summary is a function of the per-sample rows
            corr = np.array([[r["correct"] for r in rows if r["problem_id"] == pid]
                             for pid in dict.fromkeys(r["problem_id"] for r in rows)])
            assert m["accuracy"] == pytest.approx(corr.mean())
            assert m["pass_rate"] == pytest.approx(np.mean([r["pass_rate"] for r in rows]))
            assert all(0 < r["length"] <= 12 for r in rows)
            if setting == "greedy":
                by = {}
                for r in rows:
                    by.setdefault(r["problem_id"], set()).add(r["response"])
                assert all(len(v) == 1 for v in by.values())
    math_rows = _rows(out / "samples" / "math__t1_0.jsonl")
    assert len({r["response"] for r in math_rows}) > 3  # sampled responses differ
    answers = {"1": "5", "seven": "8", "3": "12"}
    for r in math_rows[:3]:  # the reward is the RL math reward of the response text
        assert r["reward"] == math_reward(r["response"], answers[r["problem_id"]])


def test_cli_hf_dir_on_a_mesh_matches_orbax_greedy(saved, orbax_eval, tmp_path):
    """The CLI path: HF dir (tokenizer found in it), the default 8-device mesh; its greedy
    responses equal those from the Orbax checkpoint on one device."""
    c = cu.load_config("configs/eval_tiny.py:max_new=12")
    c = cu.apply_overrides(c, [f"checkpoint={saved / 'hf'}", f"out_dir={tmp_path / 'hf'}",
                               f"benchmarks.math.path={saved / 'math.jsonl'}",
                               "settings.greedy.num_samples=2", "reward.math.num_workers=1"])
    with c.unlocked():
        del c.settings["t1_0"], c.settings["t0_6"]
    res = ev.run(c)
    assert set(res["results"]) == {"math"} and set(res["settings"]) == {"greedy"}
    assert res["model"]["model_type"] == "qwen3" and res["results"]["math"]["greedy"]["k"] == 2
    hf_rows = _rows(tmp_path / "hf" / "samples" / "math__greedy.jsonl")
    ref_rows = _rows(orbax_eval[1] / "samples" / "math__greedy.jsonl")
    assert len(hf_rows) == len(ref_rows) == 6
    assert [r["response"] for r in hf_rows] == [r["response"] for r in ref_rows]


def test_yarn_override_at_load(saved):
    p = cu.apply_overrides(cu.load_config("configs/eval_tiny.py"), [
        "model.rope_scaling_factor=2.0", "model.original_max_position_embeddings=128"])
    m = policy.load_model(str(saved / "orbax"), None, -1, **ec.model_overrides(p))
    assert dict(m.config.rope_scaling) == {"factor": 2.0, "original_max_position_embeddings": 128}
    assert m.config.max_position_embeddings == 256
    h = policy.load_model(str(saved / "hf"), None, -1, **ec.model_overrides(p))
    assert h.config.rope_scaling == m.config.rope_scaling


def test_tokenizer_from_the_saved_run_config(tmp_path, tok_dir):
    """An SFT / RL checkpoint without `tokenizer` set: the run config saved beside the
    params names it (data.tokenizer)."""
    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(tmp_path / "checkpoints")
    mngr.save(3, args=ocp.args.Composite(config=ocp.args.JsonSave(
        {"data": {"tokenizer": tok_dir}})))
    mngr.wait_until_finished()
    mngr.close()
    t = policy.resolve_tokenizer(None, str(tmp_path))
    assert t.eos_token == "<|im_end|>"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer"):
        policy.resolve_tokenizer(None, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="'.*nothing_here' does not exist"):
        policy.resolve_tokenizer(None, str(tmp_path / "nothing_here"))
