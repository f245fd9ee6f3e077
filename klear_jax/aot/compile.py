"""Lowering and compiling the real jitted functions for a TPU topology, and the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from klear_jax import checkpoint as ckpt
from klear_jax import config as C
from klear_jax import logs
from klear_jax import optim
from klear_jax import sampling_utils as su
from klear_jax import sharding as shd
from klear_jax import train_step as ts
from klear_jax.flops import CHIPS, analytical_flops, roofline
from klear_jax.models import ModelConfig
from klear_jax.rl.step import batch_shapes as rl_batch_shapes
from klear_jax.rl.step import build_rl_step, build_rollout_cast, rl_optimizer
from klear_jax.engine import Engine
from klear_jax.sampler import Sampler, SamplingParams, _Static
from klear_jax.sft.step import batch_shapes as sft_batch_shapes
from klear_jax.sft.step import build_sft_step

GiB = 2 ** 30
WHAT = ("sft_step", "rl_step", "prefill", "decode", "engine_insert", "engine_decode")


# ------------------------------------------------------------------------------ topology
@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice: friendly name, libtpu topology name, chip kind (a key of CHIPS)."""
    name: str
    topology_name: str
    chip: str
    chip_config_name: str | None

    @property
    def hbm_bytes(self) -> int:
        return int(CHIPS[self.chip]["hbm_gib"] * GiB)


# v5p-N counts TensorCores (2 per chip; megacore makes a chip one JAX device): v5p-64 is
# 32 chips, 2x4x4. v6e-N counts chips (one TensorCore each): v6e-64 is 8x8.
_V5P = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8",
        512: "4x8x8"}
_V6E = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
TOPOLOGIES = {**{f"v5p-{n}": Topology(f"v5p-{n}", f"v5p:{t}", "v5p", "megacore")
                 for n, t in _V5P.items()},
              **{f"v6e-{n}": Topology(f"v6e-{n}", f"v6e:{t}", "v6e", None)
                 for n, t in _V6E.items()}}


def parse_topology(name: str) -> Topology:
    """``v5p-64`` / ``v6e-64`` (friendly) or a libtpu name such as ``v5p:2x2x2``."""
    if name in TOPOLOGIES:
        return TOPOLOGIES[name]
    chip, sep, dims = name.partition(":")
    if sep and chip in CHIPS and dims:
        return Topology(name, name, chip, "megacore" if chip == "v5p" else None)
    raise ValueError(f"--topology={name!r}: unknown; use one of {sorted(TOPOLOGIES)} or a "
                     f"libtpu name like 'v5p:2x2x2' / 'v6e:8x8'")


def topology_devices(topo: Topology) -> list:
    """The slice's devices (needs libtpu; no TPU hardware)."""
    # libtpu takes a machine-wide lock file; AOT needs no chip, so several compiles may share.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kw = dict(platform="tpu", topology_name=topo.topology_name, num_slices=1,
              chips_per_host_bounds=(2, 2, 1))
    if topo.chip_config_name:
        kw["chip_config_name"] = topo.chip_config_name
    return list(topologies.get_topology_desc(**kw).devices)


def libtpu_available() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------ abstract state
def sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def abstract_batch(spec: dict[str, tuple[tuple[int, ...], Any]], mesh) -> dict:
    bsh = ts.batch_sharding(mesh)
    return {k: sds(shape, dt, bsh) for k, (shape, dt) in spec.items()}


# ------------------------------------------------------------------------------ report
def memory_report(compiled, hbm_bytes: int) -> dict:
    ma = compiled.memory_analysis()
    f = lambda name: int(getattr(ma, name, 0) or 0)  # noqa: E731
    out = {"argument_bytes": f("argument_size_in_bytes"), "output_bytes": f("output_size_in_bytes"),
           "alias_bytes": f("alias_size_in_bytes"), "temp_bytes": f("temp_size_in_bytes"),
           "code_bytes": f("generated_code_size_in_bytes"),
           "host_temp_bytes": f("host_temp_size_in_bytes")}
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                          + out["temp_bytes"] + out["code_bytes"])
    out["hbm_bytes"] = hbm_bytes
    out["fits"] = out["total_bytes"] <= hbm_bytes
    return out


def cost_report(compiled) -> dict:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"xla_flops": float(ca.get("flops", 0.0)),
            "xla_bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "xla_transcendentals": float(ca.get("transcendentals", 0.0))}


