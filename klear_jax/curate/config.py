"""The curation config schema (``python -m klear_jax.curate``): ``curate_base()`` lists every
key with its default; ``validate_curate_config`` names the first bad key (no file is read).
Pipeline steps and their meaning: ``klear_jax.curate.pipeline``."""
from __future__ import annotations

import os

import ml_collections

from klear_jax import config as C
from klear_jax.data import records as R
from klear_jax.rewards import CodeRewardConfig, MathRewardConfig, SandboxConfig
from klear_jax.rewards.scorers import Scorers

SOURCE_KEYS = {"paths": None, "domain": None, "quality": 0.0, "weight": 1.0, "cap": 0}
PASS_RATE_SOURCES = ("none", "field", "samples", "model")


def source(paths, domain: str, quality: float = 0.0, weight: float = 1.0, cap: int = 0) -> dict:
    """A `sources.NAME` entry with every key present (so each is overridable from the CLI)."""
    return dict(paths=list(_paths(paths) or []), domain=domain, quality=float(quality),
                weight=float(weight), cap=int(cap))


def curate_base() -> ml_collections.ConfigDict:
    """Every key with its default. `sources` and `decontam.benchmarks` map names to entries:
    sources.NAME = source(paths=[...], domain="math", quality=0.0, weight=1.0, cap=0);
    decontam.benchmarks.NAME = [jsonl paths or globs]."""
    c = ml_collections.ConfigDict()
    c.kind = "sft"                      # sft | rl_math | rl_code (the prepared dataset)
    c.seed = 0
    c.skip_invalid = False              # count and drop malformed records instead of failing
    c.sources = ml_collections.ConfigDict()
    c.select = dict(top_n_per_domain=0)  # 0 = every source
    # max_per_prompt: records kept per identical prompt (1 = exact dedup; the paper's SFT set
    # keeps up to 16 teacher traces per prompt; 0 = no cap). max_unique 0 = unbounded.
    c.dedup = dict(prompt=True, response=True, max_per_prompt=1, max_unique=0)
    c.decontam = dict(benchmarks=ml_collections.ConfigDict(), n=9, check_response=False)
    c.label = dict(enabled=False, batch_size=64, require_open_think=True, math_workers=2,
                   code_timeout_s=10.0, code_max_tests=16, code_slots=0)
    c.pass_rate = dict(source="none", field="pass_rate", samples_field="samples", batch_size=64,
                       model=dict(checkpoint="", tokenizer="", checkpoint_step=-1, dtype="float32",
                                  num_samples=8, temperature=1.0, top_p=1.0, max_new_tokens=1024,
                                  batch_prompts=8, seed=0, max_prompt_len=512, keep_samples=False,
                                  mesh=dict(data=1, fsdp=1, tensor=1)))
    c.difficulty = dict(source="field", field="difficulty", hard_min=0.5, hard_max_pass_rate=0.25)
    c.retain = dict(keep_incorrect_hard=True, keep_incorrect_easy=False)
    c.rl_filter = dict(min_pass_rate=0.0, max_pass_rate=1.0, min_tests=0)
    c.output = dict(dir="", name="", tfds=True, tokenizer="", max_length=0, overlong="truncate",
                    val_fraction=0.0, prompt_template="{problem}", drop_fields=("samples",),
                    overwrite=False)
    return c


# ---------------------------------------------------------------------------- validation
def _check_keys(node, schema, prefix: str, free: tuple[str, ...]) -> None:
    for k in node.keys():
        key = f"{prefix}{k}"
        C.need(k in schema, key, f"unknown key; allowed {sorted(schema.keys())}")
        if key in free:
            continue
        if isinstance(schema[k], ml_collections.ConfigDict):
            C.need(isinstance(node[k], (dict, ml_collections.ConfigDict)), key, "must be a mapping")
            _check_keys(node[k], schema[k], key + ".", free)


