"""Configs: loading, the command line, the blocks every stage shares, and public validators.

Config files are ml_collections files with a big_vision-style variant string
(``--config=configs/x.py:size=tiny,steps=10``); each stage's schema lives beside the stage
(``klear_jax.sft.config``, ``rl.config``, ``eval.config``, ``curate.config``) and is built
from the shared blocks here. A loaded config is locked, so a typo in a file or a
``--config.x.y=`` override fails naming the key; ``validate_*`` check values before
anything heavy starts and raise ``ConfigError`` naming the first bad key.

Shared blocks (keys and meaning):

    workdir                 str   checkpoints, metrics.jsonl and TensorBoard logs go here
    seed                    int   model init, data order and the RNG saved with checkpoints
    mesh.{data,fsdp,tensor} int   device-mesh axis sizes; one may be -1 (takes the rest);
                                  their product must equal the device count
    init.source             str   "scratch" | "hf" (a HF safetensors dir) | "orbax" (a params
                                  checkpoint or a training workdir)
    init.path               str   the directory for "hf" / "orbax"
    init.step               int   orbax step to load (-1 = latest)
    model.*                       klear_jax.models.ModelConfig fields. With init.source = "hf"
                                  or "orbax" the architecture comes from the checkpoint and
                                  only RUNTIME_MODEL_FIELDS are taken from here.
    optim.lr                float peak learning rate (> 0)
    optim.end_lr            float floor the cosine decays to
    optim.schedule          str   "cosine" (warmup -> cosine to end_lr) | "constant"
    optim.warmup_steps      int   linear warmup from 0
    optim.decay_steps       int   cosine length incl. warmup (0 = train.total_steps)
    optim.b1, b2, eps, weight_decay   AdamW
    optim.weight_decay_mask str   "matrices" (decay all but norm scales and biases) | "all"
                                  (every parameter, as the authors' torch AdamW does)
    optim.clip_norm         float global-norm gradient clipping (0 = off)
    optim.mu_dtype          str   "" (param dtype) | "float32" | "bfloat16" for Adam's mu
    checkpoint.every_steps  int   save every N steps (and always at the end)
    checkpoint.keep         int   keep the last K checkpoints
    checkpoint.async_save   bool  write checkpoints in a background thread
    metrics.wandb           bool  also log to Weights & Biases (process 0; needs the
                                  ``wandb`` extra: pip install 'klear-jax[wandb]')
    metrics.wandb_project   str   W&B project
    metrics.wandb_name      str   W&B run name ("" = the workdir's base name)
    metrics.wandb_entity    str   W&B entity ("" = the logged-in user's default)
    metrics.wandb_mode      str   "" (wandb decides: WANDB_MODE, else online) | "online" |
                                  "offline" (files under WORKDIR/wandb, ``wandb sync`` later)
    reward.math.*                 klear_jax.rewards.MathRewardConfig fields
    reward.code.*                 CodeRewardConfig (mode, no_code, format penalties, dedupe,
                                  test_selection, test_seed) and SandboxConfig fields
                                  (timeout_s, max_tests, memory_mb, num_slots,
                                  allow_unsandboxed)
    reward.{math,code}.think_check str  "open_first" (missing <think> checked first) |
                                  "close_first" (missing </think> first: the authors' reward)
                                  | "none" (no tag required: the official eval judges)
    reward.code.mode        str   "soft" (pass rate p, the paper's text) | "two_p_minus_one"
                                  (2p - 1, the authors' code) | "all_or_nothing"
    reward.code.test_selection str  "first" max_tests (default) | "random" max_tests per
                                  response (the authors' code) | "all" (the LiveCodeBench
                                  harness; max_tests ignored)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from typing import Any, Sequence

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from klear_jax import logs, losses, optim
from klear_jax.models import ModelConfig
from klear_jax.rewards import CodeRewardConfig, MathRewardConfig, SandboxConfig

DTYPES = ("float32", "bfloat16")
INIT_SOURCES = ("scratch", "hf", "orbax")
# ModelConfig fields a run's config decides even when the architecture comes from a
# checkpoint (compute / storage dtypes, memory and kernel choices).
RUNTIME_MODEL_FIELDS = ("dtype", "param_dtype", "remat_policy", "attention_impl",
                        "logprob_chunk_size", "logprob_remat")
CODE_SANDBOX_KEYS = ("timeout_s", "max_tests", "memory_mb", "num_slots", "allow_unsandboxed")

# Architectures shared by config files (``c.model.update(MODEL_PRESETS[...])``).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-8B (overridden by the checkpoint's config.json for init=hf/orbax); pod settings:
    # bf16 compute over f32 master weights, full remat, the platform's fused attention.
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False, dtype="bfloat16", param_dtype="float32",
                     remat_policy="full", attention_impl="auto", logprob_chunk_size=1024),
    # A Qwen3-shaped model that trains on CPU in seconds (tests, smoke runs); set vocab_size.
    "tiny": dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=10000.0,
                 dtype="float32", param_dtype="float32", logprob_chunk_size=32),
}


class ConfigError(ValueError):
    """A bad config value; the message starts with the dotted key."""

    def __init__(self, key: str, problem: str):
        self.key = key
        super().__init__(f"config key {key!r}: {problem}")


# ------------------------------------------------------------------------------ blocks
def base_config() -> ml_collections.ConfigDict:
    """workdir, seed, mesh, init, model, optim, checkpoint, metrics with their defaults."""
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
        attention_impl="auto", logprob_chunk_size=512, logprob_remat=True, model_type="qwen3")
    c.optim = dict(lr=8e-5, end_lr=4e-5, schedule="cosine", warmup_steps=0, decay_steps=0,
                   b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, weight_decay_mask="matrices",
                   clip_norm=1.0, mu_dtype="")
    c.checkpoint = dict(every_steps=1000, keep=3, async_save=True)
    c.metrics = dict(wandb=False, wandb_project="klear_jax", wandb_name="", wandb_entity="",
                     wandb_mode="")
    return c


def reward_block() -> dict:
    """``reward.math`` / ``reward.code`` with the paper's values (paper section 5)."""
    return dict(
        math=dict(correct=1.0, wrong=-1.0, missing_close_think=-0.5, missing_open_think=-2.0,
                  require_open_think=True, think_check="open_first", num_workers=2,
                  deadline_s=10.0, verify_timeout_s=5),
        code=dict(mode="soft", no_code=-1.0, missing_close_think=-0.5,
                  missing_open_think=-2.0, require_open_think=True, think_check="open_first",
                  test_selection="first", test_seed=0, timeout_s=35.0, max_tests=16,
                  memory_mb=1024, num_slots=0, allow_unsandboxed=False, dedupe=False))


