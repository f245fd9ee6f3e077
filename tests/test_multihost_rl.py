"""The RL and eval entry points as 2 JAX processes x 4 CPU devices (tests/multihost.py),
against the same jobs as 1 process x 8 devices (run in this process).

The policy is the tiny model after a short SFT on the two task formats (math: ``\\boxed{a+b}``;
code: a ```` ```python ```` block printing n + a), so that rollouts earn every kind of reward:
math-verify, sandboxed programs that pass and fail, format penalties. The RL prompts mix math
and code: 8 prompts x 8 samples a step on 32 decode slots.

What runs differently on several processes (klear_jax/rl/loop.py, klear_jax/eval/run.py):
every process reads the whole global batch and runs the engine on all of it (the slots are
sharded over both processes' devices: at the start slots 0-15, prompts 0-1, sit on process
0's devices and slots 16-31, prompts 2-3, on process 1's; freed slots are refilled with any
prompt's samples); each process scores its share of the prompts (``engine.process_share``:
prompts 0-3 on process 0, 4-7 on process 1), so a group is scored, and its advantages taken,
by one process whichever devices decoded its samples; the [P, G] results are gathered
(``engine.gather_shares``), and group selection and the mini-batches are then global, the
same on every process, each device taking its rows. Eval splits scoring the same way and
only process 0 writes the report.

Which step metrics are equal, and which are close: everything derived from the sampled
tokens and their rewards (``reward/*``, ``accuracy*``, ``response/*``, ``groups/*``, token
counts, ``train/seq_len``, ``train/num_updates``, the LR) is exactly equal: the samples are
the same tokens (a token would differ only if two Gumbel-perturbed logits tied to ~1e-7) and
the rewards are functions of them. Losses, gradient norms, ratios, entropy and the
sampler / trainer log-prob mismatch are float32 reductions over the 8 devices whose
cross-process all-reduce (gloo) sums in another order than the in-process one: equal within
1e-5 relative (observed <= 5e-7) or 1e-6 absolute (approx_kl and the mismatch are ~1e-5 and
~1e-7 themselves; observed differences ~1e-9). ``time/*`` and ``perf/*`` are wall clock.
"""
import collections
import json
import os
import random
import shutil

import pytest

from klear_jax import config as cu
from klear_jax.metrics import read_jsonl
from multihost import (MultiHost, ROOT, audit_report, audited, cache_env, cli_args, describe,
                       sigterm_one_process)

RL_CONFIG = os.path.join(ROOT, "configs", "gppo_tiny.py") + ":vocab=320"
EVAL_CONFIG = os.path.join(ROOT, "configs", "eval_tiny.py") + ":k=2,max_new=40"
EXACT_PREFIXES = ("reward/", "accuracy", "response/", "groups/", "rollout/")
EXACT = ("train/tokens", "train/sft_tokens", "train/batch_tokens", "train/num_updates",
         "train/skipped", "train/skipped_total", "train/lr", "train/seq_len", "updates")
WALL_CLOCK = ("time/", "perf/")
# The sampler / trainer log-prob mismatch is a difference of two float32 log-probs of
# magnitude up to ~10, each off by a few ulp (~1e-6) with the reduction order: its max
# differs by up to ~1e-5 between process layouts.
MISMATCH, MISMATCH_ATOL = "logprob_mismatch/", 1e-5

# AUDITED prelude: every batch a process hands to the reward scorers, as [kind, reference]
# per response (math: the answer; code: the tests, as sorted JSON).
SCORED = """
from klear_jax.rewards.scorers import Scorers
_submit = Scorers.submit
def _record(self, kind, texts, refs):
    report.setdefault("scored", []).extend([kind, json.dumps(r, sort_keys=True)] for r in refs)
    return _submit(self, kind, texts, refs)
Scorers.submit = _record
"""


