"""TPU splash attention (Pallas) for training and prefill (T == S), same semantics as
``klear_jax.models.attention.xla_attention``::

    allowed[b, t, s] = (s <= t) & (q_seg[b, t] == kv_seg[b, s]) & (kv_seg[b, s] != 0)

The causal part is by *index* in the packed row: inside one segment positions increase with
the index (packing restarts them per segment, left padding shifts them), so index order and
position order agree wherever the segment test passes. Positions are therefore accepted for
signature parity with the XLA path but not read. Query rows with segment id 0 (padding) are
fully masked in the XLA path and return zeros; here too.

The kernel (jax.experimental.pallas.ops.tpu.splash_attention) works on one example in
[H, T, hd] layout, does not scale q, and handles grouped-query attention natively (H must be a
multiple of K; query head h reads kv head h // (H // K)). It is vmapped over the batch and,
under a mesh, run inside ``jax.shard_map`` with the batch over ('data', 'fsdp') and heads over
'tensor' (each shard builds its kernel for its local head count).

Sequence length: block sizes must be multiples of 128 (the TPU lane width). They are clipped
to T rounded up to 128, and T is padded (segment id 0, sliced off afterwards) up to a multiple
of both blocks, so any T works; T a multiple of the blocks avoids the padding copy.

Shapes: B batch, T time (== S), H query heads, K kv heads, hd head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from klear_jax.sharding import current_mesh, logical_to_spec

LANES = 128
Q_NAMES = ("act_batch", "act_length", "act_q_heads", "act_head_dim")
KV_NAMES = ("act_batch", "act_length", "act_kv_heads", "act_head_dim")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_length_and_blocks(T: int, block_q: int, block_kv: int) -> tuple[int, int, int]:
    """(padded T, block_q, block_kv) actually used for sequence length T."""
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if b <= 0 or b % LANES:
            raise ValueError(f"splash_attention: {name}={b} must be a positive multiple of "
                             f"{LANES} (TPU lane width)")
    t128 = _round_up(T, LANES)
    bq, bkv = min(block_q, t128), min(block_kv, t128)
    return _round_up(t128, math.lcm(bq, bkv)), bq, bkv


def _block_sizes(bq: int, bkv: int) -> sk.BlockSizes:
    return sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                         block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                         block_q_dq=bq, block_kv_dq=bkv)


def _splash_local(q, k, v, q_seg, kv_seg, *, interpret: bool, block_q: int, block_kv: int):
    """Unsharded (or per-shard) splash attention: q [B, T, H, hd], k/v [B, T, K, hd],
    segment ids [B, T] -> [B, T, H, hd] in q's dtype."""
    B, T, H, hd = q.shape
    Tp, bq, bkv = padded_length_and_blocks(T, block_q, block_kv)
    if Tp != T:
        pad4 = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad4), jnp.pad(k, pad4), jnp.pad(v, pad4)
        q_seg = jnp.pad(q_seg, ((0, 0), (0, Tp - T)))   # 0 = padding
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, Tp - T)))
    mask = sm.MultiHeadMask([sm.CausalMask((Tp, Tp)) for _ in range(H)])
    kernel = sk.make_splash_mha(mask, block_sizes=_block_sizes(bq, bkv), head_shards=1,
                                q_seq_shards=1, interpret=interpret)
    # The kernel does not scale the scores; scale q (in float32, then back to q's dtype).
    qs = (q.astype(jnp.float32) * (hd ** -0.5)).astype(q.dtype)
    to_hth = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, N, hd] -> [B, N, T, hd]  # noqa: E731
    seg = sk.SegmentIds(q=q_seg.astype(jnp.int32), kv=kv_seg.astype(jnp.int32))
    out = jax.vmap(kernel)(to_hth(qs), to_hth(k), to_hth(v), seg)  # [B, H, Tp, hd]
    out = jnp.swapaxes(out, 1, 2)
    # Padding queries (segment 0) attended to padding keys inside the kernel; zero them as
    # the XLA path does for fully masked rows.
    out = jnp.where((q_seg != 0)[:, :, None, None], out, 0)
    return out[:, :T].astype(q.dtype)


def _check(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"splash_attention: q, k, v must be [B, T, N, hd]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    B, T, H, hd = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != hd:
        raise ValueError(f"splash_attention: k {k.shape} / v {v.shape} do not match q {q.shape}")
    if k.shape[1] != T:
        raise ValueError(f"splash_attention: needs T == S (training / prefill), got q length {T} "
                         f"and kv length {k.shape[1]}; decode steps use the XLA path")
    if H % k.shape[2]:
        raise ValueError(f"splash_attention: {H} query heads not a multiple of {k.shape[2]} "
                         "kv heads")
    for name, x in (("q_positions", q_positions), ("kv_positions", kv_positions),
                    ("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if x is not None and x.shape != (B, T):
            raise ValueError(f"splash_attention: {name} must be [B, T] = {(B, T)}, "
                             f"got {x.shape}")


def splash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
                     interpret: bool = False, block_q: int = 512, block_kv: int = 512):
    """Causal, segment-masked grouped-query attention with the Pallas splash kernel.

    Args:
      q: [B, T, H, hd]; k, v: [B, T, K, hd] with H a multiple of K.
      q_positions, kv_positions: int [B, T]; not read (see the module docstring).
      q_segment_ids, kv_segment_ids: int [B, T]; equal ids attend, 0 is padding.
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      block_q, block_kv: kernel tile sizes, multiples of 128 (clipped to T).

    Returns [B, T, H, hd] in q's dtype (rows whose q segment id is 0 are zeros).
    Under ``klear_jax.sharding.use_mesh(mesh)`` with more than one device it runs inside
    ``jax.shard_map`` (batch over data/fsdp, heads over tensor, where they divide).
    """
    _check(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    local = functools.partial(_splash_local, interpret=interpret, block_q=block_q,
                              block_kv=block_kv)
    mesh = current_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return local(q, k, v, q_segment_ids, kv_segment_ids)

    P = jax.sharding.PartitionSpec
    q_spec = logical_to_spec(Q_NAMES, q.shape, mesh)
    kv_spec = logical_to_spec(KV_NAMES, k.shape, mesh)
    # The kv batch sharding must match q's; heads: see below.
    kv_spec = P(q_spec[0], kv_spec[1], kv_spec[2], kv_spec[3])
    seg_spec = P(q_spec[0], None)
    H, K = q.shape[2], k.shape[2]
    head_axes = q_spec[2]
    n_head = math.prod(mesh.shape[a] for a in
                       ((head_axes,) if isinstance(head_axes, str) else (head_axes or ())))
    if kv_spec[2] != head_axes:
        # Shard i holds q heads [i H/n, (i+1) H/n), which read kv heads [i K/n, (i+1) K/n):
        # the kernel's local mapping h -> h // G is right only if kv heads are split into the
        # same n shards. If K does not divide by n, repeat kv heads up to H (the MHA layout,
        # which always shards like q).
        if K % n_head:
            k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
        kv_spec = P(kv_spec[0], kv_spec[1], head_axes, kv_spec[3])
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)
    return fn(q, k, v, q_segment_ids, kv_segment_ids)