def math_reward_config(c) -> MathRewardConfig:
    return MathRewardConfig(**c.reward.math.to_dict())


def code_reward_config(c) -> CodeRewardConfig:
    d = c.reward.code.to_dict()
    sandbox = SandboxConfig(**{k: d.pop(k) for k in CODE_SANDBOX_KEYS})
    return CodeRewardConfig(sandbox=sandbox, **d)


def model_kwargs(m) -> dict[str, Any]:
    """ModelConfig keyword arguments from a ``model`` block."""
    d = m.to_dict() if hasattr(m, "to_dict") else dict(m)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = dict(d["rope_scaling"])
    return d


def runtime_model_fields(c) -> dict[str, Any]:
    return {k: c.model[k] for k in RUNTIME_MODEL_FIELDS if k in c.model}


SEMANTICS = ("paper", "official")


def set_semantics(c, semantics: str, official: dict[str, Any]):
    """The ``:semantics=`` variant of the paper-setting configs: "paper" keeps ``c`` as it is
    (the paper's text); "official" sets each dotted key of ``official`` (the authors'
    released run, e.g. ``klear_jax.rl.config.OFFICIAL``). Returns ``c``."""
    need(semantics in SEMANTICS, "semantics", f"unknown {semantics!r}; allowed {SEMANTICS}")
    if semantics == "official":
        for key, value in official.items():
            *parents, leaf = key.split(".")
            node = c
            for p in parents:
                node = node[p]
            need(leaf in node, key, "not a key of this config")
            node[leaf] = value
    return c


# ------------------------------------------------------------------------------ validators
def get(c, key: str):
    """The value at dotted ``key``; ConfigError "missing" when absent."""
    node = c
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, AttributeError):
            raise ConfigError(key, "missing") from None
    return node


def need(cond: bool, key: str, problem: str) -> None:
    if not cond:
        raise ConfigError(key, problem)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_int(c, key: str, lo: int | None = None) -> int:
    v = get(c, key)
    need(is_int(v), key, f"must be an int, got {v!r}")
    if lo is not None:
        need(v >= lo, key, f"must be >= {lo}, got {v}")
    return v


