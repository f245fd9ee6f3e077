"""Reference checks against transformers' PyTorch Qwen2/Qwen3 and the HF round trip."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from klear_jax import sharding as shd  # noqa: E402
from klear_jax.models import ModelConfig, from_hf, to_hf  # noqa: E402

V = 96
YARN = {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 16}

CASES = {
    # GQA 4/2, head_dim 24 != 64 / 4, untied
    "qwen3_gqa_untied": ("qwen3", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    # Klear's eval YaRN (factor 2.5 over 32768) scaled down: 16 original positions, T=37 > 16
    "qwen3_yarn": ("qwen3", dict(head_dim=16, rope_scaling=YARN, max_position_embeddings=40,
                                 tie_word_embeddings=False)),
    "qwen2_yarn_oldstyle": ("qwen2", dict(rope_scaling=YARN, max_position_embeddings=40,
                                          tie_word_embeddings=False, old_style=True)),
}


def _to_old_style(path):
    """Rewrites config.json to the older layout: rope_theta / rope_scaling at top level."""
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = None if rp.get("rope_type") == "default" else {
        "type": rp.pop("rope_type"), **rp}
    with open(path, "w") as f:
        json.dump(cfg, f)


def make_hf_model(path, family, seed=0, **kw):
    old_style = kw.pop("old_style", False)
    Config = transformers.Qwen3Config if family == "qwen3" else transformers.Qwen2Config
    kw.setdefault("max_position_embeddings", 128)
    cfg = Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # perturb everything (norm scales and biases start at 1 / 0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    if old_style:
        _to_old_style(os.path.join(path, "config.json"))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for name, (family, kw) in CASES.items():
        d = str(tmp_path_factory.mktemp(name))
        out[name] = (d, make_hf_model(d, family, **dict(kw)))
    return out


def _ids(B=2, T=37, seed=0):
    return np.random.RandomState(seed).randint(0, V, (B, T)).astype(np.int32)


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(hf_models, case):
    d, hf_model = hf_models[case]
    ids = _ids()
    ours = np.asarray(from_hf(d)(jnp.asarray(ids)))
    assert ours.dtype == np.float32 and ours.shape == (2, 37, V)
    np.testing.assert_allclose(ours, _torch_logits(hf_model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_gqa_untied", "qwen2_tied"])
def test_gradients_match_transformers(hf_models, case, tmp_path):
    """Every parameter's gradient of sum(logits * cot) equals torch's: covers the CPU custom
    VJPs (cpu_kernels: project, swiglu, apply_rope, rms_norm, the blocked attention recompute at
    T = 128)."""
    d, hf_model = hf_models[case]
    ids = _ids(2, 128, seed=5)
    cot = np.random.RandomState(6).standard_normal((2, 128, V)).astype(np.float32)
    model = from_hf(d)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params, rest)(jnp.asarray(ids)) * cot)
    nnx.update(model, jax.jit(jax.grad(loss))(params))
    to_hf(model, str(tmp_path / "grads"))
    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))
    hf_model.zero_grad()
    (hf_model(torch.tensor(ids, dtype=torch.long)).logits * torch.tensor(cot)).sum().backward()
    named = dict(hf_model.named_parameters())
    assert set(ours) == set(named)
    for name, p in named.items():
        ref = p.grad.numpy()
        np.testing.assert_allclose(ours[name], ref, rtol=0, atol=2e-4 * np.abs(ref).max(),
                                   err_msg=name)


def test_yarn_is_active(hf_models):
    """The YaRN model differs from the same weights with plain RoPE (so the check above
    really exercises the scaling)."""
    d, _ = hf_models["qwen3_yarn"]
    with_yarn = from_hf(d)
    plain = from_hf(d, rope_scaling=None)
    ids = jnp.asarray(_ids())
    assert float(jnp.max(jnp.abs(with_yarn(ids) - plain(ids)))) > 1e-2
    cfg = with_yarn.config
    assert cfg.rope_scaling["factor"] == 2.5
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16


def test_old_and_new_config_style_agree(hf_models, tmp_path):
    d, _ = hf_models["qwen3_yarn"]
    new = ModelConfig.from_hf_config(d)
    old_path = tmp_path / "config.json"
    with open(os.path.join(d, "config.json")) as f:
        old_path.write_text(f.read())
    _to_old_style(old_path)
    assert "rope_parameters" not in json.loads(old_path.read_text())
    assert ModelConfig.from_hf_config(str(old_path)) == new


@pytest.mark.parametrize("case", ["qwen3_gqa_untied", "qwen2_tied"])
def test_round_trip_exact(hf_models, case, tmp_path):
    d, hf_model = hf_models[case]
    model = from_hf(d)
    out = tmp_path / "out"
    to_hf(model, str(out))
    orig = load_file(os.path.join(d, "model.safetensors"))
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(orig)
    for k in orig:
        assert back[k].dtype == orig[k].dtype and back[k].shape == orig[k].shape, k
        assert back[k].tobytes() == orig[k].tobytes(), k  # bitwise
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = _ids(1, 9, seed=3)
    np.testing.assert_array_equal(_torch_logits(reloaded, ids), _torch_logits(hf_model, ids))


def test_to_hf_sharded_index_loads(hf_models, tmp_path):
    d, hf_model = hf_models["qwen3_yarn"]
    model = from_hf(d)
    out = tmp_path / "sharded"
    to_hf(model, str(out), max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = _ids(1, 21, seed=4)
    np.testing.assert_array_equal(_torch_logits(reloaded, ids), _torch_logits(hf_model, ids))
    again = from_hf(str(out))  # our loader reads the index too
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(ids))),
                                  np.asarray(model(jnp.asarray(ids))))


def test_from_hf_sharded_on_mesh(hf_models):
    d, hf_model = hf_models["qwen3_gqa_untied"]
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    model = from_hf(d, mesh=mesh)
    q = model.layers.attn.q_proj.kernel.get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 24)
    ids = _ids()
    with shd.use_mesh(mesh):
        out = np.asarray(model(jnp.asarray(ids)))
    np.testing.assert_allclose(out, _torch_logits(hf_model, ids), atol=1e-4, rtol=0)


def test_bfloat16_load_and_save(hf_models, tmp_path):
    d, hf_model = hf_models["qwen3_gqa_untied"]
    model = from_hf(d, dtype="bfloat16")
    assert model.embed.embedding.get_value().dtype == jnp.bfloat16
    ids = _ids()
    out = np.asarray(model(jnp.asarray(ids)))
    ref = _torch_logits(hf_model, ids)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    assert np.abs(out - ref).max() < 0.1 * np.abs(ref).max()
    to_hf(model, str(tmp_path / "bf16"))
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert str(saved["model.norm.weight"].dtype) == "bfloat16"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


# ----------------------------------------------------------------------- bad input
def _copy_dir(src, dst, mutate_tensors=None, mutate_config=None):
    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    if mutate_config:
        mutate_config(cfg)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if mutate_tensors:
        mutate_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_tensor_named(hf_models, tmp_path):
    d, _ = hf_models["qwen3_gqa_untied"]
    bad = _copy_dir(d, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(96, 64\)"):
        from_hf(bad)


def test_misshapen_tensor_named(hf_models, tmp_path):
    d, _ = hf_models["qwen3_gqa_untied"]

    def cut(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:40]
    bad = _copy_dir(d, tmp_path / "m", cut)
    with pytest.raises(ValueError, match=r"self_attn\.k_proj\.weight.*\(40, 64\).*\(48, 64\)"):
        from_hf(bad)


def test_unexpected_tensor_named(hf_models, tmp_path):
    d, _ = hf_models["qwen3_gqa_untied"]

    def add_bias(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(96, np.float32)
    bad = _copy_dir(d, tmp_path / "m", add_bias)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        from_hf(bad)


def test_unsupported_model_type_and_dtype(hf_models, tmp_path):
    d, _ = hf_models["qwen2_tied"]
    bad = _copy_dir(d, tmp_path / "m", mutate_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(ValueError, match="model_type.*llama"):
        from_hf(bad)
    with pytest.raises(ValueError, match="dtype.*float16"):
        from_hf(d, dtype="float16")
    with pytest.raises(ValueError, match="param_dtype.*int8"):
        from_hf(d, param_dtype="int8")
