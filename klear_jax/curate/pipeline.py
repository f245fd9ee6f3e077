"""Data curation the Klear way: sources -> dedup -> decontamination -> labels -> retention.

    python -m klear_jax.data.curate --config=configs/curate_example.py \
        [--config.output.dir=DIR --config.sources.<name>.cap=N ...]

A pipeline of small streaming steps (klear_jax/data/curate_steps.py, curate_label.py), in
this order, each enabled by the config (`curate_base()` lists every key):
  sources        named sources (files / globs, JSONL or Parquet) ranked by `quality`; only
                 the top `select.top_n_per_domain` per domain are read (the paper keeps one
                 or two). Each is subsampled at rate `weight` (a per-record hash of seed,
                 source, file name and line: deterministic, independent of other sources)
                 then truncated to `cap` records (file order). Sources are read one after
                 another, best-ranked first, so on a duplicate the better source's copy wins.
                 Records get `source` (the source's name) and `domain` fields.
  validate       the record schema of `kind` (klear_jax.data.records); a malformed record
                 is an error naming file:line, or with skip_invalid a counted drop.
  dedup_prompt / dedup_response   exact dedup of normalised text (curate_steps docstring).
  decontaminate  drop records sharing a word 9-gram with a benchmark problem.
  min_tests      code problems with fewer than `rl_filter.min_tests` tests are dropped.
  label          (sft) teacher traces labelled correct / incorrect with the project rewards.
  pass_rate      a pass rate per problem: a record field, its scored samples, or k scored
                 samples of a reference model (pass_rate.model.*, curate_label.ModelSamples).
  retain         (sft) incorrect traces kept for hard problems, dropped for easy ones.
  pass_band      (rl) problems with a pass rate outside [min, max] dropped.
Output (output.dir): NAME.curated.jsonl (kept records with their annotations, minus
output.drop_fields), the TFDS dataset NAME/1.0.0 written by klear_jax.data.prepare (unless
output.tfds is False), and NAME_curate_report.{json,md} with every step's counts.

Memory is bounded by the config, not the input size: one record per step, one batch in
the scoring steps, the benchmark n-gram index, and the dedup tables (16-32 bytes per unique
key, capped by dedup.max_unique when set).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from typing import Any, Iterator

import ml_collections

from klear_jax.config_utils import ConfigError, run_config_cli
from klear_jax.data import curate_label as L
from klear_jax.data import curate_steps as S
from klear_jax.data import records as R

log = logging.getLogger(__name__)
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
    c.dedup = dict(prompt=True, response=True, max_unique=0)  # max_unique 0 = unbounded
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
def _need(cond: bool, key: str, problem: str) -> None:
    if not cond:
        raise ConfigError(key, problem)


def _check_keys(node, schema, prefix: str, free: tuple[str, ...]) -> None:
    for k in node.keys():
        key = f"{prefix}{k}"
        _need(k in schema, key, f"unknown key; allowed {sorted(schema.keys())}")
        if key in free:
            continue
        if isinstance(schema[k], ml_collections.ConfigDict):
            _need(isinstance(node[k], (dict, ml_collections.ConfigDict)), key, "must be a mapping")
            _check_keys(node[k], schema[k], key + ".", free)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _paths(v) -> list[str]:
    return [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else None


def validate_curate_config(c) -> None:
    """Raises ConfigError naming the first bad key (no file is read)."""
    _check_keys(c, curate_base(), "", free=("sources", "decontam.benchmarks"))
    _need(c.kind in R.KINDS, "kind", f"must be one of {R.KINDS}, got {c.kind!r}")
    _need(_is_int(c.seed) and c.seed >= 0, "seed", f"must be an int >= 0, got {c.seed!r}")
    _need(len(c.sources) > 0, "sources", "define at least one source")
    for name, s in c.sources.items():
        k = f"sources.{name}"
        for f in s.keys():
            _need(f in SOURCE_KEYS, f"{k}.{f}", f"unknown key; allowed {sorted(SOURCE_KEYS)}")
        p = _paths(s.get("paths"))
        _need(bool(p) and all(isinstance(x, str) and x for x in p), f"{k}.paths",
              "must be a non-empty list of files / globs")
        dom = s.get("domain")
        _need(isinstance(dom, str) and dom != "", f"{k}.domain", "must be a non-empty string")
        if c.kind != "sft":
            want = c.kind.split("_")[1]
            _need(dom == want, f"{k}.domain", f"must be {want!r} for kind {c.kind!r}, got {dom!r}")
        _need(_is_num(s.get("quality", 0.0)), f"{k}.quality", "must be a number")
        w = s.get("weight", 1.0)
        _need(_is_num(w) and 0 < w <= 1, f"{k}.weight", f"must be a sampling rate in (0, 1], got {w!r}")
        cap = s.get("cap", 0)
        _need(_is_int(cap) and cap >= 0, f"{k}.cap", f"must be an int >= 0 (0 = no cap), got {cap!r}")
    t = c.select.top_n_per_domain
    _need(_is_int(t) and t >= 0, "select.top_n_per_domain", f"must be an int >= 0, got {t!r}")
    for f in ("prompt", "response"):
        _need(isinstance(c.dedup[f], bool), f"dedup.{f}", "must be a bool")
    _need(_is_int(c.dedup.max_unique) and c.dedup.max_unique >= 0, "dedup.max_unique", "must be an int >= 0")
    for name, p in c.decontam.benchmarks.items():
        p = _paths(p)
        _need(bool(p) and all(isinstance(x, str) and x for x in p), f"decontam.benchmarks.{name}",
              "must be a JSONL path or a list of paths / globs")
    _need(_is_int(c.decontam.n) and c.decontam.n >= 1, "decontam.n", "must be an int >= 1")
    _need(isinstance(c.decontam.check_response, bool), "decontam.check_response", "must be a bool")
    lb = c.label
    _need(isinstance(lb.enabled, bool), "label.enabled", "must be a bool")
    _need(not lb.enabled or c.kind == "sft", "label.enabled", "labels teacher traces: only for kind 'sft'")
    for f in ("batch_size", "math_workers", "code_max_tests"):
        _need(_is_int(lb[f]) and lb[f] >= 1, f"label.{f}", f"must be an int >= 1, got {lb[f]!r}")
    _need(_is_int(lb.code_slots) and lb.code_slots >= 0, "label.code_slots", "must be an int >= 0 (0 = cpu count)")
    _need(_is_num(lb.code_timeout_s) and lb.code_timeout_s > 0, "label.code_timeout_s", "must be > 0")
    _need(isinstance(lb.require_open_think, bool), "label.require_open_think", "must be a bool")
    pr = c.pass_rate
    _need(pr.source in PASS_RATE_SOURCES, "pass_rate.source", f"must be one of {PASS_RATE_SOURCES}, got {pr.source!r}")
    for f in ("field", "samples_field"):
        _need(isinstance(pr[f], str) and pr[f] != "", f"pass_rate.{f}", "must be a non-empty string")
    _need(_is_int(pr.batch_size) and pr.batch_size >= 1, "pass_rate.batch_size", "must be an int >= 1")
    if pr.source == "model":
        _validate_model(c)
    d = c.difficulty
    _need(d.source in ("field", "pass_rate"), "difficulty.source", f"must be 'field' or 'pass_rate', got {d.source!r}")
    if c.label.enabled and d.source == "pass_rate":
        _need(pr.source != "none", "difficulty.source", "'pass_rate' needs pass_rate.source 'field', 'samples' or 'model'")
    _need(_is_num(d.hard_min), "difficulty.hard_min", "must be a number")
    _need(_is_num(d.hard_max_pass_rate) and 0 <= d.hard_max_pass_rate <= 1, "difficulty.hard_max_pass_rate",
          "must be in [0, 1]")
    for f in ("keep_incorrect_hard", "keep_incorrect_easy"):
        _need(isinstance(c.retain[f], bool), f"retain.{f}", "must be a bool")
    rf = c.rl_filter
    for f in ("min_pass_rate", "max_pass_rate"):
        _need(_is_num(rf[f]) and 0 <= rf[f] <= 1, f"rl_filter.{f}", f"must be in [0, 1], got {rf[f]!r}")
    _need(rf.min_pass_rate <= rf.max_pass_rate, "rl_filter.min_pass_rate", "must be <= rl_filter.max_pass_rate")
    if c.kind != "sft" and (rf.min_pass_rate > 0 or rf.max_pass_rate < 1):
        _need(pr.source != "none", "rl_filter.min_pass_rate", "a pass-rate band needs pass_rate.source")
    _need(_is_int(rf.min_tests) and rf.min_tests >= 0, "rl_filter.min_tests", "must be an int >= 0")
    o = c.output
    _need(isinstance(o.dir, str) and o.dir != "", "output.dir", "must be a non-empty path")
    n = o.name
    _need(isinstance(n, str) and n[:1].isalpha() and n.replace("_", "a").isalnum() and n.lower() == n,
          "output.name", f"must be lower_snake_case (a TFDS name), got {n!r}")
    _need(isinstance(o.tfds, bool), "output.tfds", "must be a bool")
    if o.tfds:
        _need(isinstance(o.tokenizer, str) and o.tokenizer != "", "output.tokenizer",
              "a tokenizer directory is required when output.tfds is True")
    _need(_is_int(o.max_length) and (o.max_length == 0 or o.max_length >= 2), "output.max_length",
          "must be 0 (no limit) or >= 2")
    _need(o.overlong in ("truncate", "drop"), "output.overlong", "must be 'truncate' or 'drop'")
    _need(_is_num(o.val_fraction) and 0 <= o.val_fraction < 1, "output.val_fraction", "must be in [0, 1)")
    _need(isinstance(o.prompt_template, str) and "{problem}" in o.prompt_template, "output.prompt_template",
          "must contain '{problem}'")
    _need(isinstance(o.drop_fields, (list, tuple)) and all(isinstance(x, str) for x in o.drop_fields),
          "output.drop_fields", "must be a list of field names")
    _need(isinstance(o.overwrite, bool), "output.overwrite", "must be a bool")


def _validate_model(c) -> None:
    """pass_rate.model.* (source 'model'): the reference checkpoint and its sampling."""
    from klear_jax import config_utils as cu
    m, k = c.pass_rate.model, "pass_rate.model"
    ck = m.checkpoint
    _need(isinstance(ck, str) and ck != "", f"{k}.checkpoint",
          "required when pass_rate.source is 'model' (an Orbax params / SFT / RL checkpoint or a HF dir)")
    _need(os.path.isdir(ck), f"{k}.checkpoint", f"directory {ck!r} does not exist")
    _need(m.tokenizer == "" or isinstance(m.tokenizer, str) and os.path.isdir(m.tokenizer), f"{k}.tokenizer",
          f"must be '' (the checkpoint's) or an existing directory, got {m.tokenizer!r}")
    _need(_is_int(m.checkpoint_step), f"{k}.checkpoint_step", "must be an int (-1 = latest)")
    _need(m.dtype in ("float32", "bfloat16", "float16"), f"{k}.dtype", f"must be a float dtype, got {m.dtype!r}")
    for f, lo in (("num_samples", 1), ("max_new_tokens", 1), ("batch_prompts", 1), ("max_prompt_len", 1),
                  ("seed", 0)):
        _need(_is_int(m[f]) and m[f] >= lo, f"{k}.{f}", f"must be an int >= {lo}, got {m[f]!r}")
    _need(_is_num(m.temperature) and m.temperature >= 0, f"{k}.temperature", "must be >= 0 (0 = greedy)")
    _need(_is_num(m.top_p) and 0 < m.top_p <= 1, f"{k}.top_p", f"must be in (0, 1], got {m.top_p!r}")
    _need(isinstance(m.keep_samples, bool), f"{k}.keep_samples", "must be a bool")
    cu.validate_mesh(c, None, key=f"{k}.mesh")


def model_samples(c) -> L.ModelSamples:
    """pass_rate.source 'model' (lazy load); prompts use output.prompt_template, as RL does."""
    m = c.pass_rate.model
    return L.ModelSamples(m.checkpoint, m.tokenizer, m.num_samples, m.temperature, m.top_p,
                          m.max_new_tokens, m.batch_prompts, m.seed, c.output.prompt_template,
                          m.max_prompt_len, m.mesh.to_dict(), m.dtype, m.checkpoint_step)


# ------------------------------------------------------------------------------- sources
def plan_sources(c) -> tuple[list[dict], list[dict]]:
    """(selected, unselected) sources; selection keeps the top_n by quality per domain.
    Both lists are ordered best first (quality descending, then name)."""
    ranked = sorted(({"name": n, "domain": s.domain, "quality": float(s.get("quality", 0.0)),
                      "weight": float(s.get("weight", 1.0)), "cap": int(s.get("cap", 0)),
                      "paths": _paths(s.paths)} for n, s in c.sources.items()),
                    key=lambda s: (-s["quality"], s["name"]))
    per_domain: dict[str, int] = {}
    selected, unselected = [], []
    for s in ranked:
        s["rank_in_domain"] = per_domain[s["domain"]] = per_domain.get(s["domain"], 0) + 1
        top = c.select.top_n_per_domain
        (selected if not top or s["rank_in_domain"] <= top else unselected).append(s)
    return selected, unselected


def iter_source(src: dict, seed: int, strict: bool, counter: S.StepCounter) -> Iterator[R.RawRecord]:
    """One source's records: subsampled at rate `weight`, then at most `cap`; tagged with
    source and domain."""
    paths = R.expand_inputs(src["paths"])
    counter.info.update(files=len(paths), capped=False)
    name, w, cap = src["name"], src["weight"], src["cap"]
    for raw in R.iter_raw_records(paths, strict=strict):
        if cap and counter.kept >= cap:
            counter.info["capped"] = True  # stop reading: the rest of the source is not counted
            return
        counter.seen += 1
        if w < 1 and S.hash64(f"{seed}\0{name}\0{os.path.basename(raw.path)}\0{raw.line}") / 2.0**64 >= w:
            counter.drop("not_sampled", raw.where)
            continue
        if isinstance(raw.data, dict):
            raw.data["source"], raw.data["domain"] = name, src["domain"]
        counter.kept += 1
        yield raw


# ------------------------------------------------------------------------------ pipeline
def build_steps(c, scorers: L.Scorers) -> list:
    """The configured steps, in pipeline order."""
    kind = c.kind
    check = R.sft_messages if kind == "sft" else (lambda d: R.rl_fields(d, kind))
    steps = [S.validate_step(check, c.skip_invalid)]
    if c.dedup.prompt:
        steps.append(S.dedup_step("dedup_prompt", S.prompt_text, c.dedup.max_unique))
    if c.dedup.response and kind == "sft":
        steps.append(S.dedup_step("dedup_response", S.response_text, c.dedup.max_unique))
    if len(c.decontam.benchmarks):
        index = S.load_benchmarks({k: R.expand_inputs(_paths(v)) for k, v in c.decontam.benchmarks.items()},
                                  c.decontam.n)
        steps.append(S.decontam_step(index, c.decontam.check_response))
    if c.rl_filter.min_tests:
        steps.append(L.min_tests_step(c.rl_filter.min_tests))
    if c.label.enabled:
        steps.append(L.label_step(scorers, c.label.batch_size))
    pr = c.pass_rate
    if pr.source != "none":
        model = model_samples(c) if pr.source == "model" else None
        steps.append(L.pass_rate_step(scorers, pr.source, pr.field, pr.samples_field, pr.batch_size,
                                      drop_unrated=kind != "sft", model=model,
                                      keep_samples=pr.source == "model" and pr.model.keep_samples))
    if c.label.enabled:
        d, rt = c.difficulty, c.retain
        steps.append(L.retain_step(d.source, d.field, d.hard_min, d.hard_max_pass_rate,
                                   rt.keep_incorrect_hard, rt.keep_incorrect_easy))
    if kind != "sft" and pr.source != "none":
        steps.append(L.pass_band_step(c.rl_filter.min_pass_rate, c.rl_filter.max_pass_rate))
    return steps


def _records(selected, c, source_counters) -> Iterator[R.RawRecord]:
    for src in selected:
        counter = S.StepCounter(f"source:{src['name']}")
        source_counters.append(counter)
        yield from iter_source(src, c.seed, not c.skip_invalid, counter)


def _markdown(report: dict) -> str:
    lines = [f"# Curation report: {report['name']} ({report['kind']})", "",
             f"Records written: **{report['written']}** to `{report['curated_jsonl']}`", "",
             "## Sources", "", "| source | domain | quality | rank | weight | cap | read | kept | dropped |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in report["sources"]:
        cnt = s.get("counts")
        read, kept = (cnt["seen"], cnt["kept"]) if cnt else ("not selected", 0)
        drop = ", ".join(f"{k}: {v}" for k, v in cnt["dropped"].items()) if cnt else ""
        lines.append(f"| {s['name']} | {s['domain']} | {s['quality']} | {s['rank_in_domain']} | "
                     f"{s['weight']} | {s['cap'] or '-'} | {read} | {kept} | {drop} |")
    lines += ["", "## Steps", "", "| step | seen | kept | dropped (reason: count) | info |", "|---|---|---|---|---|"]
    for st in report["steps"]:
        drop = ", ".join(f"{k}: {v}" for k, v in st["dropped"].items()) or "-"
        info = ", ".join(f"{k}={v}" for k, v in st["info"].items()) or ""
        lines.append(f"| {st['step']} | {st['seen']} | {st['kept']} | {drop} | {info} |")
    if report.get("prepare"):
        lines += ["", "## TFDS dataset", "", f"`{report['prepare']['dir']}`", "", "```",
                  json.dumps(report["prepare"]["splits"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def run(c) -> dict[str, Any]:
    """Validates `c`, runs the pipeline, writes the outputs; returns the report dict."""
    validate_curate_config(c)
    o = c.output
    os.makedirs(o.dir, exist_ok=True)
    jsonl = os.path.join(o.dir, f"{o.name}.curated.jsonl")
    if os.path.exists(jsonl) and not o.overwrite:
        raise FileExistsError(f"{jsonl} already exists (set output.overwrite=True to replace it)")
    selected, unselected = plan_sources(c)
    t0, source_counters, written = time.time(), [], 0
    drop_fields = tuple(o.drop_fields)
    with contextlib.ExitStack() as stack:
        lb = c.label
        scorers = L.Scorers(lb.require_open_think, lb.math_workers, lb.code_timeout_s,
                            lb.code_max_tests, lb.code_slots)
        stack.callback(scorers.close)
        steps = build_steps(c, scorers)
        stack.callback(lambda: os.path.exists(jsonl + ".tmp") and os.remove(jsonl + ".tmp"))
        with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
            for r in S.compose(_records(selected, c, source_counters), steps):
                f.write(json.dumps(L.strip_fields(r.data, drop_fields), ensure_ascii=False) + "\n")
                written += 1
        os.replace(jsonl + ".tmp", jsonl)
    for st in steps:
        if hasattr(st, "table"):
            st.counter.info.update(unique_keys=st.table.size, table_bytes=st.table.nbytes)
    by_name = {cnt.name.split(":", 1)[1]: cnt.to_dict() for cnt in source_counters}
    report: dict[str, Any] = {
        "name": o.name, "kind": c.kind, "seed": c.seed, "curated_jsonl": jsonl, "written": written,
        "seconds": round(time.time() - t0, 2),
        "sources": [dict(s, selected=True, counts=by_name.get(s["name"])) for s in selected]
                   + [dict(s, selected=False, counts=None) for s in unselected],
        "steps": [st.counter.to_dict() for st in steps], "prepare": None,
        "config": json.loads(c.to_json_best_effort()) if hasattr(c, "to_json_best_effort") else None}
    base = os.path.join(o.dir, f"{o.name}_curate_report")
    if o.tfds and written:
        from klear_jax.data.prepare import prepare
        report["prepare"] = prepare([jsonl], o.dir, o.name, c.kind, o.tokenizer, o.max_length or None,
                                    o.overlong, False, o.val_fraction, o.prompt_template, o.overwrite)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(_markdown(report))
    if o.tfds and not written:
        raise ValueError(f"no records left after curation, so no TFDS dataset; see {base}.md")
    return report


def _print_report(report: dict, cfg) -> None:
    for st in report["steps"]:
        log.info("%-16s seen %8d kept %8d dropped %s", st["step"], st["seen"], st["kept"], st["dropped"])
    o = cfg.output
    print(f"wrote {report['written']} records to {report['curated_jsonl']}; report: "
          f"{os.path.join(o.dir, o.name)}_curate_report.md")


if __name__ == "__main__":
    run_config_cli(run, errors=(ConfigError, R.RecordError, FileNotFoundError, FileExistsError,
                                ValueError), report=_print_report)
