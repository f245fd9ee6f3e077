"""Loading a policy: the model (from scratch, a HF directory or an Orbax checkpoint, placed on
a mesh), its tokenizer, and the pad / stop ids every stage samples with.

    model = load_model("path/to/hf_or_orbax", mesh, step=-1, dtype="bfloat16")
    model = model_from_init(cfg, mesh)            # cfg.init / cfg.model / cfg.seed
    tok = resolve_tokenizer(None, "path/to/checkpoint")
    pad_id, stop_ids = special_ids(tok, model.config.vocab_size)
    gen = generation_config(tok, model.config.vocab_size)   # HF generation_config.json
"""

from __future__ import annotations

import json
import os

import orbax.checkpoint as ocp

from klear_jax import checkpoint as ckpt
from klear_jax import config as cfglib
from klear_jax.data.prepare import VERSION as PREPARED_VERSION
from klear_jax.data.tokenizer import load_tokenizer
from klear_jax.models import ModelConfig, create_model, from_hf

# The paper's sampling for evaluation (Klear-Reasoner, section 4; the authors'
# benchmarks/inference.py): configs/eval_qwen3_8b.py evaluates with it and HF exports carry
# it in generation_config.json.
PAPER_SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05)


def is_hf_dir(path: str) -> bool:
    """A directory holding config.json and safetensors weights."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") or f == "model.safetensors.index.json"
        for f in os.listdir(path))


def load_model(path: str, mesh=None, step: int = -1, **overrides):
    """A HF directory (``from_hf``) or an Orbax checkpoint / training workdir
    (``checkpoint.restore_params``), its parameters placed on ``mesh``. ``overrides`` set
    ModelConfig fields that keep shapes (dtype, param_dtype, attention_impl, rope_scaling...)."""
    if is_hf_dir(path):
        return from_hf(path, mesh=mesh, **{"dtype": "float32", **overrides})
    return ckpt.restore_params(path, mesh=mesh, step=step, **overrides)


def model_from_init(cfg, mesh):
    """The model ``cfg.init`` names (scratch: ``cfg.model``'s architecture, seeded by
    ``cfg.seed``), with ``cfg.model``'s runtime fields (dtypes, remat, attention kernel)."""
    runtime = cfglib.runtime_model_fields(cfg)
    if cfg.init.source == "scratch":
        return create_model(ModelConfig(**cfglib.model_kwargs(cfg.model)), seed=cfg.seed,
                            mesh=mesh)
    if cfg.init.source == "hf":
        return from_hf(cfg.init.path, mesh=mesh, **runtime)
    return ckpt.restore_params(cfg.init.path, mesh=mesh, step=cfg.init.step, **runtime)


def saved_run_tokenizer(path: str, step: int = -1) -> str | None:
    """The tokenizer directory a run's saved config names: ``data.tokenizer`` (RL), else the
    tokenizer its pre-tokenised dataset ``data.dir`` / ``data.name`` was prepared with
    (SFT; read from the dataset's prepare report). None when there is none."""
    try:
        mngr = ocp.CheckpointManager(ckpt.resolve_dir(path),
                                     options=ocp.CheckpointManagerOptions(read_only=True))
        s = mngr.latest_step() if step < 0 else step
        saved = mngr.restore(s, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        mngr.close()
        data = saved["config"].get("data") or {}
    except Exception:  # params-only checkpoints and HF dirs carry no run config
        return None
    if data.get("tokenizer"):
        return data["tokenizer"]
    report = os.path.join(data.get("dir") or "", data.get("name") or "", PREPARED_VERSION,
                          "prepare_report.json")
    try:
        with open(report) as f:
            return json.load(f)["config"]["tokenizer"] or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_tokenizer(tokenizer, checkpoint: str | None = None, step: int = -1):
    """A tokenizer object as given; else ``tokenizer`` as a directory; else the checkpoint's
    own tokenizer files (HF dirs, exports); else the ``data.tokenizer`` of the run config
    saved with an Orbax checkpoint."""
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    if tokenizer:
        return load_tokenizer(tokenizer)
    if checkpoint and os.path.isdir(checkpoint) and any(
            os.path.isfile(os.path.join(checkpoint, f))
            for f in ("tokenizer.json", "tokenizer_config.json")):
        return load_tokenizer(checkpoint)
    saved = saved_run_tokenizer(checkpoint, step) if checkpoint else None
    if saved:
        return load_tokenizer(saved)
    if checkpoint and "://" not in checkpoint and not os.path.exists(checkpoint):
        raise ValueError(f"checkpoint {checkpoint!r} does not exist")
    raise ValueError(f"no tokenizer: set `tokenizer` (the checkpoint {checkpoint!r} has none "
                     "and no saved run config naming one)")


def check_vocab(tok, vocab_size: int, key: str = "model.vocab_size") -> None:
    """ConfigError naming ``key`` when the tokenizer has more tokens than the model."""
    if len(tok) > vocab_size:
        raise cfglib.ConfigError(key, f"{vocab_size} is smaller than the tokenizer's "
                                      f"{len(tok)} tokens")


def special_ids(tok, vocab_size: int) -> tuple[int, tuple[int, ...]]:
    """(pad id, stop ids): pad is the tokenizer's pad token (else eos); sampling stops on eos
    and <|endoftext|>, where the model's vocabulary has them."""
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = (tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>"))
    stop = tuple(sorted({i for i in ids if isinstance(i, int) and 0 <= i < vocab_size}))
    return int(pad_id), stop


def generation_config(tok, vocab_size: int) -> dict:
    """HF ``generation_config.json`` fields: the paper's sampling, and the stop / pad ids
    this project samples with (``special_ids``)."""
    pad_id, stop = special_ids(tok, vocab_size)
    return {"do_sample": True, **PAPER_SAMPLING, "eos_token_id": list(stop),
            "pad_token_id": pad_id}
