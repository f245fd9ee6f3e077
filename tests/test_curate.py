"""Curation pipeline: each step's keep/drop decisions, the 9-gram rule, determinism, errors,
config validation, and config -> TFDS output + report end to end."""
import json
import os
import random
import subprocess
import sys

import pytest

from klear_jax import config as kc
from klear_jax.config import ConfigError
from klear_jax.curate import label as L
from klear_jax.curate import pipeline as C
from klear_jax.curate import steps as S
from klear_jax.curate.config import curate_base, validate_curate_config
from klear_jax.data.records import RawRecord, RecordError
from tests.data_fixtures import sample_text, tok_dir, write_jsonl  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg_for(tmp_path, sources, kind="sft", **blocks):
    c = curate_base()
    c.kind = kind
    for name, s in sources.items():
        c.sources[name] = s
    c.output.update(dir=str(tmp_path / "out"), name="cur", tfds=False)
    for block, values in blocks.items():
        if isinstance(values, dict):
            c[block].update(values)
        else:
            c[block] = values
    return c


def lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def steps_by_name(report):
    return {s["step"]: s for s in report["steps"]}


def test_normalize_exact():
    assert S.normalize("The  CAT's (x-1)!\n\t") == "the cat s x 1"
    assert S.normalize("$a+b=c$ \\frac{1}{2}") == "$a+b=c$ frac 1 2"  # symbols kept, P* -> space
    assert S.normalize("Hello,world") == "hello world"
    assert S.words("«Ünïcode» — test") == ["ünïcode", "test"]
    ascii_all = "".join(chr(i) for i in range(32, 127))  # the ASCII fast path = the Unicode rule
    assert S.words(ascii_all) == ascii_all.lower().translate(S._punct_table()).split()


def test_hashset64_growth_duplicates_and_bound():
    t = S.HashSet64(capacity=8)
    vals = [S.hash64(str(i)) for i in range(5000)]
    assert all(t.add(v) for v in vals)
    assert not any(t.add(v) for v in vals[::7])
    assert t.size == 5000 and 2 * t.size <= len(t._slots) <= 4 * t.size
    bounded = S.HashSet64(max_size=3)
    for v in vals[:3]:
        bounded.add(v)
    with pytest.raises(OverflowError, match="dedup.max_unique"):
        bounded.add(vals[3])


def test_dedup_prompts_and_responses(tmp_path):
    recs = [
        {"prompt": "What is 1+1?", "response": "r one"},
        {"prompt": "what   IS 1+1", "response": "r two"},        # same prompt: case/space/punct
        {"prompt": "What is (1+1) ?", "response": "r three"},    # same after normalisation
        {"prompt": "What is 1-1?", "response": "R ONE."},        # new prompt, duplicate response
        {"prompt": "Another question", "response": "r five"},
    ]
    src = write_jsonl(tmp_path / "a.jsonl", recs)
    rep = C.run(cfg_for(tmp_path, {"a": dict(paths=[src], domain="math")}))
    st = steps_by_name(rep)
    assert st["dedup_prompt"]["seen"] == 5 and st["dedup_prompt"]["dropped"] == {"duplicate": 2}
    assert st["dedup_prompt"]["examples"]["duplicate"] == [f"{src}:2", f"{src}:3"]
    assert st["dedup_response"]["seen"] == 3 and st["dedup_response"]["dropped"] == {"duplicate": 1}
    out = lines(rep["curated_jsonl"])
    assert [r["response"] for r in out] == ["r one", "r five"]
    assert all(r["source"] == "a" and r["domain"] == "math" for r in out)


BENCH = "Find the number of ordered pairs of positive integers whose product equals exactly twelve"


