"""AOT compilation for a real TPU topology from the CPU host: small cases on v5p:2x2x2
(megacore: 8 chips), and every paper config (Qwen3-8B SFT, GPPO math, GPPO code) on the pod
slices it was sized for, v5p-64 and v6e-64, which must fit the chip's HBM.

Needs libtpu (requirements-test.txt); skipped with a reason when it is not importable.
"""

import math

import pytest

from klear_jax import aot
from klear_jax.flops import analytical_flops, param_count, roofline
from klear_jax.models import ModelConfig

pytestmark = pytest.mark.skipif(not aot.libtpu_available(),
                                reason="libtpu not installed: pip install libtpu==0.0.42.1")

TOPO = "v5p:2x2x2"
# Small enough to compile in seconds, long enough (T = 256) for real splash tiles.
SMALL = ["model.max_position_embeddings=1024", "train.seq_len=256", "train.batch_size=16"]


def _check_memory(fn):
    m = fn["memory"]
    for k in ("argument_bytes", "output_bytes", "temp_bytes", "total_bytes"):
        assert m[k] > 0, (fn["name"], k, m)
    assert m["hbm_bytes"] == 95 * 2 ** 30
    assert m["total_bytes"] < m["hbm_bytes"] and m["fits"]
    assert m["alias_bytes"] <= m["argument_bytes"]
    assert fn["compile_s"] > 0


def test_parse_topology():
    t = aot.parse_topology("v5p-64")
    assert (t.topology_name, t.chip_config_name, t.chip) == ("v5p:2x4x4", "megacore", "v5p")
    assert aot.parse_topology("v6e-64").topology_name == "v6e:8x8"
    assert aot.parse_topology("v6e-64").hbm_bytes == 32 * 2 ** 30
    assert aot.parse_topology("v5p:2x2x2").chip == "v5p"
    with pytest.raises(ValueError, match="unknown"):
        aot.parse_topology("v9x-8")


def test_topology_device_counts():
    # v5p-N counts TensorCores (2 per chip, one megacore device each); v6e-N counts chips.
    assert len(aot.topology_devices(aot.parse_topology("v5p-16"))) == 8
    assert len(aot.topology_devices(aot.parse_topology("v5p-64"))) == 32
    assert len(aot.topology_devices(aot.parse_topology("v6e-64"))) == 64


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_sft_step_compiles_for_v5p(impl):
    rep = aot.run("configs/sft_tiny.py", TOPO, ("sft_step",),
                  SMALL + [f"model.attention_impl={impl}"])
    assert rep["devices"] == 8 and rep["device_kind"].startswith("TPU v5")
    assert rep["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    (fn,) = rep["functions"]
    _check_memory(fn)
    # donated train state: the output state aliases the arguments
    assert fn["memory"]["alias_bytes"] > 0
    assert fn["cost"]["xla_flops"] > 0
    assert fn["flops"]["model_flops"] > 0 and 0 < fn["roofline"]["implied_mfu"] <= 1


def test_sampler_decode_compiles_for_v5p():
    rep = aot.run("configs/gppo_tiny.py", TOPO, ("decode",),
                  ["model.max_position_embeddings=1024", "rollout.max_prompt_len=64",
                   "rollout.max_new_tokens=64"])
    (fn,) = rep["functions"]
    _check_memory(fn)
    assert fn["memory"]["alias_bytes"] > 0  # the carry (KV cache) is donated


def test_engine_steps_compile_for_v5p():
    rep = aot.run("configs/gppo_tiny.py", TOPO, ("engine_insert", "engine_decode"),
                  ["model.max_position_embeddings=1024", "rollout.max_prompt_len=64",
                   "rollout.max_new_tokens=64"])
    for fn in rep["functions"]:
        _check_memory(fn)
        assert fn["memory"]["alias_bytes"] > 0  # the carry (slot cache) is donated


def test_splash_compiles_as_tpu_kernel():
    """The splash path lowers to a Mosaic custom call, not interpret-mode HLO."""
    import jax
    from klear_jax import config as C, sharding as shd
    cfg = C.load_config("configs/sft_tiny.py")
    C.apply_overrides(cfg, SMALL + ["model.attention_impl=splash"])
    mesh = shd.mesh_from_config(cfg.mesh, aot.topology_devices(aot.parse_topology(TOPO)))
    lower, _ = aot.build_jobs(cfg, mesh, ("sft_step",))["sft_step"]
    text = lower().as_text()
    assert "tpu_custom_call" in text
    assert jax.default_backend() == "cpu"


def test_analytical_flops_qwen3_8b():
    m = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                    num_heads=32, num_kv_heads=8, head_dim=128, remat_policy="full")
    assert math.isclose(param_count(m), 8.19e9, rel_tol=0.01)  # Qwen3-8B: 8.19B params
    f = analytical_flops(m, "train", rows=1, seq=1)
    non_embed = param_count(m) - m.vocab_size * m.hidden_size - m.hidden_size  # head stays
    assert math.isclose(f["model_flops"], 6 * non_embed + 3 * 4 * 36 * 32 * 128, rel_tol=1e-3)
    assert f["hw_flops"] == pytest.approx(f["model_flops"] * 4 / 3)
    r = roofline(f, "v5p", 32)
    assert r["implied_mfu"] == pytest.approx(0.75)


