"""klear_jax.bench: smoke runs of every workload at --quick sizes (schema + positive numbers;
no timing assertions), the analytic FLOPs and the ratio / target logic."""

import json
import math
import statistics

import numpy as np
import pytest

from klear_jax.bench import driver as bench
from klear_jax.bench import gpu, measure, workloads
from klear_jax.flops import train_flops_per_token


def _pos(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run(tmp_path, workloads):
    out = tmp_path / "bench.json"
    res = bench.main(["--quick", "--workloads", workloads, "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk.keys() == res.keys()
    for w in workloads.split(","):
        assert "error" not in on_disk[w], on_disk[w]
    m = on_disk["machine"]
    assert m["threads"] >= 1 and m["torch_threads"] == m["threads"]
    allocator = "tcmalloc" if m["malloc"].startswith("LD_PRELOAD") else "system"
    assert all(on_disk[w]["allocator"] == allocator for w in workloads.split(","))
    return on_disk


def test_train_flops_per_token_bench_small():
    cfg = workloads.model_config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size) == (32000, 512, 8, 8, 4, 64, 1536)
    n_layers = 8 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536)  # q,o + k,v + mlp
    expect = 3 * (2 * n_layers + 2 * 512 * 32000 + 8 * 4 * 512 * 512 / 2)
    assert train_flops_per_token(cfg, 512) == pytest.approx(expect)
    # attention FLOPs grow with the row length, the rest does not
    assert train_flops_per_token(cfg, 2048) > train_flops_per_token(cfg, 512)


def test_rl_batch_layout():
    cfg = workloads.model_config(quick=True)
    b = workloads.rl_batch(cfg, 4, 16)
    for k in ("input_ids", "targets", "loss_mask", "segment_ids", "sampler_logp"):
        assert b[k].shape == (4, 16), k
    np.testing.assert_array_equal(b["input_ids"][:, 1:], b["targets"][:, :-1])
    assert b["loss_mask"][:, 0].sum() == 0 and b["loss_mask"][:, -1].all()
    assert b["advantages"].shape == (4,) and (b["positive"] == (b["advantages"] > 0)).all()
    assert b["input_ids"].min() >= 1 and b["input_ids"].max() < cfg.vocab_size


def test_ratios_and_targets():
    res = {"train": {"tokens_per_s": 900.0, "mfu": 0.5, "matmul": {"peak_flops": 7.0}},
           "reference": {"train_tokens_per_s": 800.0, "generate_tokens_per_s": 100.0,
                         "matmul": {"peak_flops": 10.0}},
           "sample": {"tokens_per_s": 120.0, "decode_cost_ratio": 1.2},
           "scale": {"compile_ratio": 2.0}}
    r = bench.ratios(res)
    assert r["train_vs_reference"] == pytest.approx(1.125)
    assert r["sample_vs_reference"] == pytest.approx(1.2)
    assert r["jax_vs_torch_matmul_peak"] == pytest.approx(0.7)
    t = bench.targets(r)
    assert t["train_vs_reference"]["met"] and "train_mfu_vs_jax_peak" not in t  # reported only
    assert not t["sample_vs_reference"]["met"] and t["decode_cost_1024_vs_64"]["met"]
    assert not t["compile_32_vs_2_layers"]["met"]
    assert "MISSED" in bench.table({"targets": t})


def test_rounds_alternate_and_report_the_median_run():
    assert measure.round_orders(["train", "reference"], 3) == [
        ["train", "reference"], ["reference", "train"], ["train", "reference"]]
    runs = [{"tokens_per_s": 5.0, "i": 0}, {"error": "x"}, {"tokens_per_s": 3.0, "i": 2},
            {"tokens_per_s": 9.0, "i": 3}, {"tokens_per_s": 4.0, "i": 4}]
    assert bench.median_run(runs, "tokens_per_s")["i"] == 4  # 3, 4, 5, 9: the lower median
    assert bench.median_run(runs[:3], "tokens_per_s")["i"] == 2
    assert bench.median_run([{"error": "x"}], "tokens_per_s") == {"error": "x"}
    table = bench.table({"rounds": {"train": [400.0, 410.0],
                                    "reference:generate_tokens_per_s": [150.0, 160.0]},
                         "targets": {}})
    assert "train tokens_per_s per round" in table
    assert "reference generate_tokens_per_s per round" in table


def test_reference_generate_numbers_come_from_their_own_median_run():
    runs = [{"train_tokens_per_s": 300.0, "generate_tokens_per_s": 180.0, "generate_s": 1.0,
             "ttft_s": 0.1, "i": 0},
            {"train_tokens_per_s": 400.0, "generate_tokens_per_s": 160.0, "generate_s": 2.0,
             "ttft_s": 0.2, "i": 1}]
    got = bench.combine_runs("reference", runs)
    assert (got["i"], got["train_tokens_per_s"]) == (0, 300.0)  # the lower train run
    assert (got["generate_tokens_per_s"], got["generate_s"], got["ttft_s"]) == (160.0, 2.0, 0.2)
    assert bench.round_values("reference", runs) == {
        "reference": [300.0, 400.0], "reference:generate_tokens_per_s": [180.0, 160.0]}
    assert bench.combine_runs("train", [{"tokens_per_s": 1.0}]) == {"tokens_per_s": 1.0}
    assert bench.round_values("train", [{"tokens_per_s": 1.0, "mfu": 0.5}, {"error": "x"}]) == {
        "train": [1.0, None], "train:mfu": [0.5, None]}


def test_rounds_keep_every_run(tmp_path, monkeypatch):
    calls = []

    def fake_spawn(name, quick, threads, timeout, preload, **_):
        calls.append(name)
        n = len(calls)
        return ({"tokens_per_s": 100.0 + n, "mfu": n / 10, "batch": 8, "seq_len": 512,
                 "matmul": {"peak_flops": 2e11}, "compile_s": 9.0, "peak_rss_bytes": 2**30,
                 "memory": {"peak_estimate": 2**30}} if name == "train" else
                {"tokens_per_s": 50.0 + n, "decode_cost_ratio": {2: 1.1, 3: 1.6, 6: 1.3}[n],
                 "decode_step_s": {"64": 0.02, "1024": 0.03}, "ttft_s": 0.1,
                 "prompts": 8, "prompt_len": 64, "new_tokens": 256})
    monkeypatch.setattr(bench, "spawn", fake_spawn)
    out = tmp_path / "r.json"
    res = bench.main(["--workloads", "train,sample", "--rounds", "3", "--malloc", "system",
                      "--out", str(out)])
    assert calls == ["train", "sample", "sample", "train", "train", "sample"]
    assert json.loads(out.read_text())["runs"] == res["runs"]
    assert [r["mfu"] for r in res["runs"]["train"]] == [0.1, 0.4, 0.5]
    assert res["train"]["mfu"] == 0.4  # the median run by tokens/s, whole
    assert res["rounds"]["train:mfu"] == [0.1, 0.4, 0.5]
    assert res["rounds"]["sample:decode_cost_ratio"] == [1.1, 1.6, 1.3]
    # its own median run (the third), not the median run by tokens/s (the second)
    assert res["sample"]["decode_cost_ratio"] == 1.3 and res["sample"]["tokens_per_s"] == 53.0
    assert res["targets"]["decode_cost_1024_vs_64"]["value"] == 1.3
    assert "sample decode_cost_ratio per round" in bench.table(res)


def test_bad_workload_name():
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--workloads", "train,nope"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--workloads", "train", "--rounds", "0"])


