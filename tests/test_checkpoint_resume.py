"""Issue 23: a bit flip inside a params file of the newest checkpoint makes the real SFT entry
point resume from the step before, loudly, and finish with the metrics of a run resumed from
that step; the corrupt step is kept aside, the good one is not deleted."""
import json
import os
import random
import shutil

import jax
import pytest

from data_fixtures import sft_record, tok_dir, write_jsonl  # noqa: F401 (fixture)
from klear_jax import config as cu, sft
from klear_jax.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "sft_tiny.py")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tok_dir):  # noqa: F811
    from klear_jax.data.prepare import prepare
    d = tmp_path_factory.mktemp("sft_data")
    src = write_jsonl(d / "train.jsonl", [sft_record(random.Random(i), True) for i in range(64)])
    prepare([src], str(d / "tfds"), "tiny_sft", "sft", tok_dir)
    return str(d / "tfds")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent XLA cache so the three runs of one program compile once."""
    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def run(workdir, dataset):
    over = {"workdir": str(workdir), "data.dir": dataset, "data.name": "tiny_sft",
            "optim.decay_steps": 50, "train.total_steps": 4, "checkpoint.every_steps": 2,
            "checkpoint.keep": 2}
    cfg = cu.apply_overrides(cu.load_config(TINY + ":vocab=384"),
                             [f"{k}={json.dumps(v)}" for k, v in over.items()])
    return sft.run(cfg)


def test_bit_flip_in_params_resumes_from_previous_step(tmp_path, dataset, compile_cache, caplog):
    a = tmp_path / "a"
    assert run(a, dataset)["step"] == 4
    ckpts = a / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["2", "4"]
    flipped, reference = tmp_path / "flipped", tmp_path / "from2"
    shutil.copytree(a, flipped)
    shutil.copytree(a, reference)
    shutil.rmtree(reference / "checkpoints" / "4")  # the run resumed from step 2
    data = max((p for p in (flipped / "checkpoints" / "4" / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit
    data.write_bytes(bytes(raw))

    with caplog.at_level("WARNING", logger="klear_jax.checkpoint"):
        out = run(flipped, dataset)
    rel = data.relative_to(flipped / "checkpoints" / "4").as_posix()
    assert f"CHECKPOINT STEP 4 IS CORRUPT: {flipped}/checkpoints/4: {rel}: content changed" in caplog.text
    assert out["step"] == 4 and out["stopped"] == "done"
    assert sorted(os.listdir(flipped / "checkpoints")) == ["2", "4", "4.corrupt"]
    assert run(reference, dataset)["step"] == 4
    rows = {w: read_jsonl(str(w / "metrics.jsonl")) for w in (a, flipped, reference)}
    assert [r["step"] for r in rows[flipped]] == [1, 2, 3, 4]
    assert rows[flipped] == rows[reference] == rows[a]