def test_ninegram_decontamination(tmp_path):
    w = BENCH.split()
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": BENCH}, {"question": "short one"}])
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "alpha beta gamma delta epsilon zeta eta theta iota"}])
    recs = [
        {"prompt": "Intro: " + " ".join(w[:8]) + " and more", "response": "a"},         # 8-gram: kept
        {"prompt": "Intro: " + " ".join(w[2:11]) + " and more", "response": "b"},       # 9-gram: dropped
        {"prompt": "FIND the number, of ORDERED pairs; of positive-integers whose!", "response": "c"},
        {"prompt": "x " + "Alpha Beta Gamma Delta Epsilon Zeta Eta Theta Iota", "response": "d"},
        {"prompt": "short one", "response": "e"},                                      # < 9 words: kept
        {"prompt": "clean prompt", "response": " ".join(w)},                           # response only
    ]
    src = write_jsonl(tmp_path / "a.jsonl", recs)
    c = cfg_for(tmp_path, {"a": dict(paths=[src], domain="math")},
                decontam=dict(benchmarks={"aime": [bench], "oth": other}, check_response=False))
    st = steps_by_name(C.run(c))["decontaminate"]
    # record 3: "positive-integers" -> "positive integers", so 9 shared words after normalising
    assert st["dropped"] == {"contaminated:aime": 2, "contaminated:oth": 1}
    assert st["examples"]["contaminated:aime"] == [f"{src}:2", f"{src}:3"]
    assert st["kept"] == 3 and st["info"]["benchmark_problems"] == {"aime": 2, "oth": 1}
    c.unlock()
    c.decontam.check_response, c.output.overwrite = True, True
    st = steps_by_name(C.run(c))["decontaminate"]
    assert st["dropped"] == {"contaminated:aime": 3, "contaminated:oth": 1} and st["kept"] == 2


def test_benchmark_without_problem_field_names_file_line(tmp_path):
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": "ok"}, {"text": "no field"}])
    with pytest.raises(RecordError, match=r"bench\.jsonl:2: benchmark record needs"):
        S.load_benchmarks({"b": [bench]})


def _many(tmp_path, name, n, prefix):
    return write_jsonl(tmp_path / f"{name}.jsonl",
                       [{"prompt": f"{prefix} problem {i}", "response": f"{prefix} answer {i}"} for i in range(n)])


def test_source_selection_caps_and_order(tmp_path):
    srcs = {
        "m_best": dict(paths=[_many(tmp_path, "m1", 10, "best")], domain="math", quality=0.9),
        "m_mid": dict(paths=[_many(tmp_path, "m2", 10, "mid")], domain="math", quality=0.5, cap=4),
        "m_low": dict(paths=[_many(tmp_path, "m3", 10, "low")], domain="math", quality=0.1),
        "c_only": dict(paths=[str(tmp_path / "c*.jsonl")], domain="code", quality=0.2),
    }
    _many(tmp_path, "c1", 3, "code")
    rep = C.run(cfg_for(tmp_path, srcs, select=dict(top_n_per_domain=2)))
    by = {s["name"]: s for s in rep["sources"]}
    assert [s["name"] for s in rep["sources"]] == ["m_best", "m_mid", "c_only", "m_low"]
    assert not by["m_low"]["selected"] and by["m_low"]["counts"] is None
    assert by["m_mid"]["counts"]["kept"] == 4 and by["m_mid"]["counts"]["info"]["capped"]
    out = lines(rep["curated_jsonl"])
    assert rep["written"] == len(out) == 10 + 4 + 3
    assert [r["source"] for r in out] == ["m_best"] * 10 + ["m_mid"] * 4 + ["c_only"] * 3
    md = open(os.path.join(tmp_path, "out", "cur_curate_report.md")).read()
    assert "| m_low | math | 0.1 | 3 |" in md and "not selected" in md


def test_weighted_sampling_deterministic(tmp_path):
    src = _many(tmp_path, "big", 400, "p")

    def kept(seed, sub):
        c = cfg_for(tmp_path / sub, {"s": dict(paths=[src], domain="math", weight=0.25)})
        c.seed = seed
        rep = C.run(c)
        return [r["prompt"] for r in lines(rep["curated_jsonl"])], rep

    a, rep = kept(7, "a")
    b, _ = kept(7, "b")
    other, _ = kept(8, "c")
    assert a == b and a != other
    assert 60 <= len(a) <= 140  # rate 0.25 of 400 (binomial sd ~ 8.7)
    s = rep["sources"][0]["counts"]
    assert s["seen"] == 400 and s["dropped"] == {"not_sampled": 400 - len(a)}


