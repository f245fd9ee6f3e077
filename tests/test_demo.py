"""The CPU demo: task generators + teacher against the real rewards, held-out sets kept out of
training data, the sandbox requirement, and a miniature end-to-end run of the real CLI."""

import json
import os
import random
import subprocess
import sys

import pytest

from klear_jax import config as C
from klear_jax import demo
from klear_jax.demo import run as demo_run
from klear_jax.demo import tasks as dt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_teacher_labels_agree_with_the_real_rewards():
    from klear_jax.rewards import (CodeRewardConfig, MathRewardConfig, SandboxConfig,
                                   code_reward_batch, math_reward_batch)
    rng = random.Random(0)
    maths = [dt.math_problem(rng) for _ in range(12)]
    codes = [dt.code_problem(rng) for _ in range(8)]
    m = [dt.math_solution(p, rng, 0.5) for p in maths]
    c = [dt.code_solution(p, rng, 0.5) for p in codes]
    assert any(ok for _, ok in m) and not all(ok for _, ok in m)
    assert any(ok for _, ok in c) and not all(ok for _, ok in c)
    mr = math_reward_batch([t for t, _ in m], [p["answer"] for p in maths],
                           MathRewardConfig(num_workers=1))
    assert [r == 1.0 for r in mr] == [ok for _, ok in m]
    cr = code_reward_batch([t for t, _ in c], [p["tests"] for p in codes],
                           CodeRewardConfig(sandbox=SandboxConfig(timeout_s=5.0)))
    for (text, ok), r in zip(c, cr):
        assert (r == 1.0) == ok, (text, r)
        assert 0.0 <= r <= 1.0


def test_task_files_hold_out_eval_problems(tmp_path):
    info = dt.build_task_files(str(tmp_path), seed=3, n_sft=200, n_rl=60, n_eval=20,
                               math_error=0.3, code_error=0.3, max_operand=5)
    p = info["paths"]
    rows = {k: [json.loads(line) for line in open(v)] for k, v in p.items()}
    assert set(rows["heldout_math"][0]) == {"problem", "answer"}
    assert set(rows["heldout_code"][0]) == {"problem", "tests"}
    assert rows["heldout_code"][0]["tests"]["fn_name"] == "f"
    held = {r["problem"] for r in rows["heldout_math"]}
    train = {r["messages"][0]["content"] for r in rows["sft"]} | \
        {r["problem"] for r in rows["rl_math"]}
    assert held and not held & train
    # a held-out code function (its description) is never trained on
    fn = lambda text: text.split(" returns ")[1].split(". Example")[0]  # noqa: E731
    held_fns = {fn(r["problem"]) for r in rows["heldout_code"]}
    train_fns = {fn(r["problem"]) for r in rows["rl_code"]} | \
        {fn(r["messages"][0]["content"]) for r in rows["sft"] if "Write f" in
         r["messages"][0]["content"]}
    assert held_fns and not held_fns & train_fns
    import re
    nums = {int(n) for r in rows["heldout_math"] + rows["rl_math"] for n in
            re.findall(r"\d+", r["problem"])}
    assert nums and max(nums) <= 5 and min(nums) >= 1  # max_operand reaches the problems
    assert 0.5 < info["teacher_accuracy"]["math"] < 0.9
    assert len(rows["sft"]) == 200 and info["counts"]["heldout_code"] == 20


