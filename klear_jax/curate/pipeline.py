"""Data curation the Klear way: sources -> dedup -> decontamination -> labels -> retention.

    python -m klear_jax.curate --config=configs/curate_example.py \
        [--config.output.dir=DIR --config.sources.<name>.cap=N ...]

A pipeline of small streaming steps (klear_jax/curate/steps.py, label.py), in this order,
each enabled by the config (``klear_jax.curate.config.curate_base()`` lists every key):
  sources        named sources (files / globs, JSONL or Parquet) ranked by `quality`; only
                 the top `select.top_n_per_domain` per domain are read (the paper keeps one
                 or two). Each is subsampled at rate `weight` (a per-record hash of seed,
                 source, file name and line: deterministic, independent of other sources)
                 then truncated to `cap` records (file order). Sources are read one after
                 another, best-ranked first, so on a duplicate the better source's copy wins.
                 Records get `source` (the source's name) and `domain` fields.
  validate       the record schema of `kind` (klear_jax.data.records); a malformed record
                 is an error naming file:line, or with skip_invalid a counted drop.
  dedup_prompt / dedup_response   exact dedup of normalised text (curate_steps docstring);
                 up to `dedup.max_per_prompt` records share a prompt (the paper: 16 traces).
  decontaminate  drop records sharing a word 9-gram with a benchmark problem.
  min_tests      code problems with fewer than `rl_filter.min_tests` tests are dropped.
  label          (sft) teacher traces labelled correct / incorrect with the project rewards.
  pass_rate      a pass rate per problem: a record field, its scored samples, or k scored
                 samples of a reference model (pass_rate.model.*, label.ModelSamples).
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
import os
import time
from typing import Any, Iterator

from klear_jax.curate import label as L
from klear_jax.curate import steps as S
from klear_jax.curate.config import _paths, scorers_from_config, validate_curate_config
from klear_jax.data import records as R
from klear_jax.data.prepare import prepare

log = logging.getLogger(__name__)


def model_samples(c) -> L.ModelSamples:
    """pass_rate.source 'model' (lazy load); prompts use output.prompt_template, as RL does."""
    return L.ModelSamples(c.pass_rate.model, c.output.prompt_template)


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
def build_steps(c, scorers) -> list:
    """The configured steps, in pipeline order."""
    kind = c.kind
    check = R.sft_messages if kind == "sft" else (lambda d: R.rl_fields(d, kind))
    steps = [S.validate_step(check, c.skip_invalid)]
    if c.dedup.prompt:
        steps.append(S.dedup_step("dedup_prompt", S.prompt_text, c.dedup.max_unique,
                                  c.dedup.max_per_prompt))
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
        scorers = scorers_from_config(c)
        stack.callback(scorers.close)
        steps = build_steps(c, scorers)
        stack.callback(lambda: os.path.exists(jsonl + ".tmp") and os.remove(jsonl + ".tmp"))
        with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
            for r in S.compose(_records(selected, c, source_counters), steps):
                kept = {k: v for k, v in r.data.items() if k not in drop_fields}
                f.write(json.dumps(kept, ensure_ascii=False) + "\n")
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
        "config": json.loads(c.to_json_best_effort())}
    base = os.path.join(o.dir, f"{o.name}_curate_report")
    if o.tfds and written:
        report["prepare"] = prepare([jsonl], o.dir, o.name, c.kind, o.tokenizer, o.max_length or None,
                                    o.overlong, False, o.val_fraction, o.prompt_template, o.overwrite)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(_markdown(report))
    if o.tfds and not written:
        raise ValueError(f"no records left after curation, so no TFDS dataset; see {base}.md")
    return report