def test_malformed_record_named_by_file_and_line(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "no response"},
                                              '{"prompt": "x", ', {"prompt": "c", "response": "d"}])
    c = cfg_for(tmp_path, {"s": dict(paths=[src], domain="math")})
    with pytest.raises(RecordError, match=r"bad\.jsonl:2: missing field 'response'"):
        C.run(c)
    c.skip_invalid = True
    rep = C.run(c)
    st = steps_by_name(rep)["validate"]
    assert st["dropped"] == {"invalid": 2} and st["examples"]["invalid"] == [f"{src}:2", f"{src}:3"]
    assert rep["written"] == 2


def test_retain_and_rl_filters_exact():
    recs = [RawRecord("f", i + 1, d) for i, d in enumerate([
        {"correct": True, "difficulty": 0.1}, {"correct": False, "difficulty": 0.9},
        {"correct": False, "difficulty": 0.2}, {"correct": None}, {"correct": False}])]
    step = L.retain_step("field", "difficulty", 0.5, 0.25, True, False)
    assert [r.line for r in step(recs)] == [1, 2, 4]
    assert step.counter.dropped == {"incorrect_easy": 1, "incorrect_unknown_difficulty": 1}
    by_rate = L.retain_step("pass_rate", "difficulty", 0.5, 0.25, False, True)
    rs = [RawRecord("f", i, {"correct": False, "pass_rate": p}) for i, p in enumerate([0.0, 0.25, 0.5])]
    assert [r.line for r in by_rate(rs)] == [2]
    assert by_rate.counter.dropped == {"incorrect_hard": 2}
    band = L.pass_band_step(0.05, 0.9)
    rs = [RawRecord("f", i, {"pass_rate": p}) for i, p in enumerate([0.0, 0.05, 0.5, 0.9, 0.95, 1.0])]
    assert [r.line for r in band(rs)] == [1, 2, 3]
    assert band.counter.dropped == {"too_hard": 1, "too_easy": 2}


def test_rl_code_min_tests_and_pass_rate_field(tmp_path):
    def prob(i, n_tests, rate):
        d = {"problem": f"code problem {i}", "tests": {"inputs": ["1"] * n_tests, "outputs": ["1"] * n_tests}}
        if rate is not None:
            d["pass_rate"] = rate
        return d
    recs = [prob(0, 16, 0.5), prob(1, 15, 0.5), prob(2, 20, 1.0), prob(3, 16, 0.0), prob(4, 16, None),
            prob(5, 30, 0.25)]
    src = write_jsonl(tmp_path / "code.jsonl", recs)
    c = cfg_for(tmp_path, {"c": dict(paths=[src], domain="code")}, kind="rl_code",
                pass_rate=dict(source="field"), rl_filter=dict(min_pass_rate=0.1, max_pass_rate=0.9, min_tests=16))
    rep = C.run(c)
    st = steps_by_name(rep)
    assert list(st) == ["validate", "dedup_prompt", "min_tests", "pass_rate", "pass_band"]
    assert st["min_tests"]["dropped"] == {"too_few_tests": 1}
    assert st["pass_rate"]["dropped"] == {"no_pass_rate": 1}
    assert st["pass_band"]["dropped"] == {"too_easy": 1, "too_hard": 1} and st["pass_band"]["kept"] == 2
    assert [r["problem"] for r in lines(rep["curated_jsonl"])] == ["code problem 0", "code problem 5"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [prob(9, 16, 1.5)])
    c.sources.c.paths = [bad]
    c.output.overwrite = True
    with pytest.raises(RecordError, match=r"bad\.jsonl:1: field 'pass_rate' must be a number in \[0, 1\]"):
        C.run(c)


@pytest.mark.parametrize("key,value,match", [
    ("sources.a.wieght", 0.5, r"'sources\.a\.wieght': unknown key"),
    ("sources.a.weight", 1.5, r"'sources\.a\.weight': must be a sampling rate"),
    ("sources.a.domain", "code", r"'sources\.a\.domain': must be 'math' for kind 'rl_math'"),
    ("pass_rate.source", "model", r"'pass_rate\.model\.checkpoint': required when pass_rate.source is 'model'"),
    ("rl_filter.min_pass_rate", 0.2, r"'rl_filter\.min_pass_rate': a pass-rate band needs"),
    ("output.name", "Bad-Name", r"'output\.name': must be lower_snake_case"),
    ("label.enabled", True, r"'label\.enabled': labels teacher traces: only for kind 'sft'"),
])
def test_config_errors_name_the_key(tmp_path, key, value, match):
    c = cfg_for(tmp_path, {"a": dict(paths=["x.jsonl"], domain="math")}, kind="rl_math")
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(ConfigError, match=match):
        validate_curate_config(c)


