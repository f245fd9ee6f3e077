"""The config schema, in one place, plus validation, loading and overrides.

Config files (``configs/sft_*.py``) call ``sft_base()`` and fill in values; the result is
locked, so a typo in a file or a ``--config.x.y=`` override fails naming the key. Values are
checked by ``validate_sft_config`` before anything heavy starts.

    workdir                 str   checkpoints, metrics.jsonl and TensorBoard logs go here
    seed                    int   model init, data order and the RNG saved with checkpoints
    mesh.{data,fsdp,tensor} int   device-mesh axis sizes; one may be -1 (takes the rest);
                                  their product must equal the device count
    init.source             str   "scratch" | "hf" (a HF safetensors dir) | "orbax" (a params
                                  checkpoint dir written by klear_jax.checkpoint.save_params)
    init.path               str   the directory for "hf" / "orbax"
    init.step               int   orbax step to load (-1 = latest)
    model.*                       klear_jax.models.ModelConfig fields (vocab_size, hidden_size,
                                  intermediate_size, num_layers, num_heads, num_kv_heads,
                                  head_dim, rms_norm_eps, rope_theta, max_position_embeddings,
                                  tie_word_embeddings, qk_norm, qkv_bias, dtype (compute),
                                  param_dtype (master weights), remat_policy, attention_impl,
                                  logprob_chunk_size, logprob_remat, model_type). With
                                  init.source = "hf" or "orbax" the architecture comes from
                                  the checkpoint and only dtype / param_dtype / remat_policy /
                                  attention_impl / logprob_chunk_size / logprob_remat are
                                  taken from here.
    data.dir                str   TFDS data_dir holding the dataset written by
                                  ``python -m klear_jax.data.prepare`` ("" = TFDS default)
    data.name               str   TFDS dataset name
    data.split              str   split to train on ("train")
    data.shuffle            bool  shuffle records (seeded by ``seed``) and packing bins
    data.num_epochs         int   passes over the data (0 = repeat forever); the run stops
                                  early with "data_exhausted" when they run out
    data.overlong           str   "truncate" | "drop" sequences longer than train.seq_len
    data.num_packing_bins   int   first-fit packing bins (0 = max(batch, 32))
    train.total_steps       int   optimizer steps to run
    train.batch_size        int   rows per step (global, over all hosts); divisible by
                                  num_microbatches * mesh.data * mesh.fsdp
    train.seq_len           int   tokens per packed row (T)
    train.num_microbatches  int   gradient-accumulation micro-batches per step (lax.scan)
    train.max_consecutive_skips int  stop after this many non-finite steps in a row
    train.log_every         int   host-side metric logging cadence (steps)
    train.loss_agg          str   SFT loss aggregation, klear_jax.losses.AGG_MODES ("token-mean")
    optim.lr                float peak learning rate (> 0)
    optim.end_lr            float floor the cosine decays to
    optim.schedule          str   "cosine" (warmup -> cosine to end_lr) | "constant"
    optim.warmup_steps      int   linear warmup from 0
    optim.decay_steps       int   cosine length incl. warmup (0 = train.total_steps)
    optim.b1, optim.b2, optim.eps, optim.weight_decay   AdamW
    optim.clip_norm         float global-norm gradient clipping (0 = off)
    optim.mu_dtype          str   "" (param dtype) | "float32" | "bfloat16" for Adam's mu
    checkpoint.every_steps  int   save every N steps (and always at the end)
    checkpoint.keep         int   keep the last K checkpoints
    checkpoint.async_save   bool  write checkpoints in a background thread
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from typing import Any, Sequence

import ml_collections


class ConfigError(ValueError):
    """A bad config value; the message starts with the dotted key."""

    def __init__(self, key: str, problem: str):
        self.key = key
        super().__init__(f"config key {key!r}: {problem}")


def parse_arg(arg: str | None, **defaults):
    """big_vision-style variant string: ``"size=tiny,steps=10"`` -> ConfigDict over defaults.

    A bare word ``"tiny"`` sets the first default's key. Values are cast to the default's type.
    """
    out = dict(defaults)
    if arg:
        first = next(iter(defaults)) if defaults else None
        for item in arg.split(","):
            if not item:
                continue
            key, sep, value = item.partition("=")
            if not sep:
                key, value = first, item
            if key not in defaults:
                raise ValueError(f"config arg: unknown key {key!r}; allowed {sorted(defaults)}")
            typ = type(defaults[key])
            out[key] = (value.lower() in ("1", "true", "yes")) if typ is bool else typ(value)
    return ml_collections.ConfigDict(out)


def sft_base() -> ml_collections.ConfigDict:
    """Every key with a default value (see the module docstring for meanings)."""
    c = ml_collections.ConfigDict()
    c.workdir = ""
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.init = dict(source="scratch", path="", step=-1)
    c.model = dict(
        vocab_size=0, hidden_size=0, intermediate_size=0, num_layers=0, num_heads=0,
        num_kv_heads=0, head_dim=0, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
        qkv_bias=False, dtype="bfloat16", param_dtype="float32", remat_policy="none",
        attention_impl="xla", logprob_chunk_size=512, logprob_remat=True, model_type="qwen3")
    c.data = dict(dir="", name="", split="train", shuffle=True, num_epochs=1,
                  overlong="truncate", num_packing_bins=0)
    c.train = dict(total_steps=1, batch_size=8, seq_len=512, num_microbatches=1,
                   max_consecutive_skips=5, log_every=1, loss_agg="token-mean")
    c.optim = dict(lr=8e-5, end_lr=4e-5, schedule="cosine", warmup_steps=0, decay_steps=0,
                   b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, clip_norm=1.0, mu_dtype="")
    c.checkpoint = dict(every_steps=1000, keep=3, async_save=True)
    return c


# ------------------------------------------------------------------------------ validation
# Architectures shared by config files (``c.model.update(MODEL_PRESETS[...])``).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-8B (overridden by the checkpoint's config.json for init=hf/orbax); TPU pod
    # settings: bf16 compute over f32 master weights, full remat, splash attention.
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False, dtype="bfloat16", param_dtype="float32",
                     remat_policy="full", attention_impl="splash", logprob_chunk_size=1024),
    # A Qwen3-shaped model that trains on CPU in seconds (tests, smoke runs); set vocab_size.
    "tiny": dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=10000.0,
                 dtype="float32", param_dtype="float32", logprob_chunk_size=32),
}

DTYPES = ("float32", "bfloat16")
INIT_SOURCES = ("scratch", "hf", "orbax")


def _need(cond: bool, key: str, problem: str):
    if not cond:
        raise ConfigError(key, problem)


def _int(c, key: str, lo: int | None = None):
    v = _get(c, key)
    _need(isinstance(v, int) and not isinstance(v, bool), key, f"must be an int, got {v!r}")
    if lo is not None:
        _need(v >= lo, key, f"must be >= {lo}, got {v}")
    return v


def _num(c, key: str, lo: float | None = None, hi: float | None = None, open_lo=False):
    v = _get(c, key)
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), key,
          f"must be a finite number, got {v!r}")
    if lo is not None:
        _need(v > lo if open_lo else v >= lo, key, f"must be {'>' if open_lo else '>='} {lo}, got {v}")
    if hi is not None:
        _need(v <= hi, key, f"must be <= {hi}, got {v}")
    return v


def _get(c, key: str):
    node = c
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, AttributeError):
            raise ConfigError(key, "missing") from None
    return node


def validate_mesh(c, num_devices: int | None = None, key: str = "mesh") -> dict[str, int]:
    """Checks mesh axes (ints, >= 1 or -1, at most one -1, product vs the device count)."""
    sizes = {}
    for ax in ("data", "fsdp", "tensor"):
        v = _int(c, f"{key}.{ax}")
        _need(v == -1 or v >= 1, f"{key}.{ax}", f"must be >= 1 or -1, got {v}")
        sizes[ax] = v
    free = [a for a, v in sizes.items() if v == -1]
    _need(len(free) <= 1, key, f"at most one axis may be -1, got {sizes}")
    if num_devices is not None:
        fixed = math.prod(v for v in sizes.values() if v != -1)
        if free:
            _need(num_devices % fixed == 0, key,
                  f"{num_devices} devices not divisible by the fixed axes {sizes}")
            sizes[free[0]] = num_devices // fixed
        else:
            _need(fixed == num_devices, key,
                  f"data*fsdp*tensor = {fixed} but there are {num_devices} devices ({sizes})")
    return sizes


def validate_model(c, key: str = "model", architecture: bool = True) -> None:
    m = _get(c, key)
    for name in ("dtype", "param_dtype"):
        _need(m[name] in DTYPES, f"{key}.{name}", f"unknown dtype {m[name]!r}; allowed {DTYPES}")
    if architecture:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            _int(c, f"{key}.{name}", lo=1)
    try:
        from klear_jax.models import ModelConfig
        if architecture:
            ModelConfig(**model_kwargs(m))
    except ImportError:
        pass
    except ValueError as e:  # ModelConfig.<field>: ... -> name the config key
        msg = str(e)
        found = re.match(r"ModelConfig\.(\w+)", msg)
        field = found.group(1) if found else ""
        raise ConfigError(f"{key}.{field}" if field else key, msg) from None


def model_kwargs(m) -> dict[str, Any]:
    """ModelConfig keyword arguments from the ``model`` block."""
    d = m.to_dict() if hasattr(m, "to_dict") else dict(m)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = dict(d["rope_scaling"])
    return d


def validate_optim(c, key: str = "optim") -> None:
    _num(c, f"{key}.lr", lo=0, open_lo=True)
    _num(c, f"{key}.end_lr", lo=0)
    _need(_get(c, f"{key}.schedule") in ("cosine", "constant"), f"{key}.schedule",
          f"unknown schedule {_get(c, f'{key}.schedule')!r}; allowed ('cosine', 'constant')")
    _int(c, f"{key}.warmup_steps", lo=0)
    _int(c, f"{key}.decay_steps", lo=0)
    _num(c, f"{key}.b1", lo=0, hi=1)
    _num(c, f"{key}.b2", lo=0, hi=1)
    _num(c, f"{key}.eps", lo=0, open_lo=True)
    _num(c, f"{key}.weight_decay", lo=0)
    _num(c, f"{key}.clip_norm", lo=0)
    mu = _get(c, f"{key}.mu_dtype")
    _need(mu in ("",) + DTYPES, f"{key}.mu_dtype", f"unknown dtype {mu!r}; allowed ('',) + {DTYPES}")


def validate_checkpoint(c, key: str = "checkpoint") -> None:
    _int(c, f"{key}.every_steps", lo=1)
    _int(c, f"{key}.keep", lo=1)
    _need(isinstance(_get(c, f"{key}.async_save"), bool), f"{key}.async_save", "must be a bool")


def validate_sft_config(c, num_devices: int | None = None) -> None:
    """Raises ConfigError naming the first bad key. Cheap: touches no device or file data."""
    _need(isinstance(c.workdir, str) and c.workdir != "", "workdir", "must be a non-empty path")
    _int(c, "seed", lo=0)
    sizes = validate_mesh(c, num_devices)
    src = c.init.source
    _need(src in INIT_SOURCES, "init.source", f"unknown source {src!r}; allowed {INIT_SOURCES}")
    if src != "scratch":
        _need(bool(c.init.path), "init.path", f"required when init.source = {src!r}")
    _int(c, "init.step", lo=-1)
    validate_model(c, architecture=(src == "scratch"))
    t = "train"
    _int(c, f"{t}.total_steps", lo=1)
    bs = _int(c, f"{t}.batch_size", lo=1)
    _int(c, f"{t}.seq_len", lo=1)
    nm = _int(c, f"{t}.num_microbatches", lo=1)
    _int(c, f"{t}.max_consecutive_skips", lo=1)
    _int(c, f"{t}.log_every", lo=1)
    _need(bs % nm == 0, f"{t}.batch_size",
          f"{bs} is not divisible by train.num_microbatches = {nm}")
    if all(v != -1 for v in sizes.values()) or num_devices is not None:
        shards = sizes["data"] * sizes["fsdp"]
        _need((bs // nm) % shards == 0, f"{t}.batch_size",
              f"micro-batch of {bs // nm} rows is not divisible by mesh.data * mesh.fsdp = {shards}")
    _need(isinstance(c.data.name, str) and c.data.name != "", "data.name",
          "must name the TFDS dataset to train on")
    _int(c, "data.num_epochs", lo=0)
    _int(c, "data.num_packing_bins", lo=0)
    _need(c.data.overlong in ("truncate", "drop"), "data.overlong",
          f"must be 'truncate' or 'drop', got {c.data.overlong!r}")
    from klear_jax.losses import AGG_MODES
    _need(c.train.loss_agg in AGG_MODES, f"{t}.loss_agg",
          f"unknown aggregation {c.train.loss_agg!r}; allowed {AGG_MODES}")
    validate_optim(c)
    validate_checkpoint(c)


# ------------------------------------------------------------------ loading and overrides
def load_config(spec: str) -> ml_collections.ConfigDict:
    """``"configs/x.py"`` or ``"configs/x.py:variant"`` -> the file's ``get_config(variant)``,
    locked. The programmatic twin of ``config_flags.DEFINE_config_file``."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    mod_spec = importlib.util.spec_from_file_location("_klear_config", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    cfg = mod.get_config(arg) if arg else mod.get_config()
    cfg.lock()
    return cfg


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str]):
    """Applies ``"a.b=value"`` strings (value parsed as JSON, else kept as a string) to a
    locked config; an unknown key raises ConfigError naming it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(key, "override must look like key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            if p not in node:
                raise ConfigError(key, f"unknown key {p!r}")
            node = node[p]
        if leaf not in node:
            raise ConfigError(key, "unknown key (the config is locked)")
        try:
            node[leaf] = value
        except TypeError as e:
            raise ConfigError(key, str(e)) from None
    return cfg


def config_to_json(cfg) -> str:
    return cfg.to_json(sort_keys=True) if hasattr(cfg, "to_json") else json.dumps(cfg, sort_keys=True)


def run_config_cli(run, errors: tuple[type[BaseException], ...] = (ConfigError,),
                   report=None) -> None:
    """The shared `python -m klear_jax.X --config=FILE[:variant] --config.key=value` entry
    point: parses the ml_collections config flag (locked, so an unknown key fails naming it),
    calls ``run(config)``, prints any of ``errors`` as ``error: ...`` and exits 2; otherwise
    calls ``report(result, config)`` (if given) and exits 0."""
    import logging
    import sys

    from absl import app, flags
    from ml_collections import config_flags
    config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                    lock_config=True)
    flags.mark_flags_as_required(["config"])

    def main(argv) -> int:
        del argv
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        cfg = flags.FLAGS.config
        try:
            out = run(cfg)
        except errors as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if report is not None:
            report(out, cfg)
        return 0
    app.run(lambda argv: sys.exit(main(argv)))
