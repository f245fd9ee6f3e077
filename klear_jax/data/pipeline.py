"""Deterministic, seeded, checkpointable grain input pipelines over TFDS data sources.

    src = tfds.data_source(name, data_dir=dir)["train"]     # or any random-access source
    it = sft_batches(src, batch_size=8, seq_len=2048, seed=0)
    batch = next(it)            # numpy dict, see pack.finalize_packed
    state = it.get_state()      # JSON-serialisable; it.set_state(state) on a fresh iterator
                                # continues with exactly the same batches

Order of operations (all grain, all deterministic given seed and shard):
  shard (process_index::process_count) -> per-epoch shuffle -> repeat -> truncate/drop
  overlong -> first-fit packing into seq_len rows (grain FirstFitPackIterDataset) ->
  batch -> targets / loss mask / segment ids / positions.
Packing may put sequences of consecutive epochs in the same row (grain's "epoch leakage").
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import grain
import numpy as np

from klear_jax.data.packing import finalize_packed, fit_to_length

OVERLONG = ("truncate", "drop")


def _shard(ds: grain.MapDataset, process_index: int | None, process_count: int | None):
    if process_index is None or process_count is None:
        import jax

        process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if len(ds) < process_count:
        raise ValueError(f"dataset has {len(ds)} records, fewer than {process_count} processes")
    return ds[process_index::process_count]


class CheckpointableIterator:
    """Wraps a grain DatasetIterator; get_state()/set_state() speak JSON-serialisable dicts."""

    def __init__(self, it: grain.DatasetIterator, info: dict[str, Any]):
        self._it, self.info = it, info

    def __iter__(self) -> "CheckpointableIterator":
        return self

    def __next__(self):
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        # Round-trip through JSON so callers can store it anywhere (Orbax JsonSave, a file).
        return json.loads(json.dumps(self._it.get_state(), default=_to_builtin))

    def set_state(self, state: dict[str, Any]) -> None:
        self._it.set_state(state)


def _to_builtin(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"iterator state holds a non-JSON value {x!r} ({type(x).__name__})")


def sft_batches(data_source, batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                num_epochs: int | None = 1, overlong: str = "truncate",
                process_index: int | None = None, process_count: int | None = None,
                num_packing_bins: int | None = None) -> CheckpointableIterator:
    """Packed SFT batches (per process) from a source of {input_ids, loss_mask} records.

    Yields dicts of numpy arrays, each [B, T] with B = batch_size, T = seq_len:
      input_ids int32, targets int32 (next token within the segment, 0 elsewhere),
      loss_mask float32 (on targets: 1 iff the target is a response token of the same
      segment), segment_ids int32 (1.. per row, 0 = padding), positions int32 (restart at 0
      for every segment).
    Sequences longer than seq_len are truncated or dropped (`overlong`); `count_overlong`
    counts them. num_epochs=None repeats forever; the last incomplete batch is dropped.
    process_index/count default to jax.process_index()/process_count().
    num_packing_bins (default max(B, 32)): rows filled at once by first-fit; more bins, less
    padding (8/32/128 bins: 93/96/97.5% of tokens used for 50-1024-token sequences, T=2048).
    """
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size}, {seq_len}")
    ds = _shard(grain.MapDataset.source(data_source), process_index, process_count)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    if overlong == "drop":
        ds = ds.filter(lambda ex: len(ex["input_ids"]) <= seq_len)
    ds = ds.map(lambda ex: fit_to_length(ex, seq_len))
    packed = grain.experimental.FirstFitPackIterDataset(
        ds.to_iter_dataset(),
        length_struct={"input_ids": seq_len, "loss_mask": seq_len},
        num_packing_bins=num_packing_bins or max(batch_size, 32), seed=seed, shuffle_bins=shuffle)
    batches = packed.batch(batch_size, drop_remainder=True).map(finalize_packed)
    info = dict(batch_size=batch_size, seq_len=seq_len, seed=seed, overlong=overlong)
    return CheckpointableIterator(iter(batches), info)


def count_overlong(data_source, seq_len: int, process_index: int | None = None,
                   process_count: int | None = None, length_key: str = "length") -> dict[str, int]:
    """One pass over this process's shard: {'sequences', 'overlong'} (those longer than seq_len).

    Uses the stored `length` feature when present, else the input_ids length.
    """
    ds = _shard(grain.MapDataset.source(data_source), process_index, process_count)
    n = over = 0
    for ex in ds:
        length = int(ex[length_key]) if length_key in ex else len(ex["input_ids"])
        n += 1
        over += length > seq_len
    return {"sequences": n, "overlong": over}


def _decode_text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def decode_rl_example(ex: dict) -> dict[str, Any]:
    """Stored RL record -> {prompt, prompt_ids int32 [T], answer, tests (dict|None), source, difficulty}."""
    tests = _decode_text(ex.get("tests", b""))
    return {"prompt": _decode_text(ex["prompt"]), "prompt_ids": np.asarray(ex["prompt_ids"], np.int32),
            "answer": _decode_text(ex.get("answer", b"")), "tests": json.loads(tests) if tests else None,
            "source": _decode_text(ex.get("source", b"")), "difficulty": float(ex.get("difficulty", np.nan))}


def rl_prompt_batches(data_source, num_prompts: int, seed: int = 0, shuffle: bool = True,
                      num_epochs: int | None = None, max_prompt_length: int | None = None,
                      process_index: int | None = None, process_count: int | None = None,
                      ) -> CheckpointableIterator:
    """Batches of RL prompts: each item is a list of `num_prompts` decoded dicts
    (see decode_rl_example). Prompts longer than max_prompt_length are skipped.
    Incomplete final batches are dropped; num_epochs=None repeats forever.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    ds = _shard(grain.MapDataset.source(data_source), process_index, process_count)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs).map(decode_rl_example)
    if max_prompt_length is not None:
        ds = ds.filter(lambda ex: len(ex["prompt_ids"]) <= max_prompt_length)
    batches = ds.to_iter_dataset().batch(num_prompts, drop_remainder=True, batch_fn=list)
    return CheckpointableIterator(iter(batches), dict(num_prompts=num_prompts, seed=seed))


def iterate_sequences(batch: dict[str, np.ndarray]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Recovers (row, token ids [L], response-token mask [L]) per packed segment of a batch.

    The mask marks tokens that were response tokens in the record, except a segment's first
    token (it is never a target). Used by tests and debugging.
    """
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in np.unique(seg[seg > 0]):
            idx = np.nonzero(seg == s)[0]
            ids = batch["input_ids"][r, idx]
            mask = np.zeros(len(idx), np.float32)
            mask[1:] = batch["loss_mask"][r, idx[:-1]]
            yield r, ids, mask
