"""Every platform-specific choice, in one place.

The model, the train step and the sampler are written once; what differs between CPU, GPU
and TPU is decided here, from the platform the code is being *compiled for*: the active
mesh's devices (TPU devices when compiling ahead of time for a TPU topology from a CPU host),
else JAX's default backend.

* ``attention_impl(requested)``: the attention kernel. ``"auto"`` is splash (Pallas) on TPU,
  the fused GPU kernel on GPU, the XLA path on CPU.
* ``pallas_interpret()``: Pallas kernels run in interpret mode on CPU (tests, the demo).
* ``compiler_options(mesh)``: XLA options for training-shaped programs.
* ``decode_block()``: key-block size of the rollout engine's decode attention (a slot
  cache's length is a multiple of it).
* ``cpu_kernels()``: the CPU-tuned matmul gradient and attention forms of
  ``klear_jax.models.cpu_kernels`` are used (CPU only: they exist for the CPU tests, the
  demo and the CPU benchmark; TPU and GPU get XLA's own einsums).
"""

from __future__ import annotations

import logging

import jax

from klear_jax import sharding as shd

log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("auto", "xla", "splash", "gpu_flash")

# XLA CPU hands dots to YNNPACK by default. For training-shaped dots (thousands of rows) Eigen
# was faster (bench-small train step 10.38 -> 9.79 s, 8 interleaved rounds), so training
# leaves dots out; it keeps YNNPACK's reductions, which reduce an elementwise expression in
# one pass (x^2 of an RMSNorm, exp(s - m) of a softmax over 32000 logits) where XLA's tree
# rewrite writes it out first (7.20 -> 6.93 s, 10 interleaved pairs). Decoding keeps the
# default (Eigen dots were slower for 8-row dots). docs/performance.md has the runs.
CPU_TRAINING_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


def target_platform() -> str:
    """'cpu' | 'gpu' | 'tpu': the active mesh's platform, else the default backend's."""
    mesh = shd.current_mesh()
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def cpu_kernels() -> bool:
    return target_platform() == "cpu"


# Key block of the slot-cache decode loop (``models/decode_attention.py``): one loop trip
# gathers a [slots, K, hd, block] slab. CPU: 128, measured (benchmarks/engine_cache_layout.py,
# docs/engine.md: at 2048 / 8192 cache entries 128 beat 64, whose strided gathers cost ~2x,
# and 256 / 512, which read further past each slot's fill). TPU / GPU: 512, not measured
# (a multiple of the 128 TPU lanes; amortises a trip's fixed cost over more keys).
DECODE_BLOCK = {"cpu": 128, "gpu": 512, "tpu": 512}


def decode_block() -> int:
    return DECODE_BLOCK.get(target_platform(), 512)


def pallas_interpret() -> bool:
    """Pallas kernels compile for TPU / GPU; on a CPU backend they run interpreted."""
    return target_platform() == "cpu"


def compiler_options(mesh) -> dict | None:
    """``jax.jit`` compiler options for training-shaped programs (train step, log-prob pass)
    on ``mesh``: CPU_TRAINING_COMPILER_OPTIONS on a CPU mesh, XLA's defaults elsewhere."""
    return dict(CPU_TRAINING_COMPILER_OPTIONS) if mesh.devices.flat[0].platform == "cpu" else None


_warned: set[str] = set()


def attention_impl(requested: str) -> str:
    """The attention kernel to trace for rows that attend within themselves (T == S):
    ``requested`` unless it is "auto" (splash on TPU, the fused GPU kernel on GPU, XLA on
    CPU)."""
    if requested not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {requested!r} unknown; allowed {ATTENTION_IMPLS}")
    if requested != "auto":
        return requested
    return {"tpu": "splash", "gpu": "gpu_flash"}.get(target_platform(), "xla")


def warn_fallback(impl: str, why: str) -> None:
    """One warning per (kernel, reason) when a kernel falls back to the XLA path."""
    key = f"{impl}: {why}"
    if key not in _warned:
        _warned.add(key)
        log.warning("attention %s not used (%s); falling back to the XLA path", impl, why)