def check_num(c, key: str, lo: float | None = None, hi: float | None = None,
              open_lo: bool = False) -> float:
    v = get(c, key)
    need(is_num(v), key, f"must be a finite number, got {v!r}")
    if lo is not None:
        need(v > lo if open_lo else v >= lo, key, f"must be {'>' if open_lo else '>='} {lo}, got {v}")
    if hi is not None:
        need(v <= hi, key, f"must be <= {hi}, got {v}")
    return v


def check_bool(c, key: str) -> bool:
    v = get(c, key)
    need(isinstance(v, bool), key, f"must be a bool, got {v!r}")
    return v


def check_choice(c, key: str, allowed: Sequence[str], what: str = "value") -> str:
    v = get(c, key)
    need(v in allowed, key, f"unknown {what} {v!r}; allowed {tuple(allowed)}")
    return v


def check_str(c, key: str, problem: str = "must be a non-empty string") -> str:
    v = get(c, key)
    need(isinstance(v, str) and v != "", key, problem)
    return v


def validate_mesh(c, num_devices: int | None = None, key: str = "mesh") -> dict[str, int]:
    """Checks mesh axes (ints, >= 1 or -1, at most one -1, product vs the device count);
    returns the sizes with -1 resolved when ``num_devices`` is known."""
    sizes = {}
    for ax in ("data", "fsdp", "tensor"):
        v = check_int(c, f"{key}.{ax}")
        need(v == -1 or v >= 1, f"{key}.{ax}", f"must be >= 1 or -1, got {v}")
        sizes[ax] = v
    free = [a for a, v in sizes.items() if v == -1]
    need(len(free) <= 1, key, f"at most one axis may be -1, got {sizes}")
    if num_devices is not None:
        fixed = math.prod(v for v in sizes.values() if v != -1)
        if free:
            need(num_devices % fixed == 0, key,
                 f"{num_devices} devices not divisible by the fixed axes {sizes}")
            sizes[free[0]] = num_devices // fixed
        else:
            need(fixed == num_devices, key,
                 f"data*fsdp*tensor = {fixed} but there are {num_devices} devices ({sizes})")
    return sizes


def batch_shards(sizes: dict[str, int], num_devices: int | None) -> int | None:
    """data * fsdp (the batch's shards) when known, else None."""
    if all(v != -1 for v in sizes.values()) or num_devices is not None:
        return sizes["data"] * sizes["fsdp"]
    return None


def validate_model(c, key: str = "model", architecture: bool = True) -> None:
    m = get(c, key)
    for name in ("dtype", "param_dtype"):
        need(m[name] in DTYPES, f"{key}.{name}", f"unknown dtype {m[name]!r}; allowed {DTYPES}")
    if not architecture:
        return
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim"):
        check_int(c, f"{key}.{name}", lo=1)
    try:
        ModelConfig(**model_kwargs(m))
    except ValueError as e:  # "ModelConfig.<field>: ..." -> name the config key
        found = re.match(r"ModelConfig\.(\w+)", str(e))
        raise ConfigError(f"{key}.{found.group(1)}" if found else key, str(e)) from None


def validate_run(c, num_devices: int | None = None) -> dict[str, int]:
    """workdir, seed, mesh, init, model and metrics of a training run; returns the mesh
    sizes."""
    check_str(c, "workdir", "must be a non-empty path")
    check_int(c, "seed", lo=0)
    sizes = validate_mesh(c, num_devices)
    src = check_choice(c, "init.source", INIT_SOURCES, "source")
    if src != "scratch":
        need(bool(c.init.path), "init.path", f"required when init.source = {src!r}")
    check_int(c, "init.step", lo=-1)
    validate_model(c, architecture=(src == "scratch"))
    if "metrics" in c:
        validate_metrics(c)
    return sizes


def validate_optim(c, key: str = "optim") -> None:
    check_num(c, f"{key}.lr", lo=0, open_lo=True)
    check_num(c, f"{key}.end_lr", lo=0)
    check_choice(c, f"{key}.schedule", ("cosine", "constant"), "schedule")
    check_int(c, f"{key}.warmup_steps", lo=0)
    check_int(c, f"{key}.decay_steps", lo=0)
    check_num(c, f"{key}.b1", lo=0, hi=1)
    check_num(c, f"{key}.b2", lo=0, hi=1)
    check_num(c, f"{key}.eps", lo=0, open_lo=True)
    check_num(c, f"{key}.weight_decay", lo=0)
    check_choice(c, f"{key}.weight_decay_mask", optim.DECAY_MASKS, "mask")
    check_num(c, f"{key}.clip_norm", lo=0)
    check_choice(c, f"{key}.mu_dtype", ("",) + DTYPES, "dtype")


