"""Fused attention for NVIDIA GPUs on training rows (T == S), with the semantics of
``klear_jax.models.attention.xla_attention``::

    allowed[b, t, s] = (s <= t) & (q_seg[b, t] == kv_seg[b, s]) & (kv_seg[b, s] != 0)

Causal is by *index* (as in ``splash.py``: inside a packed or left-padded row positions grow
with the index wherever the segment test passes), so positions are accepted for signature
parity and not read. Padding rows (q segment 0) return zeros. Grouped-query attention reads
kv head h // G for query head h: K/V are never repeated (except under a mesh whose tensor
axis does not divide K, see ``run_sharded``).

Two candidates, chosen by name (``IMPLS``); ``supports`` says in one line why one cannot run
a call, ``choose`` takes the first that can (the caller falls back to XLA, naming why):

``"pallas"``  Pallas Triton flash attention (``gpu_flash.py``): a forward kernel and two
              backward kernels (dQ per query head; dK, dV per kv head looping over its G
              query heads, so no atomics and no repeat), adapted from
              ``jax.experimental.pallas.ops.gpu.attention`` (which has segment ids but
              neither GQA nor separate q / kv ids, and is deprecated in jax 0.11 in favour of
              tokamax, absent from the GPU image). Exact mask above, any float dtype, any
              Triton GPU, any T (padded to the block size with segment 0). Runs on CPU in
              interpret mode (the tests).
``"cudnn"``   cuDNN flash attention through jax's cuDNN fused attention in its packed
              (ragged) layout: each row is cut into its runs of equal segment id, padding runs
              included, which tile the row with no gaps; every run is one cuDNN sequence with
              a causal mask (``segment_runs``). ``jax.nn.dot_product_attention(...,
              implementation="cudnn")`` itself takes no segment ids and only right padding
              (``query_seq_lengths``), or a dense [B, 1, T, S] mask, so the packed layout is
              reached through ``jax._src.cudnn.fused_attention_stablehlo`` (what jax.nn calls).
              Needs: a CUDA GPU of compute capability >= 9.0 (packed layout), bf16 / fp16,
              head_dim <= 256 and a multiple of 8, cuDNN >= 9.6, segments as contiguous runs
              (true of packed and padded rows), and for GQA jax >= 0.11 (jax 0.10 scales the
              kv offsets by the query head count, fixed in 0.11). The run count per row is a
              static bound, ``max_segments``: cuDNN treats a row as that many sequences of
              length T, so its workspace and time grow with it (H200, 16 heads, hd 128,
              4 x 4096 packed rows: M = 4 / 8 / 64 took 1.7 / 2.0 / 3.4 ms forward + backward
              and 1.1 / 2.1 / 16.2 GiB temp). A shard holding a row with more runs runs the
              Pallas kernel instead (``lax.cond``), so results are exact for any rows.

Measured on one H200 (jax 0.11.2, cuDNN 9.19; ``benchmarks/gpu_attention_check.py``), one
layer's forward + backward, 16 / 8 heads, hd 128, one-segment rows: 4 x 4096 tokens XLA 17.7
ms (11 GiB temp), cuDNN 2.5 ms (``jax.nn``'s causal cuDNN: the same), Pallas 5.5 ms; 1 x 16384
XLA 70 ms (44 GiB), cuDNN 7.4, Pallas 20.6. Hence the order of ``IMPLS``: cuDNN, then Pallas
where cuDNN cannot run. Both match XLA (values and dq / dk / dv within bf16 rounding) there.
Shapes: B batch, T time (== S), H query heads, K kv heads, G = H / K, hd head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from klear_jax.sharding import current_mesh, logical_to_spec

IMPLS = ("cudnn", "pallas")  # in ``choose``'s order of preference: measured, module docstring
# cuDNN: runs per row (segments + padding runs) the packed layout holds; a GPPO row has at most
# 3 (left padding, prompt + response, right padding); rows with more take the Pallas kernel.
DEFAULT_MAX_SEGMENTS = 8
Q_NAMES = ("act_batch", "act_length", "act_q_heads", "act_head_dim")
KV_NAMES = ("act_batch", "act_length", "act_kv_heads", "act_head_dim")


# ------------------------------------------------------------------------ capability checks
def _device(device=None):
    if device is not None:
        return device
    mesh = current_mesh()
    if mesh is not None and not mesh.empty:
        return mesh.devices.flat[0]
    return jax.devices()[0]


def _compute_capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def _cudnn_version() -> int | None:
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:  # noqa: BLE001 - no cuDNN library loaded
        return None


def _jax_version() -> tuple[int, int]:
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def _shape_reason(q, k) -> str | None:
    if len(q.shape) != 4 or len(k.shape) != 4:
        return f"q, k must be [B, T, N, hd], got {tuple(q.shape)} and {tuple(k.shape)}"
    if k.shape[1] != q.shape[1]:
        return (f"needs T == S (training rows), got q length {q.shape[1]} and kv length "
                f"{k.shape[1]}")
    if q.shape[2] % k.shape[2]:
        return f"{q.shape[2]} query heads not a multiple of {k.shape[2]} kv heads"
    if q.shape[3] != k.shape[3]:
        return f"q head_dim {q.shape[3]} != k head_dim {k.shape[3]}"
    return None


def supports(impl: str, q, k, *, device=None, interpret: bool = False) -> str | None:
    """None when ``impl`` can run attention of q [B, T, H, hd] over k [B, T, K, hd] (arrays or
    ShapeDtypeStructs) on ``device`` (default: the active mesh's first device, else
    jax.devices()[0]); otherwise a one-line reason. ``interpret``: Pallas interpret mode
    (any backend; CPU tests)."""
    if impl not in IMPLS:
        return f"unknown GPU attention impl {impl!r} (one of {IMPLS})"
    reason = _shape_reason(q, k)
    if reason:
        return reason
    dev = _device(device)
    dtype = jnp.dtype(q.dtype)
    if impl == "pallas":
        if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
            return f"Pallas attention takes float16 / bfloat16 / float32, got {dtype}"
        if not interpret and dev.platform != "gpu":
            return f"Pallas Triton needs a GPU, not {dev.platform} (or interpret mode)"
        return None
    client = getattr(dev, "client", None)
    return cudnn_reason(q.shape, k.shape, dtype, platform=dev.platform,
                        platform_version=str(getattr(client, "platform_version", "")),
                        compute_capability=_compute_capability(dev),
                        cudnn_version=_cudnn_version() if dev.platform == "gpu" else None,
                        jax_version=_jax_version())


def cudnn_reason(q_shape, k_shape, dtype, *, platform: str, platform_version: str,
                 compute_capability: tuple[int, int] | None, cudnn_version: int | None,
                 jax_version: tuple[int, int]) -> str | None:
    """``supports('cudnn', ...)``'s decision from the facts it gathered: None or why not."""
    if platform != "gpu" or "cuda" not in platform_version.lower():
        return f"cuDNN needs a CUDA GPU, not {platform if platform != 'gpu' else platform_version}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention takes bfloat16 / float16, got {jnp.dtype(dtype)}"
    hd = q_shape[3]
    if hd > 256 or hd % 8:
        return f"cuDNN flash attention needs head_dim <= 256 and a multiple of 8, got {hd}"
    if compute_capability is None or compute_capability < (9, 0):
        return ("cuDNN packed (segment) layout needs compute capability >= 9.0, got "
                f"{compute_capability}")
    if cudnn_version is None or cudnn_version < 90600:
        return f"cuDNN packed layout needs cuDNN >= 9.6, found {cudnn_version}"
    if q_shape[2] != k_shape[2] and tuple(jax_version) < (0, 11):
        return (f"cuDNN packed layout with GQA needs jax >= 0.11 (jax "
                f"{'.'.join(map(str, jax_version))} scales kv offsets by the query head count)")
    return None