def test_malloc_choice_and_worker_env(monkeypatch):
    import ctypes.util
    assert bench.malloc_preload("system") is None
    with pytest.raises(ValueError, match="choose from"):
        bench.malloc_preload("jemalloc")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert bench.malloc_preload("auto") is None
    with pytest.raises(ValueError, match="libtcmalloc-minimal4"):
        bench.malloc_preload("tcmalloc")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--workloads", "train", "--malloc", "tcmalloc"])
    monkeypatch.setattr(ctypes.util, "find_library",
                        lambda name: "libtcmalloc_minimal.so.4" if name == "tcmalloc_minimal" else None)
    assert bench.malloc_preload("auto") == bench.malloc_preload("tcmalloc") == "libtcmalloc_minimal.so.4"
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    assert bench.worker_env(2, "libtcmalloc_minimal.so.4")["LD_PRELOAD"] == \
        "libtcmalloc_minimal.so.4 libother.so"
    assert bench.worker_env(2)["LD_PRELOAD"] == "libother.so"


def test_quick_train_and_reference(tmp_path):
    res = _run(tmp_path, "train,reference")
    t = res["train"]
    for k in ("tokens_per_s", "mfu", "compile_s", "step_s", "achieved_flops",
              "peak_rss_bytes", "model_flops_per_step"):
        assert _pos(t[k]), (k, t[k])
    assert len(t["step_times_s"]) >= 5 and all(_pos(x) for x in t["step_times_s"])
    assert _pos(t["matmul"]["peak_flops"]) and _pos(t["memory"]["peak_estimate"])
    for mm in (t["matmul"], res["reference"]["matmul"]):  # the higher of before / after
        assert mm["peak_flops"] == max(mm["peak_flops_before_after"])
    assert math.isfinite(t["loss"])
    ref = res["reference"]
    for k in ("train_tokens_per_s", "generate_tokens_per_s", "ttft_s", "mfu"):
        assert _pos(ref[k]), (k, ref[k])
    assert _pos(ref["matmul"]["peak_flops"]) and ref["torch_threads"] >= 1
    for k in ("train_vs_reference", "train_mfu_vs_jax_peak", "jax_vs_torch_matmul_peak"):
        assert _pos(res["ratios"][k]), k
    assert res["targets"]["train_vs_reference"]["target"] == ">= 1.0"