def validate_checkpoint(c, key: str = "checkpoint") -> None:
    check_int(c, f"{key}.every_steps", lo=1)
    check_int(c, f"{key}.keep", lo=1)
    check_bool(c, f"{key}.async_save")


def validate_metrics(c, key: str = "metrics") -> None:
    if not check_bool(c, f"{key}.wandb"):
        return
    check_str(c, f"{key}.wandb_project")
    for k in ("wandb_name", "wandb_entity"):
        need(isinstance(get(c, f"{key}.{k}"), str), f"{key}.{k}", "must be a string")
    check_choice(c, f"{key}.wandb_mode", ("", "online", "offline"), "mode")
    need(importlib.util.find_spec("wandb") is not None, f"{key}.wandb",
         "wandb is not installed: pip install 'klear-jax[wandb]' (or wandb itself)")


def validate_agg(c, key: str) -> str:
    return check_choice(c, key, losses.AGG_MODES, "aggregation")


def validate_rewards(c) -> None:
    """``reward.math`` / ``reward.code`` build their reward configs, any bad field raising
    ConfigError naming the block."""
    for kind, make in (("math", math_reward_config), ("code", code_reward_config)):
        try:
            make(c)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"reward.{kind}", str(e)) from None


# ------------------------------------------------------------------ loading and overrides
def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
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


def check_config_file(path: str) -> None:
    """FileNotFoundError naming ``path`` (the file part of ``FILE[:variant]``) unless it is a
    file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no such config file {path!r} (relative paths start at {os.getcwd()})")


def load_config(spec: str) -> ml_collections.ConfigDict:
    """``"configs/x.py"`` or ``"configs/x.py:variant"`` -> the file's ``get_config(variant)``,
    locked. The programmatic twin of ``config_flags.DEFINE_config_file``."""
    path, _, arg = spec.partition(":")
    check_config_file(path)
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


def run_config_cli(run, errors: tuple[type[BaseException], ...] = (ConfigError,),
                   report=None) -> None:
    """The shared ``python -m klear_jax.X --config=FILE[:variant] --config.key=value`` entry
    point: parses the ml_collections config flag (locked, so an unknown key fails naming it),
    calls ``run(config)``, prints any of ``errors`` as ``error: ...`` and exits 2; otherwise
    calls ``report(result, config)`` (if given) and exits 0. Logging is quiet
    (``klear_jax.logs``) unless absl's ``--verbosity`` / ``-v`` is given."""
    config_flags.DEFINE_config_file("config", None, "ml_collections config file",
                                    lock_config=True)
    flags.mark_flags_as_required(["config"])

    def main(argv) -> int:
        del argv
        v = flags.FLAGS["verbosity"]
        logs.setup(v.value if v.present else None)
        cfg = flags.FLAGS.config
        try:
            out = run(cfg)
        except errors as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if report is not None:
            report(out, cfg)
        return 0
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=_parse_config_flags)


def _config_file_arg(argv: list[str]) -> str | None:
    """The file part of ``--config=FILE[:variant]`` / ``--config FILE[:variant]``."""
    for i, a in enumerate(argv[1:], 1):
        if a.startswith("--config="):
            return a[len("--config="):].partition(":")[0]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1].partition(":")[0]
    return None


def _parse_config_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, except that a ``--config`` file that does not exist, or an
    override of a key the config does not have (which ml_collections raises as a bare
    KeyError / AttributeError), exits 2 with one ``error:`` line naming the flag instead of
    a page of traceback."""
    path = _config_file_arg(argv)
    try:
        if path is not None:
            check_config_file(path)
    except FileNotFoundError as e:
        print(f"error: --config: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        return app.parse_flags_with_usage(argv)
    except (KeyError, AttributeError) as e:
        while e.args and isinstance(e.args[0], BaseException):  # AttributeError(KeyError(..))
            e = e.args[0]
        first, _, hint = str(e.args[0] if e.args else e).partition("\n")
        key = first.strip("'\"")
        flag = next((name for name in (a.split("=")[0] for a in argv)
                     if name.startswith("--config.") and key in name.split(".")), "--config")
        print(f"error: {flag}: unknown key {key!r}"
              + (f" ({hint.strip()})" if hint else ""), file=sys.stderr)
        sys.exit(2)
