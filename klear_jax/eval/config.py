"""The eval config schema (``python -m klear_jax.eval``), validation, and its conversions.

Config files (``configs/eval_*.py``) call ``eval_base()``, then add benchmarks and sampling
settings with ``add_benchmark`` / ``add_setting``; the result is locked, so a typo fails
naming the key.

    checkpoint              str   Orbax checkpoint (params-only, or an SFT / RL workdir) or a
                                  HF dir (config.json + safetensors)
    checkpoint_step         int   Orbax step (-1 = latest)
    tokenizer               str   tokenizer dir ("" = the HF dir's, or the data.tokenizer of
                                  the run config saved with the checkpoint)
    out_dir                 str   results.json + samples/ ("" = CHECKPOINT/eval)
    seed                    int   sampling seed
    mesh.{data,fsdp,tensor} int   as in training (klear_jax.config)
    model.dtype / param_dtype str compute / storage dtype the parameters are loaded in
    model.attention_impl    str   "auto" | "xla" | "splash" | "gpu_flash" (klear_jax.backend)
    model.rope_scaling_factor float  YaRN factor applied at load (0 = keep the checkpoint's)
    model.original_max_position_embeddings int  YaRN's original context (required with a
                                  factor); max_position_embeddings becomes factor x this
    sampling.max_prompt_len int   longest prompt (a longer one is an error, never dropped)
    sampling.batch_prompts  int   with samples_per_call: the rollout engine's decode slots
    sampling.samples_per_call int = batch_prompts x samples_per_call (0 = the benchmark's
                                  problems, resp. k): samples decoded at once, each slot a
                                  KV-cache row (bounds the cache), refilled as samples end
    benchmarks.<name>.path  str   JSONL file ("" = skip this benchmark)
    benchmarks.<name>.kind  str   "math" | "code"
    benchmarks.<name>.num_samples int  k per problem
    benchmarks.<name>.prompt_template str  wraps the problem; must contain {problem}
    settings.<name>.{temperature, top_p, top_k, repetition_penalty, max_new_tokens}
                                  sampling (temperature 0 = greedy; top_k 0 = off)
    settings.<name>.num_samples int  k for every benchmark (0 = the benchmark's)
    settings.<name>.stop_strings tuple  a sample ends at the first token whose text contains
                                  one (kept; while decoding, ``klear_jax.engine``); on the
                                  command line a JSON list: '["</answer>"]'
    reward.math.*           klear_jax.rewards.MathRewardConfig fields (as in RL)
    reward.code.*           CodeRewardConfig format penalties + sandbox limits (as in RL;
                            the mode is always "soft": accuracy = all tests pass)
    reward.{math,code}.think_check  "none" reproduces the official judges (no tag required);
                            reward.code.test_selection "all" runs every test (the official
                            LiveCodeBench harness), "first" the first max_tests
"""

from __future__ import annotations

import ml_collections

from klear_jax import config as C
from klear_jax.rewards.scorers import KINDS


def eval_base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.checkpoint = ""
    c.checkpoint_step = -1
    c.tokenizer = ""
    c.out_dir = ""
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.model = dict(dtype="float32", param_dtype="float32", attention_impl="auto",
                   rope_scaling_factor=0.0, original_max_position_embeddings=0)
    c.sampling = dict(max_prompt_len=4096, batch_prompts=0, samples_per_call=0)
    c.benchmarks = ml_collections.ConfigDict()
    c.settings = ml_collections.ConfigDict()
    c.reward = C.reward_block()
    del c.reward.code["mode"]  # always soft: accuracy = all tests pass
    return c


def add_benchmark(c, name: str, kind: str, num_samples: int, path: str = "",
                  prompt_template: str = "{problem}") -> None:
    c.benchmarks[name] = dict(path=path, kind=kind, num_samples=num_samples,
                              prompt_template=prompt_template)


