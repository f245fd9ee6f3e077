"""Issue 23: a bit flip inside a params file of the newest checkpoint makes the real SFT entry
point resume from the step before, loudly, and finish with the metrics of a run resumed from
that step; the corrupt step is kept aside, the good one is not deleted."""
import json
import os
import shutil


from data_fixtures import sft_dataset, tok_dir  # noqa: F401 (fixtures)
from klear_jax import config as cu, sft
from klear_jax.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "sft_tiny.py")






def run(workdir, sft_dataset):
    over = {"workdir": str(workdir), "data.dir": sft_dataset, "data.name": "tiny_sft",
            "optim.decay_steps": 50, "train.total_steps": 4, "checkpoint.every_steps": 2,
            "checkpoint.keep": 2}
    cfg = cu.apply_overrides(cu.load_config(TINY + ":vocab=384"),
                             [f"{k}={json.dumps(v)}" for k, v in over.items()])
    return sft.run(cfg)


def test_bit_flip_in_params_resumes_from_previous_step(tmp_path, sft_dataset, xla_cache, caplog):
    a = tmp_path / "a"
    assert run(a, sft_dataset)["step"] == 4
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
        out = run(flipped, sft_dataset)
    rel = data.relative_to(flipped / "checkpoints" / "4").as_posix()
    assert f"CHECKPOINT STEP 4 IS CORRUPT: {flipped}/checkpoints/4: {rel}: content changed" in caplog.text
    assert out["step"] == 4 and out["stopped"] == "done"
    assert sorted(os.listdir(flipped / "checkpoints")) == ["2", "4", "4.corrupt"]
    assert run(reference, sft_dataset)["step"] == 4
    rows = {w: read_jsonl(str(w / "metrics.jsonl")) for w in (a, flipped, reference)}
    assert [r["step"] for r in rows[flipped]] == [1, 2, 3, 4]
    assert rows[flipped] == rows[reference] == rows[a]
