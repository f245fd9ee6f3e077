"""Streaming record readers and validators: errors name file and line."""
import json
import math

import pytest

from data_fixtures import write_jsonl
from klear_jax.data import records as R


def test_jsonl_bad_json_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}, "", "{not json"])
    it = R.iter_raw_records([p])
    assert next(it).line == 1
    with pytest.raises(R.RecordError, match=r"a\.jsonl:3: invalid JSON") as e:
        next(it)
    assert e.value.line == 3 and e.value.path == p


def test_parquet_rows_stream_with_row_numbers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"problem": f"q{i}", "answer": str(i)} for i in range(25)]
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    got = list(R.iter_raw_records([path], parquet_batch_rows=4))
    assert [g.line for g in got] == list(range(1, 26))
    assert [g.data for g in got] == rows


def test_sft_validation():
    assert R.sft_messages({"prompt": "p", "response": "r", "system": "s"}) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "p"},
        {"role": "assistant", "content": "r"}]
    for bad, msg in [([], "JSON object"), ({"prompt": "p"}, "missing field 'response'"),
                     ({"prompt": 3, "response": "r"}, "'prompt' must be a string"),
                     ({"messages": [{"role": "user", "content": "x"}]}, "no assistant"),
                     ({"messages": [{"role": "bot", "content": "x"}]}, "role must be"),
                     ({"messages": "hi"}, "non-empty list"), ({"text": "x"}, "needs 'messages'")]:
        with pytest.raises(ValueError, match=msg):
            R.sft_messages(bad)


def test_rl_validation():
    m = R.rl_fields({"problem": "1+1", "answer": 2, "source": "gsm", "difficulty": 3}, "rl_math")
    assert m["answer"] == "2" and m["source"] == "gsm" and m["difficulty"] == 3.0 and m["tests"] is None
    io = {"inputs": ["1\n"], "outputs": ["2\n"]}
    c = R.rl_fields({"prompt": "code", "input_output": json.dumps(io)}, "rl_code")
    assert c["tests"] == io and math.isnan(c["difficulty"]) and c["messages"][0]["content"] == "code"
    for bad, kind, msg in [({"problem": "x"}, "rl_math", "missing field 'answer'"),
                           ({"problem": "x", "answer": [1]}, "rl_math", "string or number"),
                           ({"problem": "x", "tests": "{"}, "rl_code", "not valid JSON"),
                           ({"problem": "x", "tests": {"inputs": [1], "outputs": []}}, "rl_code", "1 inputs but 0"),
                           ({"problem": "x", "answer": "1", "difficulty": "hard"}, "rl_math", "difficulty"),
                           ({"answer": "1"}, "rl_math", "missing field 'prompt'")]:
        with pytest.raises(ValueError, match=msg):
            R.rl_fields(bad, kind)


def test_expand_inputs(tmp_path):
    a = write_jsonl(tmp_path / "b.jsonl", [])
    b = write_jsonl(tmp_path / "a.jsonl", [])
    assert R.expand_inputs([str(tmp_path / "*.jsonl")]) == [b, a]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        R.expand_inputs([str(tmp_path / "*.parquet")])


def test_parquet_row_limits_and_deep_tests(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "big.parquet")
    pq.write_table(pa.Table.from_pylist([{"problem": "q", "answer": "1"}, {"problem": "q" * 5000, "answer": "2"}]), path)
    with pytest.raises(R.RecordError, match=r"big\.parquet:2: record is 5014 bytes of text, over the 4000-byte"):
        list(R.iter_raw_records([path], max_record_bytes=4000))
    got = list(R.iter_raw_records([path], strict=False, max_record_bytes=4000))
    assert got[0].error is None and got[1].data is None and "over the 4000-byte" in got[1].error
    deep = "[" * 5000 + "]" * 5000
    for tests in (deep, json.dumps({"inputs": [json.loads("[" * 70 + "1" + "]" * 70)], "outputs": ["1"]})):
        with pytest.raises(ValueError, match="'tests'"):
            R.rl_fields({"problem": "x", "tests": tests}, "rl_code")