# ------------------------------------------------------------------------------ the paper pods
# Every paper config on both slices, as docs/aot.md runs them: each function must fit a chip.
# One test per (config, slice) so xdist spreads them over workers; inside one, aot.run
# builds the abstract model once and compiles all the config's functions in one process.
# The GPPO code config's sampler (prefill, decode; the rollout engine's insert and decode
# chunk, what RL runs) reads only model / mesh / rollout, equal to the math config's
# (asserted), so the math test's sampler functions cover it. Rollout functions count the
# train state that stays on the chips beside the bf16 weights copy they read.
PAPER = [
    ("configs/sft_qwen3_8b.py", "v5p-64", ("sft_step",)),
    ("configs/sft_qwen3_8b.py:chips=64", "v6e-64", ("sft_step",)),
    ("configs/gppo_math_qwen3_8b.py", "v5p-64",
     ("rl_step", "prefill", "decode", "engine_insert", "engine_decode")),
    ("configs/gppo_math_qwen3_8b.py:chips=64,tensor=4", "v6e-64",
     ("rl_step", "prefill", "decode", "engine_insert", "engine_decode")),
    ("configs/gppo_code_qwen3_8b.py", "v5p-64", ("rl_step",)),
    ("configs/gppo_code_qwen3_8b.py:chips=64,tensor=4", "v6e-64", ("rl_step",)),
]


@pytest.mark.parametrize("config,topology,what", PAPER,
                         ids=[f"{c.split('/')[-1].replace('.py', '')}-{t}" for c, t, _ in PAPER])
def test_paper_config_fits_pod(config, topology, what):
    rep = aot.run(config, topology, what)
    table = aot.format_report(rep)
    print(table)  # the per-chip numbers, with pytest -s (docs/aot.md)
    assert [f["name"] for f in rep["functions"]] == list(what)
    for fn in rep["functions"]:
        m = fn["memory"]
        assert m["temp_bytes"] > 0 and m["argument_bytes"] > 0, (fn["name"], m)
        assert m["fits"], f"{fn['name']} does not fit {topology}:\n{table}"


def test_gppo_code_sampler_is_the_math_sampler():
    """What the sampler functions read is equal in the two GPPO configs (both slices), so
    test_paper_config_fits_pod compiles prefill / decode once, under the math config."""
    from klear_jax import config as C
    for variant in ("", ":chips=64,tensor=4"):
        math_cfg = C.load_config(f"configs/gppo_math_qwen3_8b.py{variant}")
        code_cfg = C.load_config(f"configs/gppo_code_qwen3_8b.py{variant}")
        plain = lambda x: x.to_dict() if hasattr(x, "to_dict") else dict(x)  # noqa: E731
        for key in ("model", "mesh", "rollout"):
            assert plain(code_cfg[key]) == plain(math_cfg[key]), key
