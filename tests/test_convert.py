"""convert CLI: HF dir -> Orbax params -> HF dir is exact; a training run exports with its
tokenizer and generation config, and transformers generates what the sampler does."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from data_fixtures import tok_dir  # noqa: F401 (fixture)
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
    assert not (tmp_path / "hf2" / "generation_config.json").exists()  # no tokenizer known
    cfg1 = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg2 = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert cfg1["num_hidden_layers"] == cfg2["num_hidden_layers"] == 2


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert.main(["--from_hf", str(tmp_path)])  # no --to
    assert convert.main(["--from", str(tmp_path / "nothing"), "--to_hf", str(tmp_path / "o")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def _run_checkpoint(workdir, model, data: dict, step: int = 3):
    """A training run's checkpoint as SFT / RL save it, reduced to the items an export
    reads: params and model_config (unless ``model`` is None) and the run config."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from klear_jax import checkpoint as ckpt
    from klear_jax.integrity import seal
    d = workdir / "checkpoints"
    items = {"config": ocp.args.JsonSave({"data": data})}
    if model is not None:
        items.update(params=ocp.args.StandardSave(nnx.state(model).to_pure_dict()),
                     model_config=ocp.args.JsonSave(ckpt.model_config_dict(model.config)))
    mngr = ocp.CheckpointManager(d)
    mngr.save(step, args=ocp.args.Composite(**items))
    mngr.wait_until_finished()
    mngr.close()
    seal(d / str(step))


def test_export_loads_in_transformers_and_generates_our_greedy_tokens(tmp_path, tok_dir):
    """An RL run (its config names data.tokenizer) -> HF export with tokenizer, chat template
    and the paper's generation_config; transformers' greedy ``generate`` (which applies the
    export's repetition penalty 1.05 and stop ids) emits the sampler's greedy tokens."""
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear_jax import policy
    from klear_jax.data import tokenizer as tk
    from klear_jax.sampler import Sampler, SamplingParams
    ours_tok = tk.load_tokenizer(tok_dir)
    cfg = ModelConfig(vocab_size=-(-len(ours_tok) // 64) * 64, hidden_size=32,
                      intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, rope_theta=10000.0, max_position_embeddings=256)
    model = create_model(cfg, seed=0)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 20.0  # clear argmax margins
    _run_checkpoint(tmp_path / "rl", model, {"tokenizer": tok_dir})
    out = tmp_path / "hf"
    assert convert.main(["--from", str(tmp_path / "rl"), "--to_hf", str(out)]) == 0

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == ours_tok.chat_template and tok.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is 12 + 7? the cat sat"}]
    prompt = tk.prompt_ids(ours_tok, messages).tolist()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok(text, add_special_tokens=False)["input_ids"] == prompt

    pad_id, stop = policy.special_ids(ours_tok, cfg.vocab_size)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                   "repetition_penalty": 1.05, "eos_token_id": list(stop), "pad_token_id": pad_id}
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert hf.generation_config.top_k == 20 and hf.generation_config.repetition_penalty == 1.05
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
    hf_new = hf_ids[0, len(prompt):].tolist()

    graphdef, state = nnx.split(model)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_new_tokens=24,
                            stop_token_ids=stop)
    s = Sampler(graphdef, pad_id=pad_id, max_prompt_len=64).generate(state, [prompt], params, 0)
    assert hf_new == s.tokens[0, :s.lengths[0]].tolist()
    assert len(set(hf_new)) > 3  # a real sequence, not one token repeated


def test_sft_run_tokenizer_comes_from_its_prepared_dataset(tmp_path, tok_dir):
    """SFT trains on pre-tokenised data: its saved config names data.dir / data.name, and the
    dataset's prepare report names the tokenizer."""
    from klear_jax import policy
    report = tmp_path / "tfds" / "my_sft" / "1.0.0" / "prepare_report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"config": {"tokenizer": tok_dir}}))
    _run_checkpoint(tmp_path / "sft", None, {"dir": str(tmp_path / "tfds"), "name": "my_sft"})
    assert policy.saved_run_tokenizer(str(tmp_path / "sft")) == tok_dir
    _run_checkpoint(tmp_path / "other", None, {"dir": str(tmp_path / "tfds"), "name": "missing"})
    assert policy.saved_run_tokenizer(str(tmp_path / "other")) is None
