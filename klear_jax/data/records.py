"""Streaming readers and validators for HF-style JSONL / Parquet records.

Files are never loaded whole: JSONL is read line by line and Parquet batch by batch
(pyarrow `iter_batches`). Every record carries its origin (file, 1-based line or row), so
a malformed record is reported as `path:line: problem`. Malformed means: a line over
`max_record_bytes` (never read into memory whole: checked before parsing, so before any
tokenising), invalid UTF-8, invalid JSON (including integers over Python's digit limit),
nesting deeper than MAX_DEPTH, or a string holding an unpaired surrogate (`"\\ud800"`).

Record schemas accepted (extra keys are ignored):
  SFT       {"messages": [{"role": ..., "content": ...}, ...]}  or
            {"prompt": str, "response": str, ["system": str]}
  RL math   {"problem" | "prompt": str, "answer": str | number}
  RL code   {"problem" | "prompt": str, "tests" | "input_output": dict | JSON str}
            where tests = {"inputs": [...], "outputs": [...], ["fn_name": str]}
  optional  "source": str, "difficulty": number   (RL kinds)
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from typing import Any, Iterator, Sequence

KINDS = ("sft", "rl_math", "rl_code")
ROLES = ("system", "user", "assistant", "tool")
# Tokenising costs ~170 bytes of memory per byte of text (HF fast tokenizers): `prepare` on
# one 2 MiB SFT record peaks at ~610 MiB, on a 4 MiB one at ~960 MiB. Raise it
# (--max_record_bytes) for rl_code records with large tests: only their prompt is tokenised.
DEFAULT_MAX_RECORD_BYTES = 2 << 20
MAX_DEPTH = 64  # real records nest < 10 deep


class RecordError(ValueError):
    """A malformed record; `str()` is `path:line: problem`."""

    def __init__(self, path: str, line: int, problem: str):
        self.path, self.line, self.problem = path, line, problem
        super().__init__(f"{path}:{line}: {problem}")


@dataclasses.dataclass(frozen=True)
class RawRecord:
    path: str
    line: int  # 1-based line (JSONL) or row (Parquet)
    data: Any  # the decoded JSON value / Parquet row dict (not yet validated)
    error: str | None = None  # set (data None) when the line is not valid JSON and strict=False

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Expands files / globs in order (each glob sorted); errors on a pattern matching nothing."""
    paths: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"input {pattern!r} matches no file")
        paths.extend(matches)
    return paths


def iter_raw_records(paths: Sequence[str], parquet_batch_rows: int = 1024, strict: bool = True,
                     max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[RawRecord]:
    """Yields records one at a time.

    A malformed record (see the module docstring) raises RecordError naming file and line,
    or with strict=False is yielded as a RawRecord whose `error` says what is wrong (so the
    caller can count and skip it).
    """
    for path in paths:
        if path.endswith((".parquet", ".pq")):
            import pyarrow.parquet as pq

            row = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=parquet_batch_rows):
                for data in batch.to_pylist():
                    row += 1
                    problem = check_value(data, max_record_bytes)
                    if problem and strict:
                        raise RecordError(path, row, problem)
                    yield RawRecord(path, row, None if problem else data, problem)
        else:
            with open(path, "rb") as f:
                for lineno, line in _lines(f, max_record_bytes):
                    if isinstance(line, bytes) and not line.strip():
                        continue
                    data, problem = _parse_line(line, max_record_bytes)
                    if problem and strict:
                        raise RecordError(path, lineno, problem)
                    yield RawRecord(path, lineno, data, problem)


def _lines(f, limit: int) -> Iterator[tuple[int, bytes | int]]:
    """(line number, line) of a binary file; a line over `limit` bytes comes as its byte
    count instead, read through in 1 MiB pieces so it is never held whole."""
    lineno = 0
    while line := f.readline(limit + 1):
        lineno += 1
        if len(line) <= limit or line.endswith(b"\n"):
            yield lineno, line
            continue
        size = len(line)
        while (piece := f.readline(1 << 20)):
            size += len(piece)
            if piece.endswith(b"\n"):
                break
        yield lineno, size


def _parse_line(line: bytes | int, limit: int) -> tuple[Any, str | None]:
    """(value, None) or (None, problem)."""
    if isinstance(line, int):
        return None, f"record is {line} bytes, over the {limit}-byte limit (max_record_bytes)"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start} ({e.reason})"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} (column {e.colno})"
    except RecursionError:
        return None, f"nested deeper than {MAX_DEPTH} levels"
    except ValueError as e:  # e.g. an integer over Python's 4300-digit limit
        return None, f"invalid JSON: {e}"
    return (None, problem) if (problem := check_value(data)) else (data, None)


def check_value(value: Any, max_bytes: int | None = None) -> str | None:
    """The problem with a decoded record (nesting over MAX_DEPTH, an unpaired surrogate, or
    strings over `max_bytes` in total), or None. Iterative: deep values cannot overflow it."""
    stack, size = [(value, 1)], 0
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, str):
            try:
                size += len(v.encode("utf-8"))
            except UnicodeEncodeError as e:
                return f"string with an unpaired surrogate ({v[e.start]!r})"
    if max_bytes is not None and size > max_bytes:
        return f"record is {size} bytes of text, over the {max_bytes}-byte limit (max_record_bytes)"
    return None