def choose(q, k, *, device=None, interpret: bool = False) -> tuple[str | None, dict[str, str]]:
    """(first impl of ``IMPLS`` that ``supports`` this call or None, {impl: reason} for the
    ones skipped before it, or all when none fits)."""
    reasons = {}
    for impl in IMPLS:
        reason = supports(impl, q, k, device=device, interpret=interpret)
        if reason is None:
            return impl, reasons
        reasons[impl] = reason
    return None, reasons


# ------------------------------------------------------------------------ public entry point
def gpu_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
                  impl: str = "pallas", interpret: bool = False,
                  block_sizes=None,
                  max_segments: int = DEFAULT_MAX_SEGMENTS):
    """Causal, segment-masked grouped-query attention with a fused GPU kernel.

    Args:
      q: [B, T, H, hd]; k, v: [B, T, K, hd], H a multiple of K.
      q_positions, kv_positions: int [B, T]; not read (causal by index, module docstring).
      q_segment_ids, kv_segment_ids: int [B, T]; equal ids attend, 0 is padding.
      impl: "pallas" or "cudnn" (see the module docstring; ``supports`` first).
      interpret: Pallas interpret mode (CPU tests).
      block_sizes: Pallas tile sizes, a ``gpu_flash.BlockSizes`` (default: its defaults).
      max_segments: cuDNN: static bound on runs of equal segment id per row (beyond it the
        shard runs the Pallas kernel).

    Returns [B, T, H, hd] in q's dtype; rows whose q segment id is 0 are zeros. Under
    ``klear_jax.sharding.use_mesh(mesh)`` with several devices it runs inside
    ``jax.shard_map`` (batch over data / fsdp, heads over tensor).
    """
    del q_positions, kv_positions
    reason = _shape_reason(q, k)
    if reason:
        raise ValueError(f"gpu_attention: {reason}")
    B, T = q.shape[:2]
    for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if x.shape != (B, T):
            raise ValueError(f"gpu_attention: {name} must be [B, T] = {(B, T)}, got {x.shape}")
    if impl == "pallas":
        from klear_jax.models.gpu_flash import pallas_attention  # lazy: Pallas import is heavy
        local = functools.partial(pallas_attention, block_sizes=block_sizes,
                                  interpret=interpret)
    elif impl == "cudnn":
        local = functools.partial(cudnn_attention, max_segments=max_segments)
    else:
        raise ValueError(f"gpu_attention: impl {impl!r} unknown (one of {IMPLS})")
    return run_sharded(local, q, k, v, q_segment_ids.astype(jnp.int32),
                       kv_segment_ids.astype(jnp.int32))