# ------------------------------------------------------------------------------ the world
def _problems(rng, n):
    """n math and n code problems (a + b, and a program printing n + a)."""
    out = []
    for i in range(n):
        a, b = rng.randint(0, 3), rng.randint(0, 3)
        out.append({"problem": f"What is {a} + {b}?", "answer": str(a + b), "source": "add"})
        out.append({"problem": f"Read n, print n + {a}.", "source": "io",
                    "tests": {"inputs": [f"{b}\n", "1\n"], "outputs": [f"{a + b}\n", f"{a + 1}\n"]}})
    return out


def _answer(p):
    if "tests" in p:
        a = p["problem"].split("+ ")[1].rstrip(".")
        return f"<think>n + {a}</think>\n```python\nprint(int(input()) + {a})\n```"
    return f"<think>{p['problem'][8:-1]}</think> \\boxed{{{p['answer']}}}"


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory, xla_cache):
    """Tokenizer, a mixed math / code RL prompt set (TFDS), eval files (4 math, 4 code) and
    the SFT policy (60 steps of configs/sft_tiny.py, in this process)."""
    from klear_jax import sft
    from klear_jax.data import records as R
    from klear_jax.data import tokenizer as tk
    from klear_jax.data.prepare import prepare
    root = tmp_path_factory.mktemp("rl_world")
    rng = random.Random(0)
    sft_rows = [{"messages": [{"role": "user", "content": p["problem"]},
                              {"role": "assistant", "content": _answer(p)}]}
                for p in _problems(rng, 64)]
    tk.train_tokenizer([json.dumps(r) for r in sft_rows] + [_answer(p) for p in _problems(rng, 64)],
                       vocab_size=300, out_dir=str(root / "tok"))
    prepare([_write(root / "sft.jsonl", sft_rows)], str(root / "tfds"), "tiny_sft", "sft",
            str(root / "tok"))
    rl_rows = _problems(rng, 16)
    # One RL dataset of both kinds: a record with tests is a code prompt (prepare takes one
    # kind per call; the stored features are the same for both).
    fields = R.rl_fields
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R, "rl_fields", lambda d, kind: fields(d, "rl_code" if "tests" in d else kind))
        prepare([_write(root / "rl.jsonl", rl_rows)], str(root / "tfds"), "tiny_rl", "rl_math",
                str(root / "tok"))
    _write(root / "math.jsonl", [p for p in rl_rows if "tests" not in p][:4])
    _write(root / "code.jsonl", [p for p in rl_rows if "tests" in p][:4])
    cfg = cu.apply_overrides(cu.load_config(os.path.join(ROOT, "configs", "sft_tiny.py")
                                            + ":vocab=320,steps=60"), [
        f"workdir={root / 'sft'}", f"data.dir={root / 'tfds'}", "data.name=tiny_sft",
        "optim.lr=0.01", "optim.end_lr=0.001", "checkpoint.every_steps=1000"])
    sft.run(cfg)
    return root


# ------------------------------------------------------------------------------ RL
def rl_overrides(world, workdir, steps, every=2) -> dict:
    return {"workdir": str(workdir), "data.dir": str(world / "tfds"), "data.name": "tiny_rl",
            "data.tokenizer": str(world / "tok"), "init.source": "orbax",
            "init.path": str(world / "sft"), "train.total_steps": steps,
            "checkpoint.every_steps": every}


def rl_here(world, workdir, steps, every=2) -> dict:
    """The RL job as 1 process x 8 devices (this pytest process)."""
    from klear_jax import rl
    kw = rl_overrides(world, workdir, steps, every)
    return rl.run(cu.apply_overrides(cu.load_config(RL_CONFIG),
                                     [f"{k}={json.dumps(v)}" for k, v in kw.items()]))


def rl_job(world, logs, xla_cache, workdir, steps, every=2) -> MultiHost:
    """``python -m klear_jax.rl`` as 2 processes x 4 devices, its scoring and process 1's
    writes audited."""
    args = cli_args("klear_jax.rl", RL_CONFIG, rl_overrides(world, workdir, steps, every))
    return MultiHost(audited(args, workdir, SCORED), logs=logs, env=cache_env(xla_cache))


