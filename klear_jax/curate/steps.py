"""Curation steps: small generator transforms over records, each counting what it drops.

A step is a callable `step(items) -> items` over `records.RawRecord`s (path, line, data);
it yields the records it keeps and tallies the others in `step.counter` by reason (with a
few `path:line` examples per reason). Steps never hold more than one record, except the
batched ones (`Batched`), which hold one batch. Annotations are written into `record.data`.

Text normalisation (`normalize`), used by deduplication and decontamination, exactly:
  1. `str.lower()`;
  2. every code point in a Unicode punctuation category (P*: . , ; : ! ? ' " ( ) [ ] { } - _
     / \\ @ # % & * ...) becomes a space; symbols (S*: + = < > $ ^ | ~ ...) and digits stay;
  3. runs of whitespace collapse to one space, ends stripped.
So "The  CAT's (x-1)!" -> "the cat s x 1". Words are the space-separated tokens of that.

Dedup memory: keys are 8-byte blake2b digests of the normalised text kept in `HashSet64`,
an open-addressing table of uint64 slots at most half full: 16 to 32 bytes per unique key
(plus the old table, half the size, during a resize). Two different texts collide with
probability about n^2 / 2^65 (1e-5 at n = 10M), which would wrongly drop one of them.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import sys
import unicodedata
from array import array
from typing import Any, Callable, Iterable, Iterator, Sequence

from klear_jax.data.records import RawRecord, RecordError, iter_raw_records

MAX_EXAMPLES = 3  # record locations kept per drop reason, for the report


# ------------------------------------------------------------------------ text helpers
@functools.cache
def _punct_table() -> dict[int, str]:
    return {cp: " " for cp in range(sys.maxunicode + 1)
            if unicodedata.category(chr(cp)).startswith("P")}


_ASCII_PUNCT = bytes(c for c in range(128) if unicodedata.category(chr(c)).startswith("P"))
_ASCII_TABLE = bytes.maketrans(_ASCII_PUNCT, b" " * len(_ASCII_PUNCT))


def words(text: str) -> list[str]:
    """Lowercased words with punctuation stripped (see the module docstring)."""
    t = text.lower()
    if t.isascii():  # same rule through a byte table: several times faster than str.translate
        return t.encode("ascii").translate(_ASCII_TABLE).decode("ascii").split()
    return t.translate(_punct_table()).split()


def normalize(text: str) -> str:
    return " ".join(words(text))


def hash64(text: str) -> int:
    """A non-zero 64-bit blake2b digest of `text` (0 marks an empty HashSet64 slot)."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h or 1


def prompt_text(d: dict) -> str:
    """The problem/prompt text: non-assistant message contents, or problem / prompt."""
    if "messages" in d:
        return "\n".join(m["content"] for m in d["messages"] if m.get("role") != "assistant")
    return d["problem"] if "problem" in d else d["prompt"]


def response_text(d: dict) -> str:
    """The teacher trace: assistant message contents, or `response` ('' when absent)."""
    if "messages" in d:
        return "\n".join(m["content"] for m in d["messages"] if m.get("role") == "assistant")
    return d.get("response") or ""


class HashSet64:
    """A set of non-zero 64-bit ints in an `array('Q')` (8 bytes a slot, <= 50% full).

    `add(h)` -> True if h was new. With `max_size` > 0, adding key number max_size + 1
    raises OverflowError, so memory is bounded by configuration.
    """

    def __init__(self, max_size: int = 0, capacity: int = 1 << 16):
        self.max_size, self.size = max_size, 0
        self._slots = array("Q", bytes(8 * capacity))
        self._mask = capacity - 1

    @property
    def nbytes(self) -> int:
        return len(self._slots) * 8

    def _insert(self, slots, mask: int, h: int) -> bool:
        i = h & mask
        while True:
            v = slots[i]
            if v == 0:
                slots[i] = h
                return True
            if v == h:
                return False
            i = (i + 1) & mask

    def add(self, h: int) -> bool:
        if not self._insert(self._slots, self._mask, h):
            return False
        self.size += 1
        if self.max_size and self.size > self.max_size:
            raise OverflowError(f"more than {self.max_size} unique keys (dedup.max_unique)")
        if 2 * self.size > len(self._slots):
            old, cap = self._slots, 2 * len(self._slots)
            self._slots, self._mask = array("Q", bytes(8 * cap)), cap - 1
            for v in old:
                if v:
                    self._insert(self._slots, self._mask, v)
        return True


# ---------------------------------------------------------------------- counting steps
@dataclasses.dataclass
class StepCounter:
    name: str
    seen: int = 0
    kept: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: dict = dataclasses.field(default_factory=dict)
    info: dict = dataclasses.field(default_factory=dict)

    def drop(self, reason: str, where: str) -> None:
        self.dropped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.name, "seen": self.seen, "kept": self.kept,
                "dropped": dict(sorted(self.dropped.items())),
                "examples": {k: v for k, v in sorted(self.examples.items())}, "info": self.info}


Decide = Callable[[RawRecord], "str | None"]


