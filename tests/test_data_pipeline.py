"""Packed SFT batches and RL prompt batches: correctness, determinism, sharding, resume."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from klear_jax.data.pipeline import count_overlong, iterate_sequences, rl_prompt_batches, sft_batches


def make_source(n, max_len=20, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(2, max_len + 1))
        ids = rng.integers(5, 1000, L).astype(np.int32)
        ids[0] = 1000 + i  # unique first token identifies the record
        mask = np.zeros(L, np.uint8)
        mask[int(rng.integers(1, L)):] = 1
        out.append({"input_ids": ids, "loss_mask": mask, "length": np.int32(L)})
    return out


def all_batches(it):
    return [b for b in it]


def check_batch_invariants(b, B, T):
    for k, dt in [("input_ids", np.int32), ("targets", np.int32), ("loss_mask", np.float32),
                  ("segment_ids", np.int32), ("positions", np.int32)]:
        assert b[k].shape == (B, T) and b[k].dtype == dt, k
    seg, pos = b["segment_ids"], b["positions"]
    for r in range(B):
        for t in range(T):
            if seg[r, t] == 0:
                assert b["loss_mask"][r, t] == 0 and b["targets"][r, t] == 0
            elif t == 0 or seg[r, t - 1] != seg[r, t]:
                assert pos[r, t] == 0
            else:
                assert pos[r, t] == pos[r, t - 1] + 1
            last_of_segment = t == T - 1 or seg[r, t + 1] != seg[r, t]
            if last_of_segment:  # no target crosses a segment boundary
                assert b["loss_mask"][r, t] == 0 and b["targets"][r, t] == 0
            else:
                assert b["targets"][r, t] == b["input_ids"][r, t + 1]


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_packing_reproduces_sequences_and_masks(overlong):
    src, T = make_source(60, max_len=24), 16
    batches = all_batches(sft_batches(src, batch_size=1, seq_len=T, shuffle=False, overlong=overlong,
                                      process_index=0, process_count=1))
    got = {}
    for b in batches:
        check_batch_invariants(b, 1, T)
        for _, ids, mask in iterate_sequences(b):
            got[int(ids[0])] = (ids, mask)
    expect = {}
    for ex in src:
        if overlong == "drop" and len(ex["input_ids"]) > T:
            continue
        m = ex["loss_mask"][:T].astype(np.float32)
        m[0] = 0
        expect[int(ex["input_ids"][0])] = (ex["input_ids"][:T], m)
    assert sorted(got) == sorted(expect)
    for k, (ids, mask) in expect.items():
        np.testing.assert_array_equal(got[k][0], ids)
        np.testing.assert_array_equal(got[k][1], mask)
    n_over = sum(len(ex["input_ids"]) > T for ex in src)
    assert 0 < n_over and count_overlong(src, T, 0, 1) == {"sequences": 60, "overlong": n_over}
    assert sum(b["segment_ids"].max() for b in batches) > len(batches)  # rows really hold several


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=1, max_size=30), st.integers(12, 20), st.integers(1, 3))
def test_packing_property(lengths, T, B):
    src = []
    for i, L in enumerate(lengths):
        ids = np.arange(L, dtype=np.int32) + 100 * (i + 1)
        src.append({"input_ids": ids, "loss_mask": (np.arange(L) % 2).astype(np.uint8)})
    seen = []
    for b in sft_batches(src, batch_size=B, seq_len=T, seed=3, process_index=0, process_count=1):
        check_batch_invariants(b, B, T)
        for _, ids, mask in iterate_sequences(b):
            i = int(ids[0]) // 100 - 1
            np.testing.assert_array_equal(ids, src[i]["input_ids"])
            exp = src[i]["loss_mask"].astype(np.float32); exp[0] = 0
            np.testing.assert_array_equal(mask, exp)
            seen.append(i)
    assert len(seen) == len(set(seen))  # each at most once (a final partial batch is dropped)


def test_resume_gives_identical_batches():
    src = make_source(50)
    kw = dict(batch_size=3, seq_len=16, seed=7, num_epochs=None, process_index=0, process_count=1)
    ref = sft_batches(src, **kw)
    ref_batches = [next(ref) for _ in range(30)]
    it = sft_batches(src, **kw)
    for _ in range(12):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # must survive JSON
    fresh = sft_batches(src, **kw)
    fresh.set_state(state)
    for want in ref_batches[12:]:
        got = next(fresh)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_seeded_determinism_and_sharding():
    src = make_source(40)
    kw = dict(batch_size=1, seq_len=16, num_epochs=1)
    firsts = lambda it: sorted(int(ids[0]) for b in it for _, ids, _ in iterate_sequences(b))  # noqa: E731
    a = [b["input_ids"] for b in sft_batches(src, seed=1, process_index=0, process_count=1, **kw)]
    b = [b["input_ids"] for b in sft_batches(src, seed=1, process_index=0, process_count=1, **kw)]
    c = [b["input_ids"] for b in sft_batches(src, seed=2, process_index=0, process_count=1, **kw)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    s0 = firsts(sft_batches(src, seed=1, process_index=0, process_count=2, **kw))
    s1 = firsts(sft_batches(src, seed=1, process_index=1, process_count=2, **kw))
    assert not set(s0) & set(s1) and sorted(s0 + s1) == list(range(1000, 1040))
    with pytest.raises(ValueError, match="process_index"):
        sft_batches(src, seed=1, process_index=2, process_count=2, **kw)


def rl_source(n):
    return [{"prompt": f"p{i}".encode(), "prompt_ids": np.arange(i % 7 + 1, dtype=np.int32),
             "answer": str(i).encode(), "tests": b"" if i % 2 else json.dumps({"inputs": ["1"], "outputs": ["2"]}).encode(),
             "source": b"s", "difficulty": np.float32(i)} for i in range(n)]


def test_rl_prompt_batches_contents_filter_and_resume():
    src = rl_source(30)
    kw = dict(num_prompts=4, seed=5, max_prompt_length=5, process_index=0, process_count=1)
    it = rl_prompt_batches(src, **kw)
    ref = [next(it) for _ in range(12)]
    for batch in ref:
        assert len(batch) == 4
        for ex in batch:
            i = int(ex["answer"])
            assert ex["prompt"] == f"p{i}" and len(ex["prompt_ids"]) <= 5 and ex["difficulty"] == i
            assert ex["tests"] == (None if i % 2 else {"inputs": ["1"], "outputs": ["2"]})
    it2 = rl_prompt_batches(src, **kw)
    for _ in range(5):
        next(it2)
    it3 = rl_prompt_batches(src, **kw)
    it3.set_state(json.loads(json.dumps(it2.get_state())))
    for want in ref[5:]:
        assert [e["answer"] for e in next(it3)] == [e["answer"] for e in want]