def add_setting(c, name: str, temperature: float, top_p: float = 1.0, top_k: int = 0,
                repetition_penalty: float = 1.0, max_new_tokens: int = 1024,
                num_samples: int = 0, stop_strings: tuple = ()) -> None:
    c.settings[name] = dict(temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                            repetition_penalty=float(repetition_penalty),
                            max_new_tokens=max_new_tokens, num_samples=num_samples,
                            stop_strings=tuple(stop_strings))


def validate_eval_config(c, num_devices: int | None = None) -> None:
    """Raises ConfigError naming the first bad key. Touches no file data."""
    C.check_str(c, "checkpoint",
                "must be an Orbax checkpoint or HF directory (--config.checkpoint=DIR)")
    C.check_int(c, "checkpoint_step", lo=-1)
    C.check_int(c, "seed", lo=0)
    C.validate_mesh(c, num_devices)
    for k in ("dtype", "param_dtype"):
        C.check_choice(c, f"model.{k}", C.DTYPES, "dtype")
    f = C.check_num(c, "model.rope_scaling_factor", lo=0)
    o = C.check_int(c, "model.original_max_position_embeddings", lo=0)
    C.need(f == 0 or f >= 1, "model.rope_scaling_factor", f"must be 0 (off) or >= 1, got {f}")
    C.need(f == 0 or o > 0, "model.original_max_position_embeddings",
           "required (> 0) with model.rope_scaling_factor")
    C.check_int(c, "sampling.max_prompt_len", lo=1)
    C.check_int(c, "sampling.batch_prompts", lo=0)
    C.check_int(c, "sampling.samples_per_call", lo=0)
    for name in c.benchmarks:
        b = f"benchmarks.{name}"
        C.need(isinstance(C.get(c, f"{b}.path"), str), f"{b}.path", "must be a string")
        C.check_choice(c, f"{b}.kind", KINDS, "kind")
        C.check_int(c, f"{b}.num_samples", lo=1)
        C.need("{problem}" in C.get(c, f"{b}.prompt_template"), f"{b}.prompt_template",
               "must contain {problem}")
    C.need(any(c.benchmarks[n].path for n in c.benchmarks), "benchmarks",
           "no benchmark has a path: set --config.benchmarks.<name>.path=FILE.jsonl "
           f"(names: {sorted(c.benchmarks)})")
    C.need(len(c.settings) > 0, "settings", "needs at least one sampling setting")
    for name in c.settings:
        s = f"settings.{name}"
        C.check_num(c, f"{s}.temperature", lo=0)
        C.check_num(c, f"{s}.top_p", lo=0, hi=1, open_lo=True)
        C.check_int(c, f"{s}.top_k", lo=0)
        C.check_num(c, f"{s}.repetition_penalty", lo=0, open_lo=True)
        C.check_int(c, f"{s}.max_new_tokens", lo=1)
        C.check_int(c, f"{s}.num_samples", lo=0)
        stops = C.get(c, f"{s}.stop_strings")
        C.need(isinstance(stops, (list, tuple)) and all(isinstance(x, str) and x for x in stops),
               f"{s}.stop_strings", f"must be a tuple of non-empty strings, got {stops!r}")
    C.validate_rewards(c)  # reward.code has no mode: CodeRewardConfig's default, "soft"


def benchmarks_from_config(c) -> list[dict]:
    """``klear_jax.eval.Benchmark`` fields of every benchmark with a path."""
    return [dict(name=n, **c.benchmarks[n].to_dict()) for n in c.benchmarks
            if c.benchmarks[n].path]


def settings_from_config(c) -> list[dict]:
    """``klear_jax.eval.Setting`` fields of every setting."""
    return [dict(name=n, **c.settings[n].to_dict()) for n in c.settings]


def model_overrides(c) -> dict:
    """ModelConfig fields applied at load (dtypes, attention, YaRN)."""
    m = c.model
    out = {"dtype": m.dtype, "param_dtype": m.param_dtype, "attention_impl": m.attention_impl}
    if m.rope_scaling_factor:
        o = int(m.original_max_position_embeddings)
        out["rope_scaling"] = {"factor": float(m.rope_scaling_factor),
                               "original_max_position_embeddings": o}
        out["max_position_embeddings"] = int(round(m.rope_scaling_factor * o))
    return out
