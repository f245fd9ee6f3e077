"""prepare CLI end to end: JSONL -> TFDS ArrayRecord -> tfds.data_source -> grain batches."""
import json
import random

import numpy as np
import pytest
import tensorflow_datasets as tfds

from data_fixtures import iterate_sequences, sft_record, tok, tok_dir, write_jsonl  # noqa: F401  (fixtures)
from klear_jax.data import prepare as P
from klear_jax.data.pipeline import rl_prompt_batches, sft_batches
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


# ------------------------------------------------------------ malformed input (issue 23)
BAD_LINES = [  # (raw line bytes, the problem named in `file:line: problem`)
    (b'{"prompt": "caf\xe9", "response": "r"}', "invalid UTF-8 at byte 15"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 64 levels"),
    (b'{"prompt": "p", "response": "r", "x": ' + b"[" * 100 + b"]" * 100 + b"}", "nested deeper than 64"),
    (b'{"prompt": "\\ud800", "response": "r"}', "string with an unpaired surrogate"),
    (b'{"prompt": "p", "response": "r", "n": ' + b"7" * 5000 + b"}", "invalid JSON: Exceeds the limit"),
    (b'{"prompt": "p", "response": "' + b"x" * 300_000 + b'"}', r"record is 3000\d\d bytes, over the 250000-byte limit"),
]


def _write_lines(path, lines) -> str:
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return str(path)


def test_malformed_lines_are_named_or_counted(tmp_path, tok_dir, capsys):
    rng = random.Random(3)
    good = json.dumps(sft_record(rng, True)).encode()
    for i, (line, problem) in enumerate(BAD_LINES):
        path = _write_lines(tmp_path / f"b{i}.jsonl", [good, line, good])
        with pytest.raises(RecordError, match=rf"b{i}\.jsonl:2: {problem}"):
            P.prepare([path], str(tmp_path / "o"), "bad", "sft", tok_dir, max_record_bytes=250_000)
    assert not (tmp_path / "o" / "bad").exists()  # a failed run writes nothing
    path = _write_lines(tmp_path / "all.jsonl", [good] + [b for b, _ in BAD_LINES] + [good])
    rc = P.main(["--input", path, "--output_dir", str(tmp_path / "o"), "--name", "bad", "--kind", "sft",
                 "--tokenizer", tok_dir, "--max_record_bytes", "250000"])
    assert rc == 2 and "all.jsonl:2: invalid UTF-8" in capsys.readouterr().err
    rep = P.prepare([path], str(tmp_path / "o"), "bad", "sft", tok_dir, skip_invalid=True, max_record_bytes=250_000)
    assert rep["splits"]["train"] == {"read": 8, "kept": 2, "truncated": 0, "dropped": 0, "invalid": 6}
    assert len(tfds.data_source("bad", data_dir=str(tmp_path / "o"))["train"]) == 2


def test_non_finite_gold_answers(tmp_path, tok_dir):
    bad = ['{"problem": "p", "answer": NaN}', '{"problem": "p", "answer": 1e999}',
           '{"problem": "p", "answer": -Infinity}', '{"problem": "p", "answer": "inf"}',
           '{"problem": "p", "answer": " nan "}']
    good = [json.dumps({"problem": "p", "answer": 2**1000}), json.dumps({"problem": "p", "answer": "9" * 400}),
            json.dumps({"problem": "p", "answer": "\\infty"}), json.dumps({"problem": "p", "answer": 1.5})]
    path = write_jsonl(tmp_path / "m.jsonl", bad + good)
    with pytest.raises(RecordError, match=r"m\.jsonl:1: field 'answer' is not finite \('nan'\)"):
        P.prepare([path], str(tmp_path / "o"), "m", "rl_math", tok_dir)
    rep = P.prepare([path], str(tmp_path / "o"), "m", "rl_math", tok_dir, skip_invalid=True)
    assert rep["splits"]["train"]["invalid"] == 5 and rep["splits"]["train"]["kept"] == 4
    answers = {tfds.data_source("m", data_dir=str(tmp_path / "o"))["train"][i]["answer"] for i in range(4)}
    assert answers == {str(2**1000).encode(), b"9" * 400, b"\\infty", b"1.5"}


def test_failed_rerun_keeps_previous_dataset_and_report(tmp_path, tok_dir):
    rng = random.Random(4)
    good = write_jsonl(tmp_path / "good.jsonl", [sft_record(rng, True) for _ in range(6)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [sft_record(rng, True), "{broken"])
    out = tmp_path / "o"
    P.prepare([good], str(out), "ds", "sft", tok_dir)
    report = (out / "ds_report.json").read_bytes()
    files = sorted(p.name for p in (out / "ds" / "1.0.0").iterdir())
    for overwrite in (True, False):
        with pytest.raises((RecordError, FileExistsError), match=r"bad\.jsonl:2: invalid JSON|already exists"):
            P.prepare([bad], str(out), "ds", "sft", tok_dir, overwrite=overwrite)
        assert (out / "ds_report.json").read_bytes() == report
        assert sorted(p.name for p in (out / "ds" / "1.0.0").iterdir()) == files
        assert len(tfds.data_source("ds", data_dir=str(out))["train"]) == 6
    assert sorted(p.name for p in out.iterdir()) == ["ds", "ds_report.json"]  # no temporary left
    # a successful overwrite replaces both
    rep = P.prepare([bad], str(out), "ds", "sft", tok_dir, overwrite=True, skip_invalid=True)
    assert json.loads((out / "ds_report.json").read_text()) == rep and rep["splits"]["train"]["kept"] == 1
    assert len(tfds.data_source("ds", data_dir=str(out))["train"]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["ds", "ds_report.json"]


def test_50mb_line_is_skipped_in_bounded_memory(tmp_path, tok_dir):
    """A real 50 MB line: counted as invalid without being read whole, parsed or tokenised;
    the whole prepare process peaks under 1 GB (it took 6.8 GB and 50 s when tokenised)."""
    import os
    import subprocess
    import sys
    import time

    rng = random.Random(5)
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(sft_record(rng, True)).encode() + b"\n")
        f.write(b'{"prompt": "p", "response": "')
        for _ in range(50):
            f.write(b"the cat sat on the mat " * 45_590)  # 1 MB a piece
        f.write(b'"}\n' + json.dumps(sft_record(rng, True)).encode() + b"\n")
    assert os.path.getsize(path) > 50e6
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "klear_jax.data.prepare", "--input", str(path), "--output_dir",
           str(tmp_path / "o"), "--name", "big", "--kind", "sft", "--tokenizer", tok_dir,
           "--max_length", "4096", "--skip_invalid"]
    probe = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
             "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    t = time.time()
    out = subprocess.run([sys.executable, "-c", probe] + cmd, cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    rc, peak_kb = map(int, out.stdout.split()[-2:])
    assert rc == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "o" / "big_report.json").read_text())
    assert report["splits"]["train"] == {"read": 3, "kept": 2, "truncated": 0, "dropped": 0, "invalid": 1}
    assert "big.jsonl:2: record is 52" in out.stderr
    print(f"50 MB line: peak RSS {peak_kb / 1024:.0f} MiB, {time.time() - t:.1f} s")
    assert peak_kb < 1024 * 1024
