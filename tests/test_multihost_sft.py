"""The SFT entry point as 2 JAX processes x 4 CPU devices (tests/multihost.py), against the
same job as 1 process x 8 devices (run in this process): the same per-step metrics, the
same data position, checkpoints that move between process counts and mesh shapes, SIGTERM
to one process, a process killed mid-step, and writes from process 0 only.

The data side (each record once per epoch over all processes, the same packed rows for
1 / 2 / 4 processes, iterator state N -> M) is checked on the pipeline itself in
tests/test_data_pipeline.py; here the per-step token counts and the saved iterator state
show that the entry point really trains on those global batches.
"""
import json
import os
import re
import shutil
import signal

import pytest

from data_fixtures import sft_dataset, tok_dir  # noqa: F401 (fixtures)
from klear_jax import config as cu, sft
from klear_jax.metrics import read_jsonl
from multihost import (MultiHost, ROOT, cache_env, cli_args, describe, has_lines,
                       sigterm_one_process)

TINY = os.path.join(ROOT, "configs", "sft_tiny.py") + ":vocab=384"
EXACT = ("tokens", "batch_tokens", "lr", "skipped")  # integers / schedule: equal
CLOSE = ("loss", "grad_norm")                         # float32 sums: equal up to order




def overrides(workdir, sft_dataset, steps, every=3, **kw) -> dict:
    # decay_steps fixed: the LR schedule must not depend on total_steps, so a run stopped
    # early and resumed compares step by step with a longer one
    out = {"workdir": str(workdir), "data.dir": sft_dataset, "data.name": "tiny_sft",
           "optim.decay_steps": 50, "train.total_steps": steps,
           "checkpoint.every_steps": every, "checkpoint.keep": 5}
    out.update(kw)
    return out


def run_here(**kw) -> dict:
    """The job as 1 process x 8 devices (this pytest process)."""
    cfg = cu.apply_overrides(cu.load_config(TINY), [f"{k}={json.dumps(v)}" for k, v in kw.items()])
    return sft.run(cfg)


def sft_job(logs, xla_cache, num_processes=2, env=None, **kw) -> MultiHost:
    """``python -m klear_jax.sft`` as ``num_processes`` processes (8 devices over all)."""
    return MultiHost(cli_args("klear_jax.sft", TINY, kw), num_processes=num_processes,
                     devices_per_process=8 // num_processes, logs=logs,
                     env={**cache_env(xla_cache), **(env or {})})


def rows(workdir) -> list[dict]:
    return read_jsonl(os.path.join(workdir, "metrics.jsonl"))




