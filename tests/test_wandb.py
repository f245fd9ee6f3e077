"""The optional Weights & Biases writer, offline (no network): the trainer logs to it beside
metrics.jsonl / TensorBoard when ``metrics.wandb`` is set, a run resumed in the same workdir
continues the same W&B run, and only process 0 writes."""
import pytest

from klear_jax.metrics import WandbWriter, read_jsonl
from klear_jax.sft.config import sft_base
from klear_jax.trainer import Trainer

wandb = pytest.importorskip("wandb")  # the `wandb` extra (in requirements-test.txt)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network, no login, nothing written outside tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(k, str(tmp_path / k.lower()))


def config(workdir):
    c = sft_base()
    c.workdir = str(workdir)
    c.checkpoint.update(async_save=False)
    c.metrics.update(wandb=True, wandb_project="klear_test", wandb_name="tiny",
                     wandb_mode="offline")
    return c


def train(workdir, total, start=0):
    """The trainer's side of a run from ``start`` to ``total``: loss 10 + step / 8."""
    with Trainer(config(workdir), total_steps=total) as t:
        t.start(start)
        for step in range(start + 1, total + 1):
            assert not t.end_of_step(step, {"loss": 10 + step / 8, "tokens": 64.0}, lambda: None)


def test_trainer_logs_to_wandb_offline_and_resumes_the_same_run(offline, tmp_path):
    w = tmp_path / "run"
    train(w, 3)
    wandb.teardown()  # waits for wandb's service to write the run out (else at exit)
    run_id = (w / "wandb_run_id").read_text().strip()
    runs = list((w / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith("-" + run_id)
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"klear_test" in data and b"tiny" in data and b"loss" in data
    for step in (1, 2, 3):
        assert str(10 + step / 8).encode() in data, step  # 10.125, 10.25, 10.375
    assert [r["step"] for r in read_jsonl(w / "metrics.jsonl")] == [1, 2, 3]

    resumed = WandbWriter(str(w), "klear_test", mode="offline")  # as Trainer.start does
    assert resumed.run.id == run_id
    resumed.close()


def test_only_process_zero_writes(tmp_path):
    w = WandbWriter(str(tmp_path / "w"), "klear_test", enabled=False)
    w.write(1, {"loss": 1.0})
    w.close()
    assert w.run is None and not (tmp_path / "w").exists()
