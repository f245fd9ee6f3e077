"""JSONL / Parquet records -> a TFDS dataset in ArrayRecord format.

    python -m klear_jax.data.prepare --input data/*.jsonl --output_dir DIR --name NAME \
        --kind sft|rl_math|rl_code --tokenizer TOKDIR [--max_length N] [--skip_invalid] \
        [--val_fraction F] [--overlong truncate|drop] [--prompt_template '{problem} ...'] \
        [--max_record_bytes B] [--overwrite]

Read it back with `tfds.data_source(NAME, data_dir=DIR)` or
`tfds.builder_from_directory(DIR/NAME/1.0.0).as_data_source()`; no TensorFlow needed.

Why a GeneratorBasedBuilder: with tensorflow-datasets 4.9.10 and no TensorFlow installed, a
builder class with `file_format="array_record"` writes, shuffles and shards examples
(serialised with tfds' own protos, no TF) and produces dataset_info.json / features.json, so
the directory is a complete TFDS dataset that `tfds.data_source` opens in a fresh process.
The class is created per call (`skip_registration`) so the dataset name comes from the CLI.

Stored features
  sft:     input_ids int32[T], loss_mask uint8[T] (1 = assistant token), length, source
  rl_*:    prompt (text of the last user turn), prompt_ids int32[T] (chat-templated, ends with
           the assistant header), answer (math; '' for code), tests (JSON string; '' for
           math), source, difficulty float32 (NaN if absent), length
A report {split: {read, kept, truncated, dropped, invalid}, ...} is written as JSON to
DIR/NAME_report.json and beside the data files.

A malformed record (records.py: bad JSON or UTF-8, too deep, over --max_record_bytes, which
is checked before any tokenising; a field of the wrong type; a non-finite gold answer) stops
the run with `file:line: problem`, or with --skip_invalid is counted under "invalid" and
skipped. The dataset is built in a temporary directory beside DIR/NAME and moved into place
only when complete, so a failed run, with or without --overwrite, leaves any previous
dataset and its report as they were.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Sequence

import numpy as np

from klear_jax import logs
from klear_jax.data import records as R
from klear_jax.data import tokenizer as tk

VERSION = "1.0.0"
log = logging.getLogger(__name__)


def _features(kind: str):
    import tensorflow_datasets as tfds

    f = tfds.features
    ids = lambda: f.Tensor(shape=(None,), dtype=np.int32)  # noqa: E731
    if kind == "sft":
        d = {"input_ids": ids(), "loss_mask": f.Tensor(shape=(None,), dtype=np.uint8),
             "length": np.int32, "source": f.Text()}
    else:
        d = {"prompt": f.Text(), "prompt_ids": ids(), "answer": f.Text(), "tests": f.Text(),
             "source": f.Text(), "difficulty": np.float32, "length": np.int32}
    return f.FeaturesDict(d)


def split_of(key: str, val_fraction: float) -> str:
    """Stable split assignment from a record's key (no need to hold records in memory)."""
    if val_fraction <= 0:
        return "train"
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64
    return "validation" if h < val_fraction else "train"


def sft_example(tok, messages, max_length: int | None, overlong: str, name: str):
    """-> (example | None, status in {'kept','truncated','dropped'})."""
    ids, mask = tk.sft_ids_and_mask(tok, messages, name=name)
    status = "kept"
    if max_length is not None and len(ids) > max_length:
        if overlong == "drop":
            return None, "dropped"
        ids, mask, status = ids[:max_length], mask[:max_length], "truncated"
    if not mask.any():
        return None, "dropped"  # nothing left to learn from after truncation
    return {"input_ids": ids, "loss_mask": mask, "length": len(ids), "source": ""}, status


def rl_example(tok, fields: dict, max_length: int | None, prompt_template: str):
    msgs = [dict(m) for m in fields["messages"]]
    text = prompt_template.replace("{problem}", msgs[-1]["content"])
    msgs[-1]["content"] = text
    ids = tk.prompt_ids(tok, msgs)
    if max_length is not None and len(ids) > max_length:
        return None, "dropped"  # a truncated prompt is a different problem
    tests = "" if fields["tests"] is None else json.dumps(fields["tests"])
    return {"prompt": text, "prompt_ids": ids, "answer": fields["answer"], "tests": tests,
            "source": fields["source"], "difficulty": np.float32(fields["difficulty"]),
            "length": len(ids)}, "kept"


def _convert(raw: R.RawRecord, kind: str, tok, cfg: dict):
    if raw.error is not None:
        raise ValueError(raw.error)
    if kind == "sft":
        ex, status = sft_example(tok, R.sft_messages(raw.data), cfg["max_length"], cfg["overlong"], raw.where)
        if ex is not None and isinstance(raw.data.get("source"), str):
            ex["source"] = raw.data["source"]
        return ex, status
    return rl_example(tok, R.rl_fields(raw.data, kind), cfg["max_length"], cfg["prompt_template"])