def rows(workdir) -> list[dict]:
    return read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def assert_rows_match(got, want, rtol=1e-5, atol=1e-6):
    """Same steps and metric names; exact where the module docstring says so, else close."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    bad = []
    for g, w in zip(got, want):
        assert set(g) == set(w), (g["step"], set(g) ^ set(w))
        for k, v in w.items():
            if k.startswith(WALL_CLOCK):
                continue
            if k in EXACT or k.startswith(EXACT_PREFIXES):
                ok = g[k] == v
            else:
                tol = MISMATCH_ATOL if k.startswith(MISMATCH) else atol
                ok = abs(g[k] - v) <= rtol * abs(v) + tol
            if not ok:
                bad.append((g["step"], k, g[k], v))
    assert not bad, bad


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory):
    """The uninterrupted RL job, 1 process x 8 devices: 3 steps (checkpoints at 2 and 3).
    Every step trains; steps 1 and 2 hold both kinds of prompts; some sandboxed programs
    pass, others fail."""
    w = tmp_path_factory.mktemp("rl_ref") / "w"
    out = rl_here(world, w, 3)
    assert out["step"] == 3 and out["stopped"] == "done"
    ref = rows(w)
    assert all(r["train/num_updates"] > 0 for r in ref), ref
    assert all("reward/math_mean" in r and "reward/code_mean" in r for r in ref[:2]), ref
    assert max(r["accuracy/code"] for r in ref) > 0 and min(r["reward/code_mean"] for r in ref) < 0
    return ref


def global_batches(world, steps) -> list[list[dict]]:
    """The RL prompt batches of the first ``steps`` steps, as one process reads them."""
    import tensorflow_datasets as tfds
    from klear_jax.data.pipeline import rl_prompt_batches
    cfg = cu.load_config(RL_CONFIG)
    src = tfds.data_source("tiny_rl", data_dir=str(world / "tfds"))["train"]
    it = rl_prompt_batches(src, cfg.rollout.prompts_per_step, seed=cfg.seed,
                           max_prompt_length=cfg.rollout.max_prompt_len, process_index=0,
                           process_count=1)
    return [next(it) for _ in range(steps)]


def test_rl_two_processes_equal_one_and_resume_on_one(world, reference, xla_cache, tmp_path):
    """2 x 4 devices, 2 steps: the same step metrics as 1 x 8 (module docstring); each
    process scored exactly the G = 8 responses of each prompt of its half of every global
    batch (math with math-verify, code in its own sandbox), nothing else; only process 0
    wrote metrics.jsonl / TensorBoard, process 1 only its checkpoint shards and manifest.
    The checkpoint of step 2 (params, optimizer, data position, RNG, saved by both
    processes), restored by 1 process, continues like the uninterrupted run."""
    from klear_jax.rl.rollout import record_ref
    w = tmp_path / "w"
    with rl_job(world, tmp_path / "logs", xla_cache, w, 2) as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)
    assert_rows_match(rows(w), reference[:2])

    G = cu.load_config(RL_CONFIG).rollout.group_size
    batches = global_batches(world, 2)
    for i, r in enumerate(results):
        share = [rec for b in batches for rec in b[4 * i:4 * i + 4]]  # its prompts, both steps
        want = collections.Counter((kind, json.dumps(ref, sort_keys=True))
                                   for kind, ref in map(record_ref, share) for _ in range(G))
        got = collections.Counter(map(tuple, audit_report(r)["scored"]))
        assert got == want, (i, got, want)
        assert {k for k, _ in got} == {"math", "code"}

    assert sorted(os.listdir(w)) == ["checkpoints", "metrics.jsonl", "tb"]
    assert len(os.listdir(w / "tb")) == 1  # one TensorBoard writer
    writes = audit_report(results[1])["writes"]
    assert writes and all(p.startswith(str(w / "checkpoints") + os.sep) for _, p in writes), writes
    assert all("step 2/2" not in r.output for r in results[1:])  # no progress bar elsewhere

    resumed = tmp_path / "resumed"
    shutil.copytree(w, resumed)
    out = rl_here(world, resumed, 3)
    assert out["step"] == 3 and out["updates"] == sum(int(r["train/num_updates"]) for r in reference)
    assert_rows_match(rows(resumed), reference)


@pytest.mark.slow
def test_rl_sigterm_to_one_process_stops_all_at_one_step(world, reference, xla_cache, tmp_path):
    """SIGTERM to process 1 alone mid-run: both processes save the same RL step and exit 0;
    the run resumed from there on 2 processes equals the uninterrupted one."""
    w = tmp_path / "w"
    with rl_job(world, tmp_path / "logs", xla_cache, w, 100, every=1000) as job:
        k = sigterm_one_process(job, w / "metrics.jsonl", 1)
    assert 1 <= k < 100 and sorted(os.listdir(w / "checkpoints")) == [str(k)]

    with rl_job(world, tmp_path / "logs2", xla_cache, w, k + 1, every=1000) as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)
    assert "resumed from" in results[1].output
    want = reference[:k + 1]
    if k + 1 > len(reference):
        rl_here(world, tmp_path / "straight", k + 1, every=1000)
        want = rows(tmp_path / "straight")
    assert_rows_match(rows(w), want)


# ------------------------------------------------------------------------------ eval
def eval_overrides(world, out_dir) -> dict:
    return {"checkpoint": str(world / "sft"), "tokenizer": str(world / "tok"),
            "benchmarks.math.path": str(world / "math.jsonl"),
            "benchmarks.code.path": str(world / "code.jsonl"), "out_dir": str(out_dir)}


def test_eval_two_processes_one_report_equal_to_one(world, xla_cache, tmp_path):
    """``python -m klear_jax.eval`` on 2 x 4 devices: every process samples all problems on the
    global mesh and scores its half (process 0 problems 0-1, process 1 problems 2-3 of each
    benchmark, every setting); process 0 alone writes results.json and samples/, process 1
    writes nothing; the report and every sample row equal the 1 x 8 run's."""
    from klear_jax import eval as ev
    from klear_jax.data.tokenizer import load_tokenizer
    from klear_jax.eval import config as ec
    out = tmp_path / "two"
    args = cli_args("klear_jax.eval", EVAL_CONFIG, eval_overrides(world, out))
    with MultiHost(audited(args, tmp_path, SCORED), logs=tmp_path / "logs",
                   env=cache_env(xla_cache)) as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)

    cfg = cu.apply_overrides(cu.load_config(EVAL_CONFIG), [
        f"{k}={json.dumps(v)}" for k, v in eval_overrides(world, tmp_path / "one").items()])
    ev.run(cfg)
    two, one = (json.loads((d / "results.json").read_text()) for d in (out, tmp_path / "one"))
    timing = ("time_s", "tokens_per_s")
    strip = lambda res: {b: {s: {k: v for k, v in m.items() if k not in timing}  # noqa: E731
                             for s, m in per.items()} for b, per in res["results"].items()}
    assert strip(two) == strip(one)
    assert sorted(os.listdir(out)) == ["results.json", "samples"]
    names = sorted(os.listdir(tmp_path / "one" / "samples"))
    assert sorted(os.listdir(out / "samples")) == names and len(names) == 6
    for name in names:
        assert (out / "samples" / name).read_text() == (tmp_path / "one" / "samples" / name).read_text()
    assert one["results"]["code"]["t1_0"]["pass_rate"] > 0  # sandboxed programs passed

    assert audit_report(results[1])["writes"] == []
    tok = load_tokenizer(str(world / "tok"))
    for i, r in enumerate(results):
        want = collections.Counter()
        for b in ec.benchmarks_from_config(cfg):
            k = sum(s["num_samples"] or b["num_samples"] for s in ec.settings_from_config(cfg))
            probs = ev.load_problems(ev.Benchmark(**b), tok, cfg.sampling.max_prompt_len)
            for p in probs[2 * i:2 * i + 2]:
                ref = p.tests if b["kind"] == "code" else p.answer
                want[(b["kind"], json.dumps(ref, sort_keys=True))] += k
        assert collections.Counter(map(tuple, audit_report(r)["scored"])) == want, i
