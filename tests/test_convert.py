"""convert CLI: HF dir -> Orbax params -> HF dir is exact, and a training workdir exports."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from klear_jax import convert
from klear_jax.models import ModelConfig, create_model, to_hf

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def test_hf_orbax_hf_round_trip(tmp_path):
    to_hf(create_model(CFG, seed=5), str(tmp_path / "hf"))
    assert convert.main(["--from_hf", str(tmp_path / "hf"), "--to", str(tmp_path / "ck"),
                         "--fsdp", "8"]) == 0
    assert (tmp_path / "ck" / "0" / "params").is_dir()
    assert convert.main(["--from", str(tmp_path / "ck"), "--to_hf", str(tmp_path / "hf2")]) == 0
    a, b = tensors(tmp_path / "hf"), tensors(tmp_path / "hf2")
    assert sorted(a) == sorted(b) and len(a) > 5
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    cfg1 = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg2 = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert cfg1["num_hidden_layers"] == cfg2["num_hidden_layers"] == 2


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert.main(["--from_hf", str(tmp_path)])  # no --to
    assert convert.main(["--from", str(tmp_path / "nothing"), "--to_hf", str(tmp_path / "o")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