def _make_builder_cls(name: str, kind: str, records_fn, tok, cfg: dict, report: dict):
    import tensorflow_datasets as tfds

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=_features(kind),
            description=f"klear_jax {kind} dataset prepared by klear_jax.data.prepare",
            metadata=tfds.core.MetadataDict(kind=kind, tokenizer=os.path.abspath(cfg["tokenizer"]),
                                            max_length=cfg["max_length"]))

    def _split_generators(self, dl_manager):
        splits = ["train"] + (["validation"] if cfg["val_fraction"] > 0 else [])
        return {s: self._generate_examples(s) for s in splits}

    def _generate_examples(self, split):
        counts = report.setdefault(split, {k: 0 for k in ("read", "kept", "truncated", "dropped", "invalid")})
        for n, raw in enumerate(records_fn()):
            key = f"{n}:{raw.where}"
            if split_of(key, cfg["val_fraction"]) != split:
                continue
            counts["read"] += 1
            try:
                ex, status = _convert(raw, kind, tok, cfg)
            except ValueError as e:
                if not cfg["skip_invalid"]:
                    raise R.RecordError(raw.path, raw.line, str(e)) from None
                counts["invalid"] += 1
                if counts["invalid"] <= 20:
                    log.warning("skipping invalid record %s: %s", raw.where, e)
                continue
            counts[status] += 1
            if ex is not None:
                if status == "truncated":
                    counts["kept"] += 1
                yield key, ex

    attrs = dict(name=name, VERSION=tfds.core.Version(VERSION), _info=_info,
                 _split_generators=_split_generators, _generate_examples=_generate_examples)
    return type("KlearPreparedDataset", (tfds.core.GeneratorBasedBuilder,), attrs, skip_registration=True)


def prepare(inputs: Sequence[str], output_dir: str, name: str,
            kind: str, tokenizer: str, max_length: int | None = None, overlong: str = "truncate",
            skip_invalid: bool = False, val_fraction: float = 0.0, prompt_template: str = "{problem}",
            overwrite: bool = False, max_record_bytes: int = R.DEFAULT_MAX_RECORD_BYTES) -> dict[str, Any]:
    """Writes the TFDS dataset DIR/NAME/1.0.0 and returns the counts report.

    `inputs` are file paths / globs (JSONL, or .parquet).
    Raises RecordError (file:line: problem) on the first malformed record unless skip_invalid.
    Nothing in DIR changes unless the whole dataset was written.
    """
    import tensorflow_datasets as tfds

    if kind not in R.KINDS:
        raise ValueError(f"kind must be one of {R.KINDS}, got {kind!r}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if kind != "sft" and "{problem}" not in prompt_template:
        raise ValueError("prompt_template must contain '{problem}'")
    if not name or not name.replace("_", "a").isalnum() or not name[0].isalpha() or name.lower() != name:
        raise ValueError(f"name must be lower_snake_case (TFDS dataset name), got {name!r}")
    paths = R.expand_inputs(inputs)
    records_fn = lambda: R.iter_raw_records(  # noqa: E731
        paths, strict=not skip_invalid, max_record_bytes=max_record_bytes)
    version_dir = os.path.join(output_dir, name, VERSION)
    if os.path.exists(version_dir) and not overwrite:
        raise FileExistsError(f"{version_dir} already exists (pass --overwrite to replace it)")
    tok = tk.load_tokenizer(tokenizer)
    cfg = dict(max_length=max_length, overlong=overlong, skip_invalid=skip_invalid,
               val_fraction=val_fraction, prompt_template=prompt_template, tokenizer=tokenizer,
               max_record_bytes=max_record_bytes)
    report: dict[str, Any] = {}
    tfds.disable_progress_bar()
    os.makedirs(output_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.incomplete-", dir=output_dir)
    try:
        builder = _make_builder_cls(name, kind, records_fn, tok, cfg, report)(
            data_dir=tmp, file_format="array_record")
        with contextlib.redirect_stdout(io.StringIO()) as tfds_said:  # "Downloading and..."
            builder.download_and_prepare(download_dir=os.path.join(tmp, "downloads"))
        log.debug("tfds: %s", tfds_said.getvalue().strip())
        report = {"name": name, "kind": kind, "dir": version_dir, "config": cfg, "splits": report}
        built = os.path.join(tmp, name, VERSION)
        _write_json(os.path.join(built, "prepare_report.json"), report)
        # Renames only: were the process to die between the two, the previous dataset
        # would be left in the temporary directory, not lost.
        if os.path.exists(version_dir):
            os.rename(version_dir, os.path.join(tmp, "previous"))
        os.makedirs(os.path.dirname(version_dir), exist_ok=True)
        os.rename(built, version_dir)
        _write_json(os.path.join(output_dir, f"{name}_report.json"), report)
        log.info("prepared %s: %s examples -> %s", name, ", ".join(
            f"{split} {r['kept'] + r['truncated']}" for split, r in report["splits"].items()),
            version_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _write_json(path: str, obj) -> None:
    """Writes JSON atomically: a reader sees the old file or the new one, never a part."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m klear_jax.data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--input", action="append", required=True, help="JSONL/Parquet file or glob (repeatable)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--name", required=True, help="TFDS dataset name (lower_snake_case)")
    p.add_argument("--kind", required=True, choices=R.KINDS)
    p.add_argument("--tokenizer", required=True, help="local transformers tokenizer directory")
    p.add_argument("--max_length", type=int, default=None)
    p.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                   help="SFT sequences over max_length (RL prompts over it are always dropped)")
    p.add_argument("--skip_invalid", action="store_true", help="count and skip malformed records")
    p.add_argument("--val_fraction", type=float, default=0.0)
    p.add_argument("--prompt_template", default="{problem}", help="RL: wraps the problem text")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR/NAME/1.0.0 (only once the new dataset is complete)")
    p.add_argument("--max_record_bytes", type=int, default=R.DEFAULT_MAX_RECORD_BYTES,
                   help="longer JSONL lines / Parquet rows are invalid (checked before parsing)")
    logs.add_argument(p)
    a = p.parse_args(argv)
    logs.setup(a.verbosity)
    try:
        report = prepare(a.input, a.output_dir, a.name, a.kind, a.tokenizer, a.max_length, a.overlong,
                         a.skip_invalid, a.val_fraction, a.prompt_template, a.overwrite,
                         a.max_record_bytes)
    except (R.RecordError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report["splits"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