class Filter:
    """Keeps a record when `decide(record)` returns None; else drops it for that reason."""

    def __init__(self, name: str, decide: Decide):
        self.counter, self.decide = StepCounter(name), decide

    def __call__(self, items: Iterable[RawRecord]) -> Iterator[RawRecord]:
        c = self.counter
        for r in items:
            c.seen += 1
            reason = self.decide(r)
            if reason is None:
                c.kept += 1
                yield r
            else:
                c.drop(reason, r.where)


class Batched:
    """Like Filter, but `decide_batch(records) -> [reason | None]` sees `batch_size` at once
    (so rewards are scored concurrently). Memory: one batch of records."""

    def __init__(self, name: str, decide_batch: Callable[[list], list], batch_size: int):
        self.counter, self.decide_batch, self.batch_size = StepCounter(name), decide_batch, batch_size

    def _flush(self, batch: list) -> Iterator[RawRecord]:
        for r, reason in zip(batch, self.decide_batch(batch)):
            if reason is None:
                self.counter.kept += 1
                yield r
            else:
                self.counter.drop(reason, r.where)

    def __call__(self, items: Iterable[RawRecord]) -> Iterator[RawRecord]:
        batch: list[RawRecord] = []
        for r in items:
            self.counter.seen += 1
            batch.append(r)
            if len(batch) >= self.batch_size:
                yield from self._flush(batch)
                batch = []
        if batch:
            yield from self._flush(batch)


def compose(items: Iterable[RawRecord], steps: Sequence[Callable]) -> Iterator[RawRecord]:
    for step in steps:
        items = step(items)
    return iter(items)


# ----------------------------------------------------------------------------- steps
def validate_step(check: Callable[[Any], Any], skip_invalid: bool) -> Filter:
    """Schema check (`check(data)` raises ValueError); malformed -> RecordError path:line,
    or with skip_invalid a drop for reason 'invalid'."""

    def decide(r: RawRecord):
        try:
            if r.error is not None:
                raise ValueError(r.error)
            check(r.data)
        except ValueError as e:
            if not skip_invalid:
                raise RecordError(r.path, r.line, str(e)) from None
            return "invalid"
        return None

    return Filter("validate", decide)


def dedup_step(name: str, text_fn: Callable[[dict], str], max_unique: int = 0,
               max_copies: int = 1) -> Filter:
    """Drops a record whose normalised `text_fn(data)` was already kept `max_copies` times
    ('duplicate'; 1 = exact dedup; e.g. 16 keeps up to 16 teacher traces per prompt, 0 =
    unbounded). Empty texts (e.g. no response) are never duplicates. Copy j of a text is
    the key (digest, j), so the table holds one key per kept copy."""
    table = HashSet64(max_unique)

    def decide(r: RawRecord):
        text = normalize(text_fn(r.data))
        if not text or max_copies == 0:
            return None
        h = hash64(text)
        for j in range(max_copies):  # the first free copy slot (j = 0 is the digest itself)
            if table.add((h ^ (j * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF or 1):
                return None
        return "duplicate"

    step = Filter(name, decide)
    step.table = table
    return step


class NgramIndex:
    """Word n-grams of benchmark problems -> the first benchmark holding each one."""

    def __init__(self, n: int = 9):
        self.n, self.grams, self.problems = n, {}, collections.Counter()

    def add(self, text: str, benchmark: str) -> None:
        w = words(text)
        self.problems[benchmark] += 1
        for i in range(len(w) - self.n + 1):
            self.grams.setdefault(tuple(w[i:i + self.n]), benchmark)

    def match(self, text: str) -> str | None:
        """The benchmark sharing a word n-gram with `text`, or None (texts under n words never match)."""
        w, n, grams = words(text), self.n, self.grams
        for i in range(len(w) - n + 1):
            hit = grams.get(tuple(w[i:i + n]))
            if hit is not None:
                return hit
        return None


BENCH_FIELDS = ("problem", "prompt", "question")


def load_benchmarks(benchmarks: dict[str, Sequence[str]], n: int = 9) -> NgramIndex:
    """{name: [jsonl paths]} -> NgramIndex over each record's problem / prompt / question
    (the first present). A record with none of them is a RecordError (file:line)."""
    index = NgramIndex(n)
    for name, paths in benchmarks.items():
        for raw in iter_raw_records(paths):
            d = raw.data
            field = next((f for f in BENCH_FIELDS if isinstance(d, dict) and isinstance(d.get(f), str)), None)
            if field is None:
                raise RecordError(raw.path, raw.line, f"benchmark record needs a string field, one of {BENCH_FIELDS}")
            index.add(d[field], name)
    return index


def decontam_step(index: NgramIndex, check_response: bool) -> Filter:
    """Drops a record sharing a word n-gram with a benchmark: reason 'contaminated:<name>'."""

    def decide(r: RawRecord):
        hit = index.match(prompt_text(r.data))
        if hit is None and check_response:
            hit = index.match(response_text(r.data))
        return None if hit is None else f"contaminated:{hit}"

    step = Filter("decontaminate", decide)
    step.counter.info.update(n=index.n, benchmark_problems=dict(index.problems),
                             benchmark_ngrams=len(index.grams))
    return step