def run_sharded(local, q, k, v, q_seg, kv_seg):
    """``local(q, k, v, q_seg, kv_seg)`` per shard of the active mesh (as splash does): batch
    over the q batch axes, heads over 'tensor'. Query shard i holds heads [i H/n, (i+1) H/n),
    which read kv heads [i K/n, (i+1) K/n): kv heads are split the same n ways, or repeated up
    to H when K does not divide by n (the only case that repeats K/V)."""
    mesh = current_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return local(q, k, v, q_seg, kv_seg)
    P = jax.sharding.PartitionSpec
    q_spec = logical_to_spec(Q_NAMES, q.shape, mesh)
    kv_spec = logical_to_spec(KV_NAMES, k.shape, mesh)
    head_axes = q_spec[2]
    n_head = math.prod(mesh.shape[a] for a in
                       ((head_axes,) if isinstance(head_axes, str) else (head_axes or ())))
    H, K = q.shape[2], k.shape[2]
    if kv_spec[2] != head_axes and K % n_head:
        k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
    kv_spec = P(q_spec[0], kv_spec[1], head_axes, kv_spec[3])
    seg_spec = P(q_spec[0], None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)
    return fn(q, k, v, q_seg, kv_seg)


# ------------------------------------------------------------------------ cuDNN (packed layout)
def segment_runs(segment_ids, max_segments: int):
    """Cut each row into its runs of equal segment id (padding runs included), cuDNN's packed
    layout as ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` takes it.

    segment_ids int [B, T] -> (seqlens int32 [B, M], offsets int32 [B, M + 1], overflow bool
    [B]) with M = max(max_segments, 2): run m of row b covers indices [offsets[b, m],
    offsets[b, m] + seqlens[b, m]); unused entries are -1 (offsets has one more, as the API
    wants). M >= 2 keeps jax on its packed path (it reshapes seqlens / offsets only for more
    than one segment per row). ``overflow[b]``: row b has more than M runs (the runs after
    the M-th are dropped).
    """
    B, T = segment_ids.shape
    M = max(int(max_segments), 2)
    seg = segment_ids.astype(jnp.int32)
    idx = jnp.arange(T, dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1  # run index of each token
    n_runs = run[:, -1] + 1
    # Start of run m = the index whose start flag is set and whose run index is m.
    slot = jnp.where(start, run, M)  # runs >= M go to a dropped slot
    starts = jnp.full((B, M + 1), T, jnp.int32).at[jnp.arange(B)[:, None], slot].min(
        jnp.broadcast_to(idx, (B, T)))
    starts = starts[:, :M]
    used = jnp.arange(M)[None, :] < n_runs[:, None]
    ends = jnp.concatenate([starts[:, 1:], jnp.full((B, 1), T, jnp.int32)], axis=1)
    ends = jnp.where(jnp.arange(M)[None, :] + 1 < n_runs[:, None], ends, T)
    seqlens = jnp.where(used, ends - starts, -1)
    offsets = jnp.concatenate([jnp.where(used, starts, -1), jnp.full((B, 1), -1, jnp.int32)],
                              axis=1)
    return seqlens, offsets, n_runs > M


def cudnn_attention(q, k, v, q_seg, kv_seg, *, max_segments: int = DEFAULT_MAX_SEGMENTS):
    """Per-shard cuDNN flash attention in the packed layout. q [B, T, H, hd], k / v
    [B, T, K, hd], segment ids int32 [B, T] -> [B, T, H, hd] (padding rows zero). Needs what
    ``supports('cudnn', ...)`` checks. A shard holding a row of more than ``max_segments``
    runs runs the Pallas kernel instead, picked at run time."""
    from klear_jax.models.gpu_flash import pallas_attention
    return packed_or_fallback(q, k, v, q_seg, kv_seg, max_segments, _cudnn_packed,
                              pallas_attention)


def _cudnn_packed(q, k, v, q_runs, kv_runs):
    """cuDNN over the runs ``(seqlens, offsets)`` of ``segment_runs``, causal inside each."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa
    return cudnn_dpa(q, k, v, q_seqlen=q_runs[0], kv_seqlen=kv_runs[0], q_offsets=q_runs[1],
                     kv_offsets=kv_runs[1], scale=q.shape[-1] ** -0.5,
                     mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


def packed_or_fallback(q, k, v, q_seg, kv_seg, max_segments: int, packed, fallback):
    """``packed(q, k, v, q_runs, kv_runs)`` on the runs of the segment ids (M =
    ``max_segments`` slots per row), padding rows zeroed after; or, when a row has more runs
    than that, ``fallback(q, k, v, q_seg, kv_seg)`` (``lax.cond``: exact for any rows, and the
    packed kernel's speed and memory for rows within the bound). Shapes as ``cudnn_attention``.
    """
    q_len, q_off, q_over = segment_runs(q_seg, max_segments)
    kv_len, kv_off, kv_over = segment_runs(kv_seg, max_segments)

    def use_packed(q, k, v, q_seg, kv_seg):
        out = packed(q, k, v, (q_len, q_off), (kv_len, kv_off))
        return zero_padding_rows(out, q_seg)

    return lax.cond(jnp.any(q_over | kv_over), fallback, use_packed, q, k, v, q_seg, kv_seg)


def zero_padding_rows(out, q_seg):
    """out [B, T, H, hd] with the rows of q segment 0 set to 0: in the packed layout padding
    runs attended among themselves (finite, and they pass no gradient back: their output
    gradient is zero)."""
    return jnp.where((q_seg != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
