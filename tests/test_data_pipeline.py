"""Packed SFT batches and RL prompt batches: correctness, determinism, resume, and one global
order for any number of processes (each process's rows of the same global batches)."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from data_fixtures import iterate_sequences
from klear_jax.data.pipeline import rl_prompt_batches, sft_batches


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
    assert 0 < n_over
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
    assert sorted(seen) == list(range(len(lengths)))  # each exactly once (last batch padded)


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


def firsts(batch) -> list[int]:
    """Record ids (unique first tokens, see make_source) of a batch's segments, row-major."""
    return [int(ids[0]) for _, ids, _ in iterate_sequences(batch)]


def test_seeded_determinism():
    src = make_source(40)
    kw = dict(batch_size=1, seq_len=16, num_epochs=1, process_index=0, process_count=1)
    a = [b["input_ids"] for b in sft_batches(src, seed=1, **kw)]
    b = [b["input_ids"] for b in sft_batches(src, seed=1, **kw)]
    c = [b["input_ids"] for b in sft_batches(src, seed=2, **kw)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    with pytest.raises(ValueError, match="process_index"):
        sft_batches(src, seed=1, batch_size=2, seq_len=16, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        sft_batches(src, seed=1, batch_size=4, seq_len=16, process_index=0, process_count=3)


def global_batches(src, n, steps=None, **kw):
    """[(step, global batch)] assembled from the rows of n processes' iterators."""
    its = [sft_batches(src, process_index=i, process_count=n, **kw) for i in range(n)]
    out = []
    for parts in zip(*its):
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        if steps is not None and len(out) == steps:
            break
    return out, its


def assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_global_batches_do_not_depend_on_process_count():
    """1, 2 and 4 processes: the same packed rows at every step, each record exactly once
    per epoch over all processes (none twice, none dropped: the last batch is padded)."""
    src = make_source(205, max_len=30, seed=1)
    kw = dict(batch_size=8, seq_len=32, seed=5, num_epochs=2)
    ref, _ = global_batches(src, 1, **kw)
    for n in (2, 4):
        got, _ = global_batches(src, n, **kw)
        assert_same_batches(got, ref)
    ids = [i for b in ref for i in firsts(b)]
    assert sorted(ids) == sorted(list(range(1000, 1205)) * 2)
    assert sorted(ids[:150]) == sorted(set(ids[:150]))  # the first epoch: no repeats
    last = ref[-1]["segment_ids"]
    assert (last.max(1) == 0).sum() == 4  # the last batch: 4 rows of records, 4 padded


def test_rows_follow_a_sharding_and_pad_rows():
    src = make_source(30)
    kw = dict(batch_size=4, seq_len=16, seed=0, num_epochs=1)
    (ref,), _ = global_batches(src, 1, steps=1, **kw)
    b = next(sft_batches(src, rows=[2, 3, 0], **kw))
    for k in ref:
        np.testing.assert_array_equal(b[k], ref[k][[2, 3, 0]])
    with pytest.raises(ValueError, match="rows must be indices"):
        sft_batches(src, rows=[4], **kw)


def test_local_rows_of_the_batch_sharding():
    """On the 8-device test mesh one process holds every row; the mapping to rows is the
    one jax.make_array_from_process_local_data uses (checked end to end by test_multihost)."""
    import jax
    from klear_jax import sharding as shd, train_step as ts
    from klear_jax.data.pipeline import local_rows
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    assert local_rows(ts.batch_sharding(mesh), 8).tolist() == list(range(8))
    local = np.arange(8 * 3).reshape(8, 3)
    arr = jax.make_array_from_process_local_data(ts.batch_sharding(mesh), local, (8, 3))
    np.testing.assert_array_equal(np.asarray(arr), local)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 1), (1, 2)])
def test_state_saved_by_n_processes_restores_onto_m(n, m):
    src = make_source(60, max_len=30, seed=2)
    kw = dict(batch_size=4, seq_len=32, seed=3, num_epochs=None)
    ref, _ = global_batches(src, 1, steps=14, **kw)
    _, its = global_batches(src, n, steps=5, **kw)
    states = [json.loads(json.dumps(it.get_state())) for it in its]
    assert all(s == states[0] for s in states)  # one state, whatever the process
    fresh = [sft_batches(src, process_index=i, process_count=m, **kw) for i in range(m)]
    for it in fresh:
        it.set_state(states[0])
    got = [{k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
           for _, parts in zip(range(9), zip(*fresh))]
    assert_same_batches(got, ref[5:])


def test_packing_fill_rate_is_the_global_one():
    """Packing happens on the global stream, so the fill rate cannot drop with more processes
    (packing each process's shard separately would pack fewer, less varied sequences)."""
    src = make_source(400, max_len=200, seed=4)
    kw = dict(batch_size=8, seq_len=256, seed=0, num_epochs=1)
    fill = {}
    for n in (1, 4):
        batches, _ = global_batches(src, n, **kw)
        full = batches[:-1]  # the padded last batch aside
        fill[n] = sum((b["segment_ids"] > 0).sum() for b in full) / (len(full) * 8 * 256)
    assert fill[1] == fill[4] > 0.85, fill


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


def test_rl_prompt_batches_do_not_depend_on_process_count():
    src = rl_source(40)
    kw = dict(num_prompts=4, seed=2, max_prompt_length=6)
    answers = lambda parts: [e["answer"] for p in parts for e in p]  # noqa: E731
    ref = rl_prompt_batches(src, process_index=0, process_count=1, **kw)
    ref = [answers([next(ref)]) for _ in range(12)]
    for n in (2, 4):
        its = [rl_prompt_batches(src, process_index=i, process_count=n, **kw) for i in range(n)]
        got = [answers([next(it) for it in its]) for _ in range(5)]
        states = [it.get_state() for it in its]
        assert all(s == states[0] for s in states)
        one = rl_prompt_batches(src, process_index=0, process_count=1, **kw)
        one.set_state(json.loads(json.dumps(states[0])))  # N processes -> 1
        got += [answers([next(one)]) for _ in range(7)]
        assert got == ref
    assert [len(rl_prompt_batches(src, rows=[1, 3], **kw).__next__())] == [2]
