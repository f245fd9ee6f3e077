"""The SFT entry point end to end on a tiny generated TFDS sft_dataset: exact resume, SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time


from data_fixtures import sft_dataset, tok_dir  # noqa: F401 (fixtures)
from klear_jax import config as cu, sft
from klear_jax.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "sft_tiny.py")






def overrides(workdir, sft_dataset, **kw):
    base = {"workdir": workdir, "data.dir": sft_dataset, "data.name": "tiny_sft",
            "optim.decay_steps": 50, "checkpoint.async_save": True}
    base.update(kw)
    return base


def config(**kw):
    c = cu.load_config(TINY + ":vocab=384")
    return cu.apply_overrides(c, [f"{k}={json.dumps(v)}" for k, v in kw.items()])


def test_resume_equals_uninterrupted(tmp_path, sft_dataset, xla_cache):
    straight = sft.run(config(**overrides(str(tmp_path / "a"), sft_dataset,
                                          **{"train.total_steps": 4, "checkpoint.every_steps": 2})))
    assert straight["stopped"] == "done" and straight["step"] == 4
    b = str(tmp_path / "b")
    first = sft.run(config(**overrides(b, sft_dataset, **{"train.total_steps": 2,
                                                       "checkpoint.every_steps": 2})))
    assert first["step"] == 2
    second = sft.run(config(**overrides(b, sft_dataset, **{"train.total_steps": 4,
                                                        "checkpoint.every_steps": 2})))
    assert second["step"] == 4
    rows_a = read_jsonl(os.path.join(tmp_path / "a", "metrics.jsonl"))
    rows_b = read_jsonl(os.path.join(b, "metrics.jsonl"))
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert rows_a[0]["loss"] != rows_a[3]["loss"]
    for ra, rb in zip(rows_a, rows_b):
        for k in ("loss", "grad_norm", "lr", "tokens", "batch_tokens", "skipped"):
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
    assert os.path.isdir(os.path.join(b, "tb"))


def test_sigterm_saves_and_exits_cleanly_then_resumes(tmp_path, sft_dataset, xla_cache):
    w = str(tmp_path / "w")
    args = [f"--config.{k}={v}" for k, v in overrides(w, sft_dataset, **{
        "train.total_steps": 500, "checkpoint.every_steps": 1000}).items()]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=xla_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.Popen([sys.executable, "-m", "klear_jax.sft", f"--config={TINY}:vocab=384"]
                         + args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(w, "metrics.jsonl")
    deadline = time.time() + 400
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(metrics) and len(read_jsonl(metrics)) >= 2:
            break
        time.sleep(0.5)
    assert p.poll() is None, p.stdout.read()[-3000:]
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert "SIGTERM: saved a checkpoint" in out
    steps = sorted(int(x) for x in os.listdir(os.path.join(w, "checkpoints")) if x.isdigit())
    k = steps[-1]
    assert 2 <= k < 500 and len(read_jsonl(metrics)) == k

    res = sft.run(config(**overrides(w, sft_dataset, **{"train.total_steps": k + 2,
                                                     "checkpoint.every_steps": 1000})))
    assert res["step"] == k + 2 and res["stopped"] == "done"
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, k + 3))
