"""One-command GPU check of the fused attention candidates (klear_jax/models/gpu_attention.py):
correctness (values and dq / dk / dv against ``xla_attention`` in float32, bf16 inputs, packed
and padded rows, GQA) and forward + backward time per candidate at the issue-25 bench shapes
(Qwen3-1.7B attention: 16 query / 8 kv heads, head_dim 128). Sized for one device lease:
about 3 minutes on one H200, stops starting new cases after ``--budget-s``.

    python benchmarks/gpu_attention_check.py --out $OUT/gpu_attention.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from klear_jax.models import gpu_attention as ga
from klear_jax.models.attention import positions_from_segment_ids, xla_attention
from klear_jax.models.gpu_flash import BlockSizes

F32 = jnp.float32


def rows(B: int, T: int, seed: int, full: bool = False) -> np.ndarray:
    """Segment ids [B, T]: row 0 packed (3 segments + right padding), row 1 a GPPO row
    (left padding, one segment, right padding), further rows packed at other cuts; ``full``:
    one segment over every row (plain causal attention, the most work per row)."""
    if full:
        return np.ones((B, T), np.int32)
    r = np.random.RandomState(seed)
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        if b % 2:
            lo, hi = sorted(r.randint(1, T // 4, 2)) if T > 8 else (1, 2)
            seg[b, lo:T - hi] = 1
        else:
            cuts = np.sort(r.choice(np.arange(1, T - 16), 3, replace=False))
            for i, (a, c) in enumerate(zip([0, *cuts[:2]], cuts)):
                seg[b, a:c] = i + 1
    return seg


def inputs(B, T, H, K, hd, seed=0, full=False):
    r = np.random.RandomState(seed)
    q, k, v, w = (jnp.asarray(r.randn(B, T, n, hd), jnp.bfloat16) for n in (H, K, K, H))
    seg = jnp.asarray(rows(B, T, seed, full))
    return q, k, v, w, positions_from_segment_ids(seg), seg


def step(fn, w):
    """jit of (q, k, v) -> (out, (dq, dk, dv)) of sum(fn(q, k, v) * w)."""
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(F32) * w.astype(F32)), out
    g = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v: (lambda r: (r[0][1], r[1]))(g(q, k, v)))


def candidates(pos, seg):
    xla = lambda q, k, v: xla_attention(q, k, v, pos, pos, seg, seg)  # noqa: E731

    def gpu(impl, **kw):
        return lambda q, k, v: ga.gpu_attention(q, k, v, pos, pos, seg, seg, impl=impl, **kw)
    def pallas(fq, fk, bq, bk, warps=None):
        return gpu("pallas", block_sizes=BlockSizes(
            block_q=fq, block_k=fk, block_q_dq=bq, block_kv_dq=bk, block_q_dkv=bq,
            block_kv_dkv=bk, num_warps=warps))
    return {
        "xla": xla,
        # jax.nn's cuDNN path: causal only, no segments (right for one-segment rows only)
        "cudnn_plain": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"),
        "cudnn": gpu("cudnn"),  # default max_segments
        "cudnn_M2": gpu("cudnn", max_segments=2),  # packed rows overflow: Pallas fallback
        "cudnn_M4": gpu("cudnn", max_segments=4),
        "cudnn_M8": gpu("cudnn", max_segments=8),
        "cudnn_M64": gpu("cudnn", max_segments=64),
        "pallas": gpu("pallas"),  # default BlockSizes
        "pallas_jaxdefaults": pallas(128, 128, 32, 32),
        "pallas_fwd128x64_bwd64": pallas(128, 64, 64, 64, 8),
        "pallas_fwd128x64_bwd64x128": pallas(128, 64, 64, 128, 8),
        "pallas_fwd64x64_bwd64": pallas(64, 64, 64, 64, 8),
    }


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def check(shape, names, report, deadline):
    B, T, H, K, hd = shape
    q, k, v, w, pos, seg = inputs(B, T, H, K, hd, seed=1)
    fns = candidates(pos, seg)
    ref_out, ref_g = step(lambda q, k, v: xla_attention(q, k, v, pos, pos, seg, seg), w)(
        q.astype(F32), k.astype(F32), v.astype(F32))
    pad = np.asarray(seg) == 0
    for name in names:
        if time.time() > deadline:
            report.append({"case": "check", "shape": shape, "impl": name, "skipped": "budget"})
            continue
        rec = {"case": "check", "shape": shape, "impl": name}
        try:
            impl = name.split("_")[0]
            reason = ga.supports(impl, q, k) if impl in ga.IMPLS else None
            if reason:
                rec["unsupported"] = reason
            else:
                out, g = step(fns[name], w)(q, k, v)
                rec.update(out=rel(out, ref_out), dq=rel(g[0], ref_g[0]), dk=rel(g[1], ref_g[1]),
                           dv=rel(g[2], ref_g[2]),
                           pad_rows_zero=bool(not np.asarray(out, np.float32)[pad].any()))
        except Exception as e:  # noqa: BLE001 - report and go on
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(json.dumps(rec), flush=True)
        report.append(rec)


def timing(shape, names, report, deadline, iters=5, full=False):
    B, T, H, K, hd = shape
    q, k, v, w, pos, seg = inputs(B, T, H, K, hd, seed=2, full=full)
    fns = candidates(pos, seg)
    rows_kind = "full" if full else "packed"
    for name in names:
        if time.time() > deadline:
            report.append({"case": "time", "shape": shape, "impl": name, "skipped": "budget"})
            continue
        rec = {"case": "time", "rows": rows_kind, "shape": shape, "impl": name}
        try:
            f = step(fns[name], w)
            t0 = time.perf_counter()
            compiled = f.lower(q, k, v).compile()
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            ma = compiled.memory_analysis()
            rec["temp_gib"] = round(getattr(ma, "temp_size_in_bytes", 0) / 2 ** 30, 3)
            jax.block_until_ready(compiled(q, k, v))
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(q, k, v))
                ts.append(time.perf_counter() - t0)
            ms = 1e3 * float(np.median(ts))
            # causal fwd + bwd matmul FLOPs (fwd 2 dots, bwd 5, over half the T x T scores)
            # of a full row: packed rows need less, and kernels that skip other segments'
            # blocks (cuDNN's packed layout) show more than the chip's peak there
            flops = 7 * 2 * B * H * T * T * hd / 2
            rec.update(fwd_bwd_ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(json.dumps(rec), flush=True)
        report.append(rec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_attention.json")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--sweep", action="store_true",
                    help="the max_segments / block-size sweep behind the defaults")
    a = ap.parse_args()
    t_start = time.time()
    deadline = t_start + a.budget_s
    dev = jax.devices()[0]
    env = {"jax": jax.__version__, "device": str(dev.device_kind),
           "compute_capability": getattr(dev, "compute_capability", None),
           "platform_version": str(dev.client.platform_version),
           "cudnn": ga._cudnn_version()}
    q = jax.ShapeDtypeStruct((1, 8, 16, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 8, 8, 128), jnp.bfloat16)
    env["supports"] = {i: ga.supports(i, q, k) for i in ga.IMPLS}
    env["choose"] = ga.choose(q, k)[0]
    print(json.dumps(env), flush=True)
    report = []
    if a.sweep:
        timing((4, 4096, 16, 8, 128), ["cudnn_M4", "cudnn_M8", "cudnn_M64"], report, deadline)
        blocks = ["pallas", "pallas_jaxdefaults", "pallas_fwd128x64_bwd64",
                  "pallas_fwd128x64_bwd64x128", "pallas_fwd64x64_bwd64"]
        timing((4, 4096, 16, 8, 128), blocks, report, deadline, full=True)
        timing((1, 16384, 16, 8, 128), blocks, report, deadline, full=True)
    else:
        # packed rows, odd T, G = 2 and 4; cudnn_M2: the rows overflow 2 slots -> Pallas
        check((2, 1000, 16, 8, 128), ["cudnn", "cudnn_M2", "pallas"], report, deadline)
        check((2, 520, 32, 8, 128), ["cudnn", "pallas"], report, deadline)
        for shape in ((4, 4096, 16, 8, 128), (1, 16384, 16, 8, 128)):
            timing(shape, ["xla", "cudnn_plain", "cudnn", "pallas"], report, deadline,
                   full=True)
            timing(shape, ["cudnn", "cudnn_M2", "pallas"], report, deadline)
    with open(a.out, "w") as f:
        json.dump({"env": env, "results": report, "wall_s": round(time.time() - t_start, 1)},
                  f, indent=1)
    print(f"wall {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
