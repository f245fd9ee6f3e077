"""Measuring helpers shared by the benchmark workloads and the PyTorch reference: run orders,
matmul peaks (the MFU denominators), peak memory; the bench table's row format."""

from __future__ import annotations

import resource
import statistics
import time

import jax
import jax.numpy as jnp

from klear_jax.backend import CPU_TRAINING_COMPILER_OPTIONS


def round_orders(names: list, rounds: int) -> list[list]:
    """The order of ``names`` per round, reversed every other round: train, reference,
    reference, train for two rounds (ABBA), so that a drift in the box's speed hits both
    sides alike."""
    return [list(names) if r % 2 == 0 else list(names)[::-1] for r in range(rounds)]


def row(key: str, value) -> str:
    """One line of the bench table: the key in a 44-character column, then the value."""
    return f"  {key:<44s} {value}"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def jax_matmul_peak(n: int, reps: int, dtype=jnp.float32) -> dict:
    """[n, n] @ [n, n] throughput of a jitted jnp.dot in ``dtype``: best and median of
    ``reps`` timed calls. On CPU it is also compiled with the train step's options (Eigen
    dots; ``backend.CPU_TRAINING_COMPILER_OPTIONS``), timed interleaved, and ``peak_flops``
    is the best variant's: the MFU denominator."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    lowered = jax.jit(jnp.dot).lower(a, b)
    variants = {"default": lowered.compile()}
    if jax.default_backend() == "cpu":
        variants["training_options"] = lowered.compile(
            compiler_options=CPU_TRAINING_COMPILER_OPTIONS)
    times = {name: [] for name in variants}
    for f in variants.values():
        f(a, b).block_until_ready()
    for _ in range(reps):
        for name, f in variants.items():
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    flops = 2.0 * n ** 3
    out = {"n": n, "dtype": jnp.dtype(dtype).name,
           "by_options": {name: {"peak_flops": flops / min(ts),
                                 "median_flops": flops / statistics.median(ts)}
                          for name, ts in times.items()}}
    best = max(out["by_options"].values(), key=lambda r: r["peak_flops"])
    out.update(best)
    return out


def copy_bandwidth(n_bytes: int, reps: int) -> dict:
    """Device memory bandwidth of a jitted elementwise pass over an ``n_bytes`` bf16 array
    (reads and writes it once: 2 x n_bytes moved): best of ``reps``, bytes/s."""
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda v: v * 2)
    f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return {"bytes": n_bytes, "bytes_per_s": 2.0 * n_bytes / min(times),
            "median_bytes_per_s": 2.0 * n_bytes / statistics.median(times)}


def bracket_peak(before: dict, after: dict) -> dict:
    """The higher of two matmul peak measurements, one taken before and one after the timed
    steps, with both kept (``peak_flops_before_after``): a slow window of the box while one
    is measured cannot shrink the MFU denominator (one measurement before the steps did:
    184 against 206-212 GFLOP/s in the other rounds of one run, docs/performance.md)."""
    best = dict(max((before, after), key=lambda m: m["peak_flops"]))
    best["peak_flops_before_after"] = [before["peak_flops"], after["peak_flops"]]
    return best
