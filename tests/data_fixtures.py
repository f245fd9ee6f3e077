"""Shared fixtures for the data tests: a tiny tokenizer trained once per session, and
generated JSONL records (math-like SFT conversations, RL math and code problems)."""
import json
import random
from typing import Iterator

import numpy as np
import pytest

from klear_jax.data import tokenizer as tk

_WORDS = ["the", "cat", "sat", "on", "mat", "add", "two", "numbers", "answer", "is", "def",
          "return", "print", "input", "python", "step", "so", "we", "get", "boxed"]


def sample_text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS + [str(rng.randint(0, 99))]) for _ in range(n))


def sft_record(rng: random.Random, chat: bool) -> dict:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    prompt = f"What is {a} + {b}? " + sample_text(rng, rng.randint(0, 6))
    response = f"<think>\n{a} plus {b} {sample_text(rng, rng.randint(0, 8))}</think>\n\\boxed{{{a + b}}}"
    if chat:
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]}
    return {"prompt": prompt, "response": response}


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    rng = random.Random(0)
    texts = [sample_text(rng, 30) for _ in range(300)] + [
        json.dumps(sft_record(rng, True)) for _ in range(100)]
    out = tmp_path_factory.mktemp("tok")
    tk.train_tokenizer(texts, vocab_size=400, out_dir=str(out))
    return str(out)


@pytest.fixture(scope="session")
def tok(tok_dir):
    return tk.load_tokenizer(tok_dir)


@pytest.fixture(scope="session")
def sft_dataset(tmp_path_factory, tok_dir):
    """A TFDS dir holding ``tiny_sft``: 64 generated chat records, prepared with tok_dir."""
    from klear_jax.data.prepare import prepare
    d = tmp_path_factory.mktemp("sft_data")
    rng = random.Random(0)
    src = write_jsonl(d / "train.jsonl", [sft_record(rng, True) for _ in range(64)])
    prepare([src], str(d / "tfds"), "tiny_sft", "sft", tok_dir)
    return str(d / "tfds")


def iterate_sequences(batch: dict[str, np.ndarray]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Recovers (row, token ids [L], response-token mask [L]) per packed segment of a batch.

    The mask marks tokens that were response tokens in the record, except a segment's first
    token (it is never a target).
    """
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in np.unique(seg[seg > 0]):
            idx = np.nonzero(seg == s)[0]
            ids = batch["input_ids"][r, idx]
            mask = np.zeros(len(idx), np.float32)
            mask[1:] = batch["loss_mask"][r, idx[:-1]]
            yield r, ids, mask
