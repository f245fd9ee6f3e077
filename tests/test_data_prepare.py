"""prepare CLI end to end: JSONL -> TFDS ArrayRecord -> tfds.data_source -> grain batches."""
import json
import random

import numpy as np
import pytest
import tensorflow_datasets as tfds

from data_fixtures import sft_record, tok, tok_dir, write_jsonl  # noqa: F401  (fixtures)
from klear_jax.data import prepare as P
from klear_jax.data.pipeline import iterate_sequences, rl_prompt_batches, sft_batches
from klear_jax.data.records import RecordError


def test_cli_sft_end_to_end(tmp_path, tok_dir, tok):
    rng = random.Random(0)
    recs = [sft_record(rng, chat=i % 2 == 0) for i in range(40)]
    path = write_jsonl(tmp_path / "sft.jsonl", recs)
    out = str(tmp_path / "ds")
    rc = P.main(["--input", path, "--output_dir", out, "--name", "tiny_sft", "--kind", "sft",
                 "--tokenizer", tok_dir, "--max_length", "120", "--val_fraction", "0.25"])
    assert rc == 0
    report = json.load(open(tmp_path / "ds" / "tiny_sft_report.json"))
    tr, va = report["splits"]["train"], report["splits"]["validation"]
    assert tr["read"] + va["read"] == 40 and tr["invalid"] == va["invalid"] == 0
    assert tr["kept"] == tr["read"] and tr["truncated"] == tr["dropped"] == 0 and va["kept"] > 0
    src = tfds.data_source("tiny_sft", data_dir=out)
    assert len(src["train"]) == tr["kept"] and len(src["validation"]) == va["kept"]
    # every packed segment's loss tokens decode to a response and its <|im_end|>
    responses = {r["response"] if "response" in r else r["messages"][1]["content"] for r in recs}
    n = 0
    for b in sft_batches(src["train"], batch_size=2, seq_len=128, seed=0, process_index=0, process_count=1):
        assert b["input_ids"].shape == (2, 128)
        for _, ids, mask in iterate_sequences(b):
            text = tok.decode(ids[mask > 0])
            assert text.endswith("<|im_end|>") and text[: -len("<|im_end|>")] in responses
            n += 1
    assert tr["kept"] - 8 <= n <= tr["kept"]  # only a dropped final partial batch may be missing


def test_bad_record_names_file_and_line(tmp_path, tok_dir, capsys):
    rng = random.Random(1)
    lines = [sft_record(rng, True), sft_record(rng, False), {"prompt": "no response"}, sft_record(rng, True),
             "{broken", {"messages": [{"role": "user", "content": 5}]}]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(RecordError, match=r"bad\.jsonl:3: missing field 'response'"):
        P.prepare([path], str(tmp_path / "o1"), "bad_a", "sft", tok_dir)
    rc = P.main(["--input", path, "--output_dir", str(tmp_path / "o2"), "--name", "bad_b", "--kind", "sft",
                 "--tokenizer", tok_dir])
    assert rc == 2 and "bad.jsonl:3: missing field 'response'" in capsys.readouterr().err
    rep = P.prepare([path], str(tmp_path / "o3"), "bad_c", "sft", tok_dir, skip_invalid=True)
    assert rep["splits"]["train"] == {"read": 6, "kept": 3, "truncated": 0, "dropped": 0, "invalid": 3}
    assert len(tfds.data_source("bad_c", data_dir=str(tmp_path / "o3"))["train"]) == 3
    with pytest.raises(FileExistsError, match="overwrite"):
        P.prepare([path], str(tmp_path / "o3"), "bad_c", "sft", tok_dir, skip_invalid=True)


def test_truncate_and_drop_counts(tmp_path, tok_dir):
    rng = random.Random(2)
    path = write_jsonl(tmp_path / "s.jsonl", [sft_record(rng, True) for _ in range(20)])
    lengths = []
    from klear_jax.data import tokenizer as tk
    t = tk.load_tokenizer(tok_dir)
    for line in open(path):
        from klear_jax.data.records import sft_messages
        lengths.append(len(tk.sft_ids_and_mask(t, sft_messages(json.loads(line)))[0]))
    L = int(np.median(lengths))
    over = sum(x > L for x in lengths)
    r1 = P.prepare([path], str(tmp_path / "a"), "t_a", "sft", tok_dir, max_length=L)["splits"]["train"]
    r2 = P.prepare([path], str(tmp_path / "b"), "t_b", "sft", tok_dir, max_length=L, overlong="drop")["splits"]["train"]
    assert r1["truncated"] == over and r1["kept"] == 20 and r2["dropped"] == over and r2["kept"] == 20 - over
    src = tfds.data_source("t_a", data_dir=str(tmp_path / "a"))["train"]
    assert max(len(src[i]["input_ids"]) for i in range(len(src))) == L


@pytest.mark.parametrize("kind", ["rl_math", "rl_code"])
def test_rl_kinds_end_to_end(tmp_path, tok_dir, tok, kind):
    recs = []
    for i in range(12):
        r = {"problem": f"Compute {i} + 1.", "source": "gen", "difficulty": i}
        if kind == "rl_math":
            r["answer"] = i + 1
        else:
            r["input_output"] = json.dumps({"inputs": [f"{i}\n"], "outputs": [f"{i + 1}\n"]})
        recs.append(r)
    path = write_jsonl(tmp_path / "rl.jsonl", recs)
    rep = P.prepare([path], str(tmp_path / "ds"), f"tiny_{kind}", kind, tok_dir,
                    prompt_template="{problem} Answer in \\boxed{}.")
    assert rep["splits"]["train"]["kept"] == 12
    src = tfds.builder_from_directory(str(tmp_path / "ds" / f"tiny_{kind}" / "1.0.0")).as_data_source()["train"]
    seen = []
    for batch in rl_prompt_batches(src, num_prompts=4, num_epochs=1, process_index=0, process_count=1):
        for ex in batch:
            i = int(ex["difficulty"])
            assert ex["prompt"] == f"Compute {i} + 1. Answer in \\boxed{{}}." and ex["source"] == "gen"
            assert tok.decode(ex["prompt_ids"]).endswith("<|im_start|>assistant\n")
            if kind == "rl_math":
                assert ex["answer"] == str(i + 1) and ex["tests"] is None
            else:
                assert ex["tests"] == {"inputs": [f"{i}\n"], "outputs": [f"{i + 1}\n"]}
            seen.append(i)
    assert sorted(seen) == list(range(12))