def _paths(v) -> list[str]:
    return [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else None


def validate_curate_config(c) -> None:
    """Raises C.ConfigError naming the first bad key (no file is read)."""
    _check_keys(c, curate_base(), "", free=("sources", "decontam.benchmarks"))
    C.check_choice(c, "kind", R.KINDS, "kind")
    C.check_int(c, "seed", lo=0)
    C.need(len(c.sources) > 0, "sources", "define at least one source")
    for name, s in c.sources.items():
        k = f"sources.{name}"
        for f in s.keys():
            C.need(f in SOURCE_KEYS, f"{k}.{f}", f"unknown key; allowed {sorted(SOURCE_KEYS)}")
        p = _paths(s.get("paths"))
        C.need(bool(p) and all(isinstance(x, str) and x for x in p), f"{k}.paths",
              "must be a non-empty list of files / globs")
        dom = s.get("domain")
        C.need(isinstance(dom, str) and dom != "", f"{k}.domain", "must be a non-empty string")
        if c.kind != "sft":
            want = c.kind.split("_")[1]
            C.need(dom == want, f"{k}.domain", f"must be {want!r} for kind {c.kind!r}, got {dom!r}")
        C.need(C.is_num(s.get("quality", 0.0)), f"{k}.quality", "must be a number")
        w = s.get("weight", 1.0)
        C.need(C.is_num(w) and 0 < w <= 1, f"{k}.weight", f"must be a sampling rate in (0, 1], got {w!r}")
        cap = s.get("cap", 0)
        C.need(C.is_int(cap) and cap >= 0, f"{k}.cap", f"must be an int >= 0 (0 = no cap), got {cap!r}")
    C.check_int(c, "select.top_n_per_domain", lo=0)
    for f in ("prompt", "response"):
        C.check_bool(c, f"dedup.{f}")
    C.check_int(c, "dedup.max_unique", lo=0)
    C.need(C.is_int(c.dedup.max_per_prompt) and c.dedup.max_per_prompt >= 0, "dedup.max_per_prompt",
           "must be an int >= 0 (0 = no cap)")
    for name, p in c.decontam.benchmarks.items():
        p = _paths(p)
        C.need(bool(p) and all(isinstance(x, str) and x for x in p), f"decontam.benchmarks.{name}",
              "must be a JSONL path or a list of paths / globs")
    C.check_int(c, "decontam.n", lo=1)
    C.check_bool(c, "decontam.check_response")
    C.check_bool(c, "label.enabled")
    C.need(not c.label.enabled or c.kind == "sft", "label.enabled", "labels teacher traces: only for kind 'sft'")
    for f in ("batch_size", "math_workers", "code_max_tests"):
        C.check_int(c, f"label.{f}", lo=1)
    C.need(C.is_int(c.label.code_slots) and c.label.code_slots >= 0, "label.code_slots",
           "must be an int >= 0 (0 = cpu count)")
    C.check_num(c, "label.code_timeout_s", lo=0, open_lo=True)
    C.check_bool(c, "label.require_open_think")
    pr = c.pass_rate
    C.check_choice(c, "pass_rate.source", PASS_RATE_SOURCES, "source")
    for f in ("field", "samples_field"):
        C.check_str(c, f"pass_rate.{f}")
    C.check_int(c, "pass_rate.batch_size", lo=1)
    if pr.source == "model":
        _validate_model(c)
    C.check_choice(c, "difficulty.source", ("field", "pass_rate"), "source")
    if c.label.enabled and c.difficulty.source == "pass_rate":
        C.need(pr.source != "none", "difficulty.source", "'pass_rate' needs pass_rate.source 'field', 'samples' or 'model'")
    C.check_num(c, "difficulty.hard_min")
    C.check_num(c, "difficulty.hard_max_pass_rate", lo=0, hi=1)
    for f in ("keep_incorrect_hard", "keep_incorrect_easy"):
        C.check_bool(c, f"retain.{f}")
    rf = c.rl_filter
    for f in ("min_pass_rate", "max_pass_rate"):
        C.check_num(c, f"rl_filter.{f}", lo=0, hi=1)
    C.need(rf.min_pass_rate <= rf.max_pass_rate, "rl_filter.min_pass_rate", "must be <= rl_filter.max_pass_rate")
    if c.kind != "sft" and (rf.min_pass_rate > 0 or rf.max_pass_rate < 1):
        C.need(pr.source != "none", "rl_filter.min_pass_rate", "a pass-rate band needs pass_rate.source")
    C.check_int(c, "rl_filter.min_tests", lo=0)
    o = c.output
    C.check_str(c, "output.dir", "must be a non-empty path")
    n = o.name
    C.need(isinstance(n, str) and n[:1].isalpha() and n.replace("_", "a").isalnum() and n.lower() == n,
          "output.name", f"must be lower_snake_case (a TFDS name), got {n!r}")
    if C.check_bool(c, "output.tfds"):
        C.check_str(c, "output.tokenizer", "a tokenizer directory is required when output.tfds is True")
    C.need(C.is_int(o.max_length) and (o.max_length == 0 or o.max_length >= 2), "output.max_length",
          "must be 0 (no limit) or >= 2")
    C.check_choice(c, "output.overlong", ("truncate", "drop"))
    C.need(C.is_num(o.val_fraction) and 0 <= o.val_fraction < 1, "output.val_fraction", "must be in [0, 1)")
    C.need(isinstance(o.prompt_template, str) and "{problem}" in o.prompt_template, "output.prompt_template",
          "must contain '{problem}'")
    C.need(isinstance(o.drop_fields, (list, tuple)) and all(isinstance(x, str) for x in o.drop_fields),
          "output.drop_fields", "must be a list of field names")
    C.check_bool(c, "output.overwrite")


def _validate_model(c) -> None:
    """pass_rate.model.* (source 'model'): the reference checkpoint and its sampling."""
    m, k = c.pass_rate.model, "pass_rate.model"
    ck = C.check_str(c, f"{k}.checkpoint",
                     "required when pass_rate.source is 'model' (an Orbax params / SFT / RL checkpoint or a HF dir)")
    C.need(os.path.isdir(ck), f"{k}.checkpoint", f"directory {ck!r} does not exist")
    C.need(m.tokenizer == "" or isinstance(m.tokenizer, str) and os.path.isdir(m.tokenizer), f"{k}.tokenizer",
          f"must be '' (the checkpoint's) or an existing directory, got {m.tokenizer!r}")
    C.need(C.is_int(m.checkpoint_step), f"{k}.checkpoint_step", "must be an int (-1 = latest)")
    C.check_choice(c, f"{k}.dtype", ("float32", "bfloat16", "float16"), "dtype")
    for f, lo in (("num_samples", 1), ("max_new_tokens", 1), ("batch_prompts", 1), ("max_prompt_len", 1),
                  ("seed", 0)):
        C.check_int(c, f"{k}.{f}", lo=lo)
    C.need(C.is_num(m.temperature) and m.temperature >= 0, f"{k}.temperature", "must be >= 0 (0 = greedy)")
    C.check_num(c, f"{k}.top_p", lo=0, hi=1, open_lo=True)
    C.check_bool(c, f"{k}.keep_samples")
    C.validate_mesh(c, None, key=f"{k}.mesh")


def scorers_from_config(c) -> Scorers:
    """The math / code scorers of the ``label`` block (code in soft mode)."""
    lb = c.label
    return Scorers(
        MathRewardConfig(require_open_think=lb.require_open_think, num_workers=lb.math_workers),
        CodeRewardConfig(mode="soft", require_open_think=lb.require_open_think,
                         sandbox=SandboxConfig(timeout_s=lb.code_timeout_s,
                                               max_tests=lb.code_max_tests,
                                               num_slots=lb.code_slots)))