def test_missing_bwrap_fails_clearly(monkeypatch, tmp_path, capsys):
    from klear_jax.rewards import sandbox
    monkeypatch.setattr(sandbox.shutil, "which",
                        lambda name, *a, **k: None if "bwrap" in name else "/usr/bin/" + name)
    assert demo.main(["--workdir", str(tmp_path / "w"), "--size", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "bubblewrap" in err and "--allow_unsandboxed" in err
    assert demo_run.check_sandbox(allow_unsandboxed=True) == "unsandboxed"


@pytest.mark.parametrize("allow", [True, False])
def test_run_rl_passes_allow_unsandboxed_to_the_code_rewards(monkeypatch, allow):
    """--allow_unsandboxed must reach the RL code scorer, not just the eval: without it the
    code RL stage of a run on a machine without bwrap died with SandboxUnavailable."""
    seen = {}

    def fake_run(cfg):
        seen["sandbox"] = C.code_reward_config(cfg).sandbox
        return {"step": 0, "updates": 0, "stopped": "done"}
    monkeypatch.setattr(demo_run.rl, "run", fake_run)
    data = {"tfds": "/nonexistent/tfds", "tokenizer": "/nonexistent/tok"}
    demo_run.run_rl("/tmp/unused", "rl_code", "/nonexistent/sft", data, "code", "tiny", 0, 1,
                ("optim.lr=2e-4",), allow_unsandboxed=allow)
    assert seen["sandbox"].allow_unsandboxed is allow


def _has_bwrap() -> bool:
    import shutil
    return shutil.which("bwrap") is not None


def _run_demo(workdir, size, timeout):
    """The demo CLI; where bwrap is missing, with --allow_unsandboxed (that path must work too)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's first run
    extra = [] if _has_bwrap() else ["--allow_unsandboxed"]
    r = subprocess.run([sys.executable, "-m", "klear_jax.demo", "--workdir", str(workdir),
                        "--size", size, *extra], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def _check_outputs(w, s):
    for task in ("math", "code"):
        t = s[task]
        for key in ("sft_accuracy", "rl_accuracy"):
            assert 0.0 <= t[key] <= 1.0
        for tag in ("t1_0", "t0_6", "greedy"):
            for who in ("sft", "rl"):
                assert 0.0 <= t[f"{who}_{tag}"]["accuracy"] <= 1.0
                assert 0.0 <= t[f"{who}_{tag}"]["pass_rate"] <= 1.0
        assert t["rl_accuracy"] == t["rl_t1_0"]["accuracy"]
    assert s["steps"]["sft"] > 0 and s["steps"]["rl_math"] > 0 and s["steps"]["rl_code"] > 0
    assert s["wall_time_s"] > 0 and set(s["stage_wall_s"]) >= {"data", "sft", "rl_math",
                                                              "rl_code", "eval_sft", "eval_rl"}
    assert os.path.getsize(w / "curves.png") > 1000
    for k in ("math", "code"):
        with open(w / "data" / f"heldout_{k}.jsonl") as f:
            assert json.loads(f.readline())["problem"]
        assert os.path.exists(w / "eval" / "rl" / "samples" / f"{k}__t1_0.jsonl")
    for stage in ("sft", "rl_math", "rl_code"):
        tb = w / stage / "tb"
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(tb)), stage
        rows = [json.loads(line) for line in open(w / stage / "metrics.jsonl")]
        assert rows and rows[-1]["step"] >= 1
    assert (w / "rl_code" / "checkpoints").is_dir()
    # math RL runs last, from the code run's weights; the eval scores its checkpoint
    assert s["rl_order"] == ["code", "math"] and s["checkpoints"]["rl"] == str(w / "rl_math")


# The tiny demo end to end runs from an installed package in another directory:
# tests/test_install.py (one run checks the package, the console script and the demo).


@pytest.mark.slow
def test_demo_full_size(tmp_path):
    """The README's command at full size (minutes on an idle 2-core CPU) against issue 6's
    target: RL raises held-out math avg@4 at T=1.0 by >= 10 points over SFT, and code too
    (docs/demo.md: met on seeds 0, 1, 2: math +17.2 / +11.4 / +12.9, code RL before math)."""
    w = tmp_path / "demo"
    s = _run_demo(w, "default", timeout=3600)
    _check_outputs(w, s)
    assert s["code"]["rl_accuracy"] > s["code"]["sft_accuracy"] + 0.05, s["code"]
    assert s["math"]["rl_accuracy"] >= s["math"]["sft_accuracy"] + 0.10, s["math"]