# ----------------------------------------------------------------------------- validation


def _require_str(d: dict, key: str, allow_empty: bool = False) -> str:
    if key not in d or d[key] is None:
        raise ValueError(f"missing field {key!r}")
    v = d[key]
    if not isinstance(v, str):
        raise ValueError(f"field {key!r} must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise ValueError(f"field {key!r} is empty")
    return v


def _messages(d: dict) -> list[dict[str, str]]:
    msgs = d["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("field 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def sft_messages(d: Any) -> list[dict[str, str]]:
    """Normalises an SFT record to chat messages; raises ValueError with the problem."""
    if not isinstance(d, dict):
        raise ValueError(f"record must be a JSON object, got {type(d).__name__}")
    if "messages" in d:
        msgs = _messages(d)
    elif "prompt" in d or "response" in d:
        msgs = []
        if d.get("system") is not None:
            msgs.append({"role": "system", "content": _require_str(d, "system", allow_empty=True)})
        msgs.append({"role": "user", "content": _require_str(d, "prompt")})
        msgs.append({"role": "assistant", "content": _require_str(d, "response")})
    else:
        raise ValueError("SFT record needs 'messages' or 'prompt'/'response' fields")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("SFT record has no assistant message (nothing to learn)")
    return msgs


def _prompt_messages(d: dict) -> list[dict[str, str]]:
    if "messages" in d:
        msgs = _messages(d)
        if msgs[-1]["role"] == "assistant":  # a reference solution; the prompt is what precedes it
            msgs = msgs[:-1]
        if not msgs or msgs[-1]["role"] != "user":
            raise ValueError("RL 'messages' must end with a user turn (optionally followed by one assistant turn)")
        return msgs
    key = "problem" if "problem" in d else "prompt"
    return [{"role": "user", "content": _require_str(d, key)}]


def parse_tests(d: dict) -> dict:
    """A record's test cases ('tests' or APPS/TACO 'input_output', a dict or its JSON string),
    validated -> {inputs, outputs, [fn_name]}; ValueError naming the field otherwise."""
    key = "tests" if "tests" in d else "input_output"
    if key not in d or d[key] is None:
        raise ValueError("missing field 'tests' (or 'input_output')")
    t = d[key]
    if isinstance(t, str):
        try:
            t = json.loads(t)
        except json.JSONDecodeError as e:
            raise ValueError(f"field {key!r} is not valid JSON: {e.msg}") from None
        except (RecursionError, ValueError) as e:
            raise ValueError(f"field {key!r} is not valid JSON: {type(e).__name__}") from None
        if problem := check_value(t):
            raise ValueError(f"field {key!r}: {problem}")
    if not isinstance(t, dict):
        raise ValueError(f"field {key!r} must be an object, got {type(t).__name__}")
    ins, outs = t.get("inputs"), t.get("outputs")
    if not isinstance(ins, list) or not isinstance(outs, list):
        raise ValueError(f"field {key!r} needs 'inputs' and 'outputs' lists")
    if len(ins) != len(outs):
        raise ValueError(f"field {key!r}: {len(ins)} inputs but {len(outs)} outputs")
    if not ins:
        raise ValueError(f"field {key!r} has no test cases")
    if "fn_name" in t and not isinstance(t["fn_name"], str):
        raise ValueError(f"field {key!r}: 'fn_name' must be a string")
    return t


def _finite(answer: str) -> bool:
    """False for answers that read as a non-finite number: NaN, inf, 1e999 (strings or JSON
    numbers); integers of any length are finite."""
    try:
        value = float(answer)
    except ValueError:
        return True  # not a plain number (an expression, an interval, ...)
    return math.isfinite(value) or answer.strip().lstrip("+-").isdigit()


def rl_fields(d: Any, kind: str) -> dict[str, Any]:
    """Validates an RL record -> {messages, answer, tests, source, difficulty}.

    answer is '' for code, tests is None for math; difficulty is NaN when absent.
    """
    if not isinstance(d, dict):
        raise ValueError(f"record must be a JSON object, got {type(d).__name__}")
    out: dict[str, Any] = {"messages": _prompt_messages(d), "answer": "", "tests": None}
    if kind == "rl_math":
        a = d.get("answer")
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise ValueError("field 'answer' must be a string or number" if a is not None else "missing field 'answer'")
        out["answer"] = str(a)
        if not out["answer"].strip():
            raise ValueError("field 'answer' is empty")
        if not _finite(out["answer"]):
            raise ValueError(f"field 'answer' is not finite ({out['answer'][:20]!r}): no answer can equal it")
    elif kind == "rl_code":
        out["tests"] = parse_tests(d)
    else:
        raise ValueError(f"unknown RL kind {kind!r}")
    src = d.get("source", "")
    if src is None:
        src = ""
    if not isinstance(src, str):
        raise ValueError(f"field 'source' must be a string, got {type(src).__name__}")
    out["source"] = src
    diff = d.get("difficulty")
    if diff is None:
        out["difficulty"] = math.nan
    elif isinstance(diff, bool) or not isinstance(diff, (int, float)):
        raise ValueError(f"field 'difficulty' must be a number, got {type(diff).__name__}")
    else:
        out["difficulty"] = float(diff)
    return out