def test_quick_sample(tmp_path):
    s = _run(tmp_path, "sample")["sample"]
    for k in ("tokens_per_s", "ttft_s", "generate_s", "first_call_s"):
        assert _pos(s[k]), (k, s[k])
    assert set(s["decode_step_s"]) == {"8", "32"}
    assert all(math.isfinite(v) for v in s["decode_step_s"].values())  # differences: noisy
    runs = s["decode_step_runs_s"]  # interleaved calls, 2 per context at --quick
    assert set(runs) == {"8", "32"} and all(len(v) == 2 and all(map(_pos, v)) for v in runs.values())
    assert s["decode_step_s"]["8"] == pytest.approx(statistics.median(runs["8"]))


def test_quick_rollout(tmp_path):
    """Static vs engine on the imposed long-tailed lengths: same samples, both sides timed."""
    ro = _run(tmp_path, "rollout")["rollout"]
    assert ro["preset"] == "quick" and ro["tokens_equal"]
    assert abs(ro["lengths"]["mean_over_max"] - 0.3) < 0.05
    for side in ("static", "engine"):
        assert ro[side]["useful_tokens"] == ro["lengths"]["useful"]
        assert _pos(ro[side]["useful_tokens_per_s"]) and 0 < ro[side]["slot_utilisation"] <= 1
    assert _pos(ro["engine_vs_static"])


def test_lognormal_budgets():
    from klear_jax.bench.rollout import lognormal_budgets
    b = lognormal_budgets(4096, 1000, 0.3)
    assert b.min() >= 1 and b.max() == 1000 and abs(b.mean() / 1000 - 0.3) < 0.005
    assert np.median(b) < b.mean()  # long right tail


@pytest.mark.slow
def test_quick_scale(tmp_path):
    sc = _run(tmp_path, "scale")["scale"]
    assert [r["seq_len"] for r in sc["seq"]] == [16, 32]
    assert all(_pos(r["tokens_per_s"]) and _pos(r["compile_s"]) for r in sc["seq"])
    assert [r["num_layers"] for r in sc["compile"]] == [1, 2]
    assert all(_pos(r["compile_s"]) for r in sc["compile"]) and _pos(sc["compile_ratio"])


def test_gpu_ratios_targets_and_table():
    res = {"gpu_train": {"shapes": [
               {"batch": 4, "seq_len": 4096, "tokens_per_s": 30000.0, "mfu": 0.5, "memory": {}},
               {"batch": 1, "seq_len": 16384, "tokens_per_s": 20000.0, "mfu": 0.4, "memory": {}}]},
           "gpu_reference": {"shapes": [{"tokens_per_s": 20000.0, "mfu": 0.3},
                                        {"tokens_per_s": 17000.0, "mfu": 0.26}],
                             "generate_tokens_per_s": 3000.0},
           "gpu_sample": {"tokens_per_s": 16000.0, "decode_vs_roofline": 1.8, "prompts": 64,
                          "prompt_len": 256, "new_tokens": 512, "decode_step_s": 0.0036,
                          "roofline_step_s": 0.002}}
    r = gpu.ratios(res)
    assert r["train_4x4096_vs_reference"] == pytest.approx(1.5)
    assert r["train_1x16384_vs_reference"] == pytest.approx(20 / 17)
    assert r["sample_vs_reference"] == pytest.approx(16 / 3)
    t = bench.targets(r, gpu.TARGETS)
    assert t["train_4x4096_vs_reference"]["met"] and not t["train_1x16384_vs_reference"]["met"]
    assert t["train_4x4096_mfu"]["met"] and not t["train_1x16384_mfu"]["met"]
    assert t["sample_vs_reference"]["met"] and not t["decode_step_vs_roofline"]["met"]
    res["targets"] = t
    text = bench.table(res)
    assert "4 x 4096" in text and "MISSED" in text and "PyTorch generate" in text


def test_decode_roofline_counts_weights_and_filled_cache():
    cfg = gpu.model_config(quick=True)
    roof = gpu.decode_roofline(cfg, rows=4, prompt_len=8, new_tokens=8, bytes_per_s=1e9)
    kv = 2 * cfg.num_layers * 4 * 12 * cfg.num_kv_heads * cfg.head_dim * 2
    assert roof["kv_bytes"] == kv and roof["weight_bytes"] > 0
    assert roof["roofline_step_s"] == pytest.approx((kv + roof["weight_bytes"]) / 1e9)


def test_gpu_preset_quick_runs_on_cpu(tmp_path):
    """The accelerator preset's code end to end at --quick sizes on the CPU (JAX and the
    torch reference): schema and positive numbers, no timings asserted."""
    out = tmp_path / "gpu.json"
    res = bench.main(["--preset", "gpu-1.7b", "--quick", "--out", str(out)])
    for w in gpu.WORKLOADS:
        assert "error" not in res[w], res[w]
    assert [(s["batch"], s["seq_len"]) for s in res["gpu_train"]["shapes"]] == [(2, 32), (1, 64)]
    assert all(_pos(s["tokens_per_s"]) and _pos(s["mfu"]) for s in res["gpu_train"]["shapes"])
    assert _pos(res["gpu_sample"]["decode_vs_roofline"])
    assert _pos(res["gpu_reference"]["generate_tokens_per_s"])
    assert {"train_2x32_vs_reference", "sample_vs_reference"} <= set(res["ratios"])
    assert json.loads(out.read_text())["workload"] == "gpu-1.7b-quick"