def test_unknown_key_fails_on_locked_config_and_in_validation(tmp_path):
    c = cfg_for(tmp_path, {"a": dict(paths=["x.jsonl"], domain="math")})
    c.lock()
    with pytest.raises(ConfigError, match="'dedup.prompts'"):
        kc.apply_overrides(c, ["dedup.prompts=false"])
    import ml_collections
    d = ml_collections.ConfigDict(c.to_dict())
    d.dedup.colour = 1
    with pytest.raises(ConfigError, match=r"'dedup\.colour': unknown key"):
        validate_curate_config(d)


def test_example_config_validates():
    for spec in ("configs/curate_example.py", "configs/curate_example.py:kind=rl_math"):
        c = kc.load_config(os.path.join(ROOT, spec))
        kc.apply_overrides(c, ["output.tokenizer=tok"])
        validate_curate_config(c)


def test_end_to_end_config_file_to_tfds_and_report(tmp_path, tok_dir):  # noqa: F811
    rng = random.Random(0)
    recs = [{"prompt": f"What is {i} plus {i}? " + sample_text(rng, 3),
             "response": f"<think>{sample_text(rng, 5)}</think> {2 * i}"} for i in range(12)]
    recs.append(dict(recs[0]))  # an exact duplicate
    src = write_jsonl(tmp_path / "sft.jsonl", recs)
    cfg_file = tmp_path / "cfg.py"
    cfg_file.write_text(
        "from klear_jax.curate import curate_base\n"
        "def get_config():\n"
        "    c = curate_base()\n"
        f"    c.sources.main = dict(paths=[{src!r}], domain='math')\n"
        f"    c.output.update(dir={str(tmp_path / 'out')!r}, name='tiny_sft', tokenizer={tok_dir!r}, max_length=64)\n"
        "    return c\n")
    rep = C.run(kc.load_config(str(cfg_file)))
    assert rep["written"] == 12 and steps_by_name(rep)["dedup_prompt"]["dropped"] == {"duplicate": 1}
    assert rep["prepare"]["splits"]["train"]["read"] == 12
    import tensorflow_datasets as tfds
    ds = tfds.builder_from_directory(str(tmp_path / "out" / "tiny_sft" / "1.0.0")).as_data_source()["train"]
    assert len(ds) == 12 and {ex["source"] for ex in (ds[i] for i in range(len(ds)))} == {b"main"}
    saved = json.load(open(tmp_path / "out" / "tiny_sft_curate_report.json"))
    assert saved["steps"] == rep["steps"] and saved["config"]["output"]["name"] == "tiny_sft"
    md = open(tmp_path / "out" / "tiny_sft_curate_report.md").read()
    assert "| dedup_prompt | 13 | 12 | duplicate: 1 |" in md and "## TFDS dataset" in md


def test_cli_runs_config_with_overrides(tmp_path):
    src = _many(tmp_path, "s", 5, "cli")
    cfg_file = tmp_path / "cfg.py"
    cfg_file.write_text(
        "from klear_jax.curate import curate_base, source\n"
        "def get_config():\n"
        "    c = curate_base()\n"
        f"    c.sources.s = source([{src!r}], 'math')\n"
        "    c.output.update(dir='unused', name='cli', tfds=False)\n"
        "    return c\n")
    out = tmp_path / "o"
    base = [sys.executable, "-m", "klear_jax.curate", f"--config={cfg_file}", f"--config.output.dir={out}"]
    p = subprocess.run(base + ["--config.sources.s.cap=2"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert len(lines(out / "cli.curated.jsonl")) == 2 and (out / "cli_curate_report.md").exists()
    p = subprocess.run(base + ["--config.sources.s.weight=2.0", "--config.output.overwrite=true"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "config key 'sources.s.weight'" in p.stderr
