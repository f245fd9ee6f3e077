"""Curation with the project's rewards: math-verify labels, sandboxed code labels, pass rates
from precomputed samples, and difficulty-aware retention of incorrect traces."""
import json

import pytest

from klear_jax import curate as C
from klear_jax.curate import label as L
from klear_jax.rewards import CodeRewardConfig, MathRewardConfig, SandboxConfig
from klear_jax.rewards.scorers import Scorers
from klear_jax.data.records import RawRecord
from tests.data_fixtures import write_jsonl


def think(ans):
    return f"<think>working it out</think> The answer is $\\boxed{{{ans}}}$."


def code_resp(src):
    return f"<think>plan</think>\n```python\n{src}\n```\n"


DOUBLE = {"inputs": ["1\n", "5\n"], "outputs": ["2\n", "10\n"]}
GOOD, BAD = "print(2 * int(input()))", "print(3 * int(input()))"


def cfg(tmp_path, kind="sft", **blocks):
    c = C.curate_base()
    c.kind = kind
    c.output.update(dir=str(tmp_path / "out"), name="lab", tfds=False)
    c.label.update(batch_size=4, math_workers=1, code_timeout_s=5.0, code_slots=2)
    for block, values in blocks.items():
        c[block].update(values)
    return c


def read(rep):
    with open(rep["curated_jsonl"]) as f:
        return [json.loads(x) for x in f]


def test_sft_labels_and_difficulty_retention(tmp_path):
    math_recs = [
        {"prompt": "m1 easy, right", "response": think(4), "answer": "4", "difficulty": 0.1},
        {"prompt": "m2 easy, wrong", "response": think(5), "answer": "4", "difficulty": 0.1},
        {"prompt": "m3 hard, wrong", "response": think("1/2"), "answer": "0.25", "difficulty": 0.9},
        {"prompt": "m4 hard, right", "response": think("\\frac{1}{4}"), "answer": "0.25", "difficulty": 0.9},
        {"prompt": "m5 no answer", "response": think(1), "difficulty": 0.9},
        {"prompt": "m6 no think", "response": "\\boxed{4}", "answer": "4", "difficulty": 0.1},
    ]
    code_recs = [
        {"prompt": "c1 right", "response": code_resp(GOOD), "tests": DOUBLE, "difficulty": 0.2},
        {"prompt": "c2 wrong easy", "response": code_resp(BAD), "tests": DOUBLE, "difficulty": 0.2},
        {"prompt": "c3 wrong hard", "response": code_resp("print(0)"), "tests": json.dumps(DOUBLE), "difficulty": 0.8},
    ]
    chat = [{"messages": [{"role": "user", "content": "chat without checker"},
                          {"role": "assistant", "content": "free text"}]}]
    c = cfg(tmp_path, label=dict(enabled=True), difficulty=dict(source="field", hard_min=0.5))
    c.sources.m = C.source([write_jsonl(tmp_path / "m.jsonl", math_recs)], "math", quality=1.0)
    c.sources.k = C.source([write_jsonl(tmp_path / "k.jsonl", code_recs)], "code", quality=0.5)
    c.sources.o = C.source([write_jsonl(tmp_path / "o.jsonl", chat)], "chat")
    rep = C.run(c)
    st = {s["step"]: s for s in rep["steps"]}
    assert st["label"]["dropped"] == {"no_answer": 1}
    assert st["label"]["info"] == {"correct": 3, "incorrect": 5, "unlabelled": 1}
    assert st["retain"]["dropped"] == {"incorrect_easy": 3}   # m2, m6, c2
    out = {r["prompt"] if "prompt" in r else "chat": r for r in read(rep)}
    assert sorted(out) == ["c1 right", "c3 wrong hard", "chat", "m1 easy, right", "m3 hard, wrong",
                           "m4 hard, right"]
    assert out["m4 hard, right"]["correct"] is True and out["m3 hard, wrong"]["correct"] is False
    assert out["c1 right"]["label_reward"] == 1.0 and out["c3 wrong hard"]["label_reward"] == 0.0
    assert out["chat"]["correct"] is None


def test_rl_math_pass_rate_from_samples_and_band(tmp_path):
    def prob(i, n_right, n_wrong, answer="7"):
        return {"problem": f"problem {i}", "answer": answer,
                "samples": [think(answer)] * n_right + [think(8)] * n_wrong}
    recs = [prob(0, 4, 0), prob(1, 1, 3), prob(2, 0, 4), prob(3, 2, 2), {"problem": "p4", "answer": "1"}]
    c = cfg(tmp_path, kind="rl_math", pass_rate=dict(source="samples", batch_size=3),
            rl_filter=dict(min_pass_rate=0.1, max_pass_rate=0.9))
    c.sources.m = C.source([write_jsonl(tmp_path / "rl.jsonl", recs)], "math")
    rep = C.run(c)
    st = {s["step"]: s for s in rep["steps"]}
    assert st["pass_rate"]["dropped"] == {"no_samples": 1}
    assert st["pass_band"]["dropped"] == {"too_easy": 1, "too_hard": 1}
    out = read(rep)
    assert [(r["problem"], r["pass_rate"], r["pass_samples"]) for r in out] == [
        ("problem 1", 0.25, 4), ("problem 3", 0.5, 4)]
    assert all("samples" not in r for r in out)  # output.drop_fields


def test_code_pass_rate_from_samples():
    scorers = Scorers(MathRewardConfig(num_workers=1), CodeRewardConfig(
        mode="soft", sandbox=SandboxConfig(timeout_s=5.0, max_tests=16, num_slots=2)))
    try:
        step = L.pass_rate_step(scorers, "samples", "pass_rate", "samples", batch_size=8)
        recs = [RawRecord("f", 1, {"domain": "code", "tests": DOUBLE,
                                   "samples": [code_resp(GOOD), code_resp(BAD), "no code"]}),
                RawRecord("f", 2, {"domain": "code", "samples": [code_resp(GOOD)]})]
        out = list(step(recs))
    finally:
        scorers.close()
    assert [r.line for r in out] == [1] and out[0].data["pass_rate"] == pytest.approx(1 / 3)
    assert step.counter.dropped == {"no_tests": 1}


def test_sft_retention_by_pass_rate_field_keeps_unrated_correct(tmp_path):
    recs = [
        {"prompt": "hard wrong", "response": think(5), "answer": "4", "pass_rate": 0.1},
        {"prompt": "easy wrong", "response": think(6), "answer": "4", "pass_rate": 0.9},
        {"prompt": "right, unrated", "response": think(4), "answer": "4"},
        {"prompt": "wrong, unrated", "response": think(7), "answer": "4"},
    ]
    c = cfg(tmp_path, label=dict(enabled=True), pass_rate=dict(source="field"),
            difficulty=dict(source="pass_rate", hard_max_pass_rate=0.25))
    c.sources.m = C.source([write_jsonl(tmp_path / "m.jsonl", recs)], "math")
    rep = C.run(c)
    st = {s["step"]: s for s in rep["steps"]}
    assert st["pass_rate"]["kept"] == 4 and st["pass_rate"]["info"] == {"unrated:no_pass_rate": 2}
    assert st["retain"]["dropped"] == {"incorrect_easy": 1, "incorrect_unknown_difficulty": 1}
    assert [r["prompt"] for r in read(rep)] == ["hard wrong", "right, unrated"]