def compile_one(name: str, lowered_fn, topo: Topology, n_devices: int, flops: dict,
                resident_bytes: int = 0) -> dict:
    """Lowers + compiles; returns the report for one function. ``resident_bytes``: per-chip
    memory that stays allocated beside it (the train state during rollouts), added to its
    total and its fit."""
    t0 = time.perf_counter()
    lowered = lowered_fn()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    rep = {"name": name, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2)}
    rep["memory"] = memory_report(compiled, topo.hbm_bytes)
    if resident_bytes:
        m = rep["memory"]
        m["resident_bytes"] = resident_bytes
        m["total_bytes"] += resident_bytes
        m["fits"] = m["total_bytes"] <= topo.hbm_bytes
    rep["cost"] = cost_report(compiled)
    rep["flops"] = flops
    rep["roofline"] = roofline(flops, topo.chip, n_devices)
    return rep


# ------------------------------------------------------------------------------ the functions
def _decode_slots(ro) -> int:
    """The engine's decode slots (``rollout.decode_slots``, 0 = the whole global batch)."""
    return ro.decode_slots or ro.prompts_per_step * ro.group_size


def build_jobs(cfg, mesh, what: tuple[str, ...]) -> dict:
    """name -> (thunk returning a Lowered, analytical flops dict)."""
    mcfg = ModelConfig(**C.model_kwargs(cfg.model))
    graphdef, params = ckpt.abstract_model(mcfg, mesh)
    is_rl = "rollout" in cfg
    if is_rl:
        optimizer, schedule = rl_optimizer(cfg)
    else:
        optimizer, schedule = optim.make_optimizer(cfg.optim, cfg.train.total_steps)
    state, shardings = ts.abstract_train_state(params, optimizer, mesh)
    jobs = {}

    if "sft_step" in what:
        if is_rl:
            raise ValueError("--what=sft_step needs an SFT config (this one has a rollout block)")
        step = build_sft_step(cfg, graphdef, optimizer, schedule, mesh, shardings)
        batch = abstract_batch(sft_batch_shapes(cfg), mesh)
        jobs["sft_step"] = (lambda: step.lower(state, batch),
                            analytical_flops(mcfg, "train", rows=cfg.train.batch_size,
                                             seq=cfg.train.seq_len))

    if not is_rl:
        unknown = set(what) - {"sft_step"}
        if unknown:
            raise ValueError(f"--what={','.join(sorted(unknown))} needs an RL config")
        return jobs

    if "rl_step" in what:
        step = build_rl_step(cfg, graphdef, optimizer, schedule, mesh, shardings)
        spec = rl_batch_shapes(cfg)
        R, T = spec["input_ids"][0]
        batch = abstract_batch(spec, mesh)
        jobs["rl_step"] = (lambda: step.lower(state, batch),
                           analytical_flops(mcfg, "train", rows=R, seq=T))

    # Rollouts read the policy's copy in the rollout dtype (bf16 under bf16 compute) while the
    # train state (f32 masters + optimizer) stays on the chips: the sampler functions take the
    # copy (the RL loop's cast, abstractly) as their argument and their reports add the train
    # state's bytes.
    cast = build_rollout_cast(cfg, mcfg, shardings)
    weights = jax.eval_shape(cast, params) if cast else params
    rollout = {}
    if "prefill" in what or "decode" in what:
        rollout.update(_sampler_jobs(cfg, mcfg, graphdef, weights, mesh, what))
    if "engine_insert" in what or "engine_decode" in what:
        rollout.update(_engine_jobs(cfg, mcfg, graphdef, weights, mesh, what))
    resident = per_chip_bytes(state)
    jobs.update({k: (lower, flops, resident) for k, (lower, flops) in rollout.items()})
    return jobs


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of sharded ShapeDtypeStructs."""
    return int(sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _engine_jobs(cfg, mcfg, graphdef, params, mesh, what) -> dict:
    """The rollout engine's two steps at the config's shapes: an insert of ``insert_rows``
    distinct prompts of max_prompt_len tokens (the largest variant) into the slot cache, and
    one decode chunk over every slot (carry donated in both)."""
    ro = cfg.rollout
    eng = Engine(graphdef, mesh=mesh, max_prompt_len=ro.max_prompt_len, slots=_decode_slots(ro),
                 chunk=ro.decode_chunk)
    sp = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                        repetition_penalty=ro.repetition_penalty,
                        max_new_tokens=ro.max_new_tokens, n=ro.group_size)
    state = nnx.State(params)
    with shd.use_mesh(mesh):
        _, _, Pl, S, _, (init, insert, decode) = eng._setup(state, sp, ro.max_prompt_len)
        shapes = jax.eval_shape(init)
    B, R = eng.slots, eng.insert_rows
    carry = jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh), shapes,
                         eng._carry_shardings(shapes))
    rep = NamedSharding(mesh, P())
    i32 = lambda *shape: sds(shape, jnp.int32, rep)  # noqa: E731
    scal = (sds((), jnp.uint32, rep), sds((), jnp.float32, rep), sds((), jnp.float32, rep),
            sds((), jnp.float32, rep), i32(8))
    ins = (i32(R, Pl), i32(R, Pl), i32(R), i32(R), i32(R), i32(R), i32(R), i32(R))
    keep = sds((B,), jnp.bool_, shd.named_sharding(mesh, ("act_batch",), (B,)))

    def lower(fn, *args):
        def go():
            with shd.use_mesh(mesh):
                return fn.lower(state, carry, *args, *scal)
        return go
    jobs = {}
    if "engine_insert" in what:
        jobs["engine_insert"] = (lower(insert, *ins), analytical_flops(
            mcfg, "prefill", rows=R, seq=Pl, cache=Pl))
    if "engine_decode" in what:
        jobs["engine_decode"] = (lower(decode, keep), analytical_flops(
            mcfg, "decode", rows=B, seq=ro.decode_chunk, cache=S))
    return jobs


def _sampler_jobs(cfg, mcfg, graphdef, params, mesh, what) -> dict:
    ro = cfg.rollout
    Pl, M, G = ro.max_prompt_len, ro.max_new_tokens, ro.group_size
    chunk = max(1, _decode_slots(ro) // G)  # as many rows as the engine has decode slots
    smp = Sampler(graphdef, mesh=mesh, max_prompt_len=Pl)
    st = _Static(max_new_tokens=M, n=G, greedy=ro.temperature <= su.GREEDY_TEMPERATURE,
                             top_k=ro.top_k, use_top_p=ro.top_p < 1.0,
                             use_penalty=ro.repetition_penalty != 1.0)
    prefill, decode = smp._functions(st)
    Bp = -(-chunk // smp.batch_multiple) * smp.batch_multiple
    B = Bp * G
    row2 = shd.named_sharding(mesh, ("act_batch", None), (Bp, Pl))
    row = lambda n: shd.named_sharding(mesh, ("act_batch",), (n,))  # noqa: E731
    rep = NamedSharding(mesh, P())
    state = nnx.State(params)
    p_args = (sds((Bp, Pl), jnp.int32, row2), sds((Bp, Pl), jnp.int32, row2),
              sds((Bp,), jnp.bool_, row(Bp)))
    k_args = (sds((B,), jnp.int32, row(B)), sds((B,), jnp.int32, row(B)))
    scal = (sds((), jnp.uint32, rep), sds((), jnp.float32, rep), sds((), jnp.float32, rep),
            sds((), jnp.float32, rep), sds((1,), jnp.int32, rep))

    def lower_prefill():
        with shd.use_mesh(mesh):
            return prefill.lower(state, *p_args, *k_args, *scal)

    cache = {}

    def compiled_prefill():
        if "c" not in cache:
            with shd.use_mesh(mesh):
                cache["c"] = prefill.lower(state, *p_args, *k_args, *scal).compile()
        return cache["c"]

    def lower_decode():
        # The carry comes out of prefill: its shapes, and the shardings prefill gives it.
        with shd.use_mesh(mesh):
            shapes = jax.eval_shape(prefill, state, *p_args, *k_args, *scal)
        out_sh = compiled_prefill().output_shardings
        carry = jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh), shapes, out_sh)
        with shd.use_mesh(mesh):
            return decode.lower(state, carry, *k_args, *scal, sds((B,), jnp.int32, row(B)))

    jobs = {}
    if "prefill" in what:
        jobs["prefill"] = (lower_prefill, analytical_flops(mcfg, "prefill", rows=Bp, seq=Pl,
                                                           cache=Pl + M))
    if "decode" in what:
        jobs["decode"] = (lower_decode, analytical_flops(mcfg, "decode", rows=B, seq=M,
                                                         cache=Pl + M))
    return jobs


def run(config: str, topology: str, what: tuple[str, ...] | None = None,
        overrides=()) -> dict:
    """Compiles ``what`` for ``config`` on ``topology``; returns the JSON-able report."""
    topo = parse_topology(topology)
    if not libtpu_available():
        raise RuntimeError("klear_jax.aot needs libtpu (pip install libtpu==0.0.42.1, the "
                           "version jax[tpu]==0.10.2 pins) to compile for TPU from this host")
    cfg = C.load_config(config)
    C.apply_overrides(cfg, overrides)
    is_rl = "rollout" in cfg
    what = tuple(what or (("rl_step", "engine_insert", "engine_decode") if is_rl
                          else ("sft_step",)))
    bad = set(what) - set(WHAT)
    if bad:
        raise ValueError(f"--what: unknown {sorted(bad)}; allowed {WHAT}")
    devices = topology_devices(topo)
    C.validate_mesh(cfg, len(devices))
    mesh = shd.mesh_from_config(cfg.mesh, devices=devices)
    report = {"config": config, "overrides": list(overrides), "topology": topo.name,
              "topology_name": topo.topology_name, "chip": topo.chip, "devices": len(devices),
              "device_kind": devices[0].device_kind, "mesh": dict(mesh.shape),
              "jax": jax.__version__, "functions": []}
    # Lowering happens under the topology's mesh, so attention "auto" resolves to the TPU
    # kernel (klear_jax.backend decides from the mesh's platform).
    jobs = build_jobs(cfg, mesh, what)
    for name in what:
        lower_fn, flops, *resident = jobs[name]
        report["functions"].append(compile_one(name, lower_fn, topo, len(devices), flops,
                                               *resident))
    return report


def format_report(rep: dict) -> str:
    big = max((f["memory"]["total_bytes"] for f in rep["functions"]), default=0) >= GiB
    unit, div = ("GiB", GiB) if big else ("MiB", 2 ** 20)
    g = lambda b: f"{b / div:7.2f}"  # noqa: E731
    lines = [f"{rep['config']} on {rep['topology']} ({rep['topology_name']}, {rep['devices']} x "
             f"{rep['device_kind']}), mesh {rep['mesh']}",
             f"{'function':13s} {'args':>7s} {'out':>7s} {'alias':>7s} {'temp':>7s} "
             f"{'total':>7s} {'HBM':>6s}  fits  compile_s  model_TFLOP  xla_TFLOP   est_s    MFU"]
    for f in rep["functions"]:
        m, c, fl, r = f["memory"], f["cost"], f["flops"], f["roofline"]
        lines.append(f"{f['name']:13s} {g(m['argument_bytes'])} {g(m['output_bytes'])} "
                     f"{g(m['alias_bytes'])} {g(m['temp_bytes'])} {g(m['total_bytes'])} "
                     f"{m['hbm_bytes'] / div:6.0f}  {'yes ' if m['fits'] else 'NO  '} "
                     f"{f['compile_s']:9.1f}  {fl['model_flops'] / 1e12:11.1f}  "
                     f"{c['xla_flops'] / 1e12:9.2f} {r['est_time_s']:7.3f} {r['implied_mfu']:6.2f}")
    lines.append(f"memory in {unit} per chip; model_TFLOP analytical for the whole slice; xla_TFLOP "
                 "per chip, counting each scanned/looped body once")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m klear_jax.aot",
                                 description="Ahead-of-time compilation for a Cloud TPU topology.")
    ap.add_argument("--config", required=True, help="configs/x.py[:variant]")
    ap.add_argument("--topology", required=True, help=f"one of {sorted(TOPOLOGIES)} or 'v5p:2x2x2'")
    ap.add_argument("--what", default="", help=f"comma list of {WHAT} (default: all for the config)")
    ap.add_argument("--out", default="", help="write the JSON report here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. --set model.remat_policy=dots (repeatable)")
    logs.add_argument(ap)
    a = ap.parse_args(argv)
    logs.setup(a.verbosity)
    what = tuple(w for w in a.what.split(",") if w) or None
    rep = run(a.config, a.topology, what, a.set)
    print(format_report(rep))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if all(f["memory"]["fits"] for f in rep["functions"]) else 1
