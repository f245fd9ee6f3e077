"""Config loading, overrides and validation: every bad value fails naming its key."""
import os
import subprocess
import sys

import pytest

from klear_jax import config as cu
from klear_jax.config import ConfigError
from klear_jax.sft.config import validate_sft_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "sft_tiny.py")
BIG = os.path.join(ROOT, "configs", "sft_qwen3_8b.py")


def tiny(**over):
    c = cu.load_config(TINY)
    c.workdir, c.data.name = "/tmp/unused", "tiny_sft"
    cu.apply_overrides(c, [f"{k}={v}" for k, v in over.items()])
    return c


def test_shipped_configs_validate():
    validate_sft_config(tiny(), num_devices=8)
    big = cu.load_config(BIG + ":chips=32")
    big.workdir, big.init.path, big.data.name = "gs://b/w", "gs://b/hf", "klear_sft"
    validate_sft_config(big, num_devices=32)
    assert big.optim.lr == 8e-5 and big.optim.end_lr == 4e-5 and big.data.num_epochs == 4
    assert big.train.seq_len == 32768 and big.mesh.fsdp == 32


def test_variant_string():
    assert cu.load_config(TINY + ":vocab=384,steps=7").model.vocab_size == 384
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        cu.load_config(TINY + ":bogus=1")


@pytest.mark.parametrize("override,key", [
    ("train.bogus=1", "train.bogus"),
    ("nonsense.lr=1", "nonsense.lr"),
])
def test_unknown_key_names_it(override, key):
    c = cu.load_config(TINY)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cu.apply_overrides(c, [override])


@pytest.mark.parametrize("over,key", [
    ({"optim.lr": -1e-3}, "optim.lr"),
    ({"optim.schedule": '"linear"'}, "optim.schedule"),
    ({"optim.b2": 1.5}, "optim.b2"),
    ({"model.dtype": '"float16"'}, "model.dtype"),
    ({"model.param_dtype": '"int8"'}, "model.param_dtype"),
    ({"model.num_kv_heads": 3}, "model.num_heads"),
    ({"mesh.fsdp": 3}, "mesh"),
    ({"mesh.data": 0}, "mesh.data"),
    ({"train.batch_size": 12}, "train.batch_size"),
    ({"train.num_microbatches": 0}, "train.num_microbatches"),
    ({"train.total_steps": 0}, "train.total_steps"),
    ({"train.loss_agg": '"mean"'}, "train.loss_agg"),
    ({"init.source": '"pytorch"'}, "init.source"),
    ({"init.source": '"hf"'}, "init.path"),
    ({"checkpoint.every_steps": 0}, "checkpoint.every_steps"),
    ({"data.overlong": '"cut"'}, "data.overlong"),
    ({"workdir": '""'}, "workdir"),
    ({"metrics.wandb": "true", "metrics.wandb_mode": '"cloud"'}, "metrics.wandb_mode"),
    ({"metrics.wandb": "true", "metrics.wandb_project": '""'}, "metrics.wandb_project"),
    ({"metrics.wandb": "1"}, "metrics.wandb"),
])
def test_bad_values_name_the_key(over, key):
    with pytest.raises(ConfigError) as e:
        validate_sft_config(tiny(**over), num_devices=8)
    assert e.value.key == key, str(e.value)
    assert repr(key) in str(e.value)


def test_mesh_product_mismatch():
    c = tiny(**{"mesh.fsdp": 2, "mesh.tensor": 2})
    with pytest.raises(ConfigError, match="4 but there are 8 devices"):
        validate_sft_config(c, num_devices=8)


def test_type_mismatch_names_key():
    with pytest.raises(ConfigError, match="train.total_steps"):
        tiny(**{"train.total_steps": '"ten"'})


def test_cli_rejects_unknown_key_before_work():
    """config_flags on the real CLI: the locked config refuses an unknown key in one line
    naming the flag (not a page of ml_collections traceback)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "klear_jax.sft", f"--config={TINY}",
                        "--config.train.totl_steps=3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "error: --config.train.totl_steps: unknown key 'totl_steps' "
        '(Did you mean "total_steps" instead of "totl_steps"?)']


def test_cli_missing_config_file_is_one_line(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    missing = str(tmp_path / "nope.py")
    r = subprocess.run([sys.executable, "-m", "klear_jax.rl", f"--config={missing}:vocab=3"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"error: --config: no such config file {missing!r} (relative paths start at {ROOT})"]


def test_cli_rejects_bad_value_naming_key(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "klear_jax.sft", f"--config={TINY}",
                        f"--config.workdir={tmp_path}", "--config.data.name=x",
                        "--config.optim.lr=-1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "'optim.lr'" in r.stderr
    assert not (tmp_path / "checkpoints").exists()