def assert_rows_match(got, want, rtol=1e-6):
    """Same steps; token counts / lr / skips equal; loss and grad norm within rtol."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for k in EXACT:
            assert g[k] == w[k], (g["step"], k, g[k], w[k])
        for k in CLOSE:
            assert abs(g[k] - w[k]) <= rtol * abs(w[k]), (g["step"], k, g[k], w[k])


def saved(workdir, step, item="data_iter"):
    with open(os.path.join(workdir, "checkpoints", str(step), item, "metadata")) as f:
        return json.load(f)


def file_set(workdir) -> set[str]:
    """Paths under workdir with content-hashed / timestamped names normalised."""
    out = set()
    for d, dirs, files in os.walk(workdir):
        for name in dirs + files:
            rel = os.path.relpath(os.path.join(d, name), workdir)
            rel = re.sub(r"/d/[0-9a-f]{32}$", "/d/HASH", rel)
            out.add(re.sub(r"events\.out\.tfevents\..*", "events.out.tfevents.X", rel))
    return out


EPOCHS = {"data.num_epochs": 2}  # 2 epochs of the 64 records: 8 steps, then "data_exhausted"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sft_dataset, xla_cache):
    """The uninterrupted job, 1 process x 8 devices: 2 epochs (8 steps), checkpoints at 3, 6
    and 8. Every token of every record is trained on exactly twice (each record's length
    capped at seq_len, summed: the batch_tokens of all steps)."""
    import tensorflow_datasets as tfds
    w = tmp_path_factory.mktemp("ref") / "w"
    out = run_here(**overrides(w, sft_dataset, 100, **EPOCHS))
    assert out["stopped"] == "data_exhausted" and out["step"] == 8
    src = tfds.data_source("tiny_sft", data_dir=sft_dataset)["train"]
    tokens = sum(min(len(src[i]["input_ids"]), 64) for i in range(len(src)))
    assert sum(r["batch_tokens"] for r in rows(w)) == 2 * tokens
    return str(w)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, sft_dataset, xla_cache):
    """The first 3 steps of the same job as 2 processes x 4 devices (checkpoint at 3)."""
    base = tmp_path_factory.mktemp("two")
    w = str(base / "w")
    with sft_job(base / "logs", xla_cache, **overrides(w, sft_dataset, 3, **EPOCHS)) as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)
    return w, results


def test_two_processes_equal_one_and_resume_on_one(two_process_run, reference, sft_dataset,
                                                    xla_cache, tmp_path):
    """2 x 4 devices: the same per-step loss / grad norm / token counts as 1 x 8 and the same
    saved data position; its checkpoint, restored by 1 process, continues like the
    uninterrupted run to the end of the data (so together they also trained on every token
    twice); only process 0 wrote metrics.jsonl / TensorBoard, and process 1 wrote nothing
    but its own Orbax shards and its own integrity manifest."""
    w, results = two_process_run
    ref = rows(reference)
    assert_rows_match(rows(w), ref[:3])
    assert saved(w, 3) == saved(reference, 3)  # data position: a function of the step only
    assert sorted(os.listdir(w)) == ["checkpoints", "metrics.jsonl", "tb"]
    assert len(os.listdir(os.path.join(w, "tb"))) == 1  # one TensorBoard writer
    extra = file_set(w) - file_set(reference)
    assert extra and all("process_1" in p or p.endswith("/integrity.1.json") for p in extra), \
        sorted(extra)
    assert all("step 3/3" not in r.output for r in results[1:])  # no progress bar elsewhere

    resumed = str(tmp_path / "w")
    shutil.copytree(w, resumed)
    out = run_here(**overrides(resumed, sft_dataset, 100, **EPOCHS))
    assert out["step"] == 8 and out["stopped"] == "data_exhausted"
    assert_rows_match(rows(resumed), ref)


@pytest.mark.slow
def test_two_process_checkpoint_restores_on_another_mesh(two_process_run, reference, sft_dataset,
                                                         xla_cache, tmp_path):
    """Saved by 2 processes on fsdp=8, resumed by 2 processes on data=2 x fsdp=2 x tensor=2:
    the remaining steps match the uninterrupted run (within float32 summation noise)."""
    w = str(tmp_path / "w")
    shutil.copytree(two_process_run[0], w)
    with sft_job(tmp_path / "logs", xla_cache, **overrides(
            w, sft_dataset, 100, **EPOCHS, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})) as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)
    assert "resumed from" in results[1].output
    assert_rows_match(rows(w), rows(reference))


def test_sigterm_to_one_process_stops_all_at_one_step(sft_dataset, xla_cache, tmp_path):
    """SIGTERM to process 1 alone: both processes save the same step and exit 0; the run
    resumed from there equals an uninterrupted one."""
    w = str(tmp_path / "w")
    metrics = os.path.join(w, "metrics.jsonl")
    with sft_job(tmp_path / "logs", xla_cache, **overrides(w, sft_dataset, 500, every=1000)) as job:
        k = sigterm_one_process(job, metrics, 2)
    steps = sorted(int(s) for s in os.listdir(os.path.join(w, "checkpoints")) if s.isdigit())
    assert 2 <= k < 500 and steps == [k]

    with sft_job(tmp_path / "logs2", xla_cache, **overrides(w, sft_dataset, k + 2, every=1000)) as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)
    straight = str(tmp_path / "straight")
    run_here(**overrides(straight, sft_dataset, k + 2, every=1000))
    assert_rows_match(read_jsonl(metrics), rows(straight))


# How JAX's coordination service names the lost process to the survivor. Process 1 lost:
# its heartbeats stop ("Task 1 heartbeat timeout" / "The following tasks are unhealthy
# (stopped sending heartbeats):\n1"); process 0 lost: the coordination service it serves
# goes with it ("... the leader task was preempted/died/restarted unexpectedly ...").
LOST = {1: re.compile(r"Task 1 heartbeat timeout|stopped sending heartbeats\):\s*\n1\b"),
        0: re.compile(r"the leader task was preempted/died")}


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_killed_process_makes_the_other_fail_naming_it(victim, sft_dataset, xla_cache, tmp_path):
    """SIGKILL to one process mid-run: the other exits non-zero by itself (the harness would
    kill it 150 s after the death) with an error naming the lost process. The heartbeat
    timeout is 30 s here (KLEAR_HEARTBEAT_TIMEOUT_S; JAX's default 100 s bounds it on a pod)."""
    w = str(tmp_path / "w")
    metrics = os.path.join(w, "metrics.jsonl")
    with sft_job(tmp_path / "logs", xla_cache, env={"KLEAR_HEARTBEAT_TIMEOUT_S": "30"},
                 **overrides(w, sft_dataset, 100000, every=100000)) as job:
        started = job.wait_until(has_lines(metrics, 1))
        assert started, describe(job.wait())
        job.signal(victim, signal.SIGKILL)
        results = job.wait()
    dead, survivor = results[victim], results[1 - victim]
    assert dead.returncode == -signal.SIGKILL
    assert survivor.returncode != 0 and not survivor.killed, describe(results)
    assert LOST[victim].search(survivor.output), describe(results, 8000)


# Run by every process: restore the latest parameters of a training checkpoint onto the
# global mesh and export them (klear_jax.convert.orbax_to_hf). A process other than 0 records
# every file it opens for writing or directory it creates under the output directory, and
# every safetensors file it would write, and prints them.
EXPORT = """
import os, sys
from klear_jax import sharding as shd
shd.initialize_distributed()
import jax
from klear_jax.models import hf
from klear_jax.convert import orbax_to_hf
src, out = sys.argv[1:]
writes = []
if jax.process_index() != 0:
    def audit(event, args):
        if event in ("open", "os.mkdir") and str(args[0]).startswith(out):
            flags = args[2] if event == "open" else os.O_CREAT
            if (event == "open" and args[1] and set(args[1]) & set("wax+")) or \
                    flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                writes.append((event, str(args[0])))
    sys.addaudithook(audit)
    real = hf.save_file
    hf.save_file = lambda t, path, **kw: (writes.append(("save_file", path)), real(t, path, **kw))
orbax_to_hf(src, out, mesh=shd.make_mesh(fsdp=-1))
print("process", jax.process_index(), "writes", writes)
"""


@pytest.mark.slow
def test_hf_export_gathers_everywhere_and_only_process_0_writes(two_process_run, tmp_path):
    """The HF export of a 2-process run's checkpoint on the global mesh (each leaf gathered
    across processes): process 1 writes nothing, and the files equal the 1-process export."""
    from klear_jax.convert import orbax_to_hf
    from klear_jax.sharding import make_mesh
    ckpt, out, ref = os.path.join(two_process_run[0], "checkpoints"), tmp_path / "hf", tmp_path / "ref"
    with MultiHost(["-c", EXPORT, ckpt, str(out)], logs=tmp_path / "logs") as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)
    assert "process 1 writes []" in results[1].output, describe(results)
    orbax_to_hf(ckpt, str(ref), mesh=make_mesh(fsdp=-1))
    # the run knows its tokenizer, so the export carries it (issue 28) beside the weights
    assert sorted(os.listdir(out)) == sorted(os.listdir(ref))
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer_config.json"} <= set(os.listdir(ref))
    for name in os.listdir(ref):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
