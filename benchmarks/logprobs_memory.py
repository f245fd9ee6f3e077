"""Compiled temporary memory of per-token logprobs + entropy (forward and backward):
chunked vs unchunked.

The numbers come from XLA's ``memory_analysis()`` of the compiled gradient function, so they
are deterministic and need no accelerator: nothing is executed.

    JAX_PLATFORMS=cpu python benchmarks/logprobs_memory.py --out /tmp/logprobs_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp

from klear_jax.models.logprobs import chunked_token_logprobs, token_logprobs_reference  # noqa: E402

DEFAULT_CASES = ((2048, 32000), (4096, 32000), (8192, 32000), (4096, 151936))


def backward_temp_bytes(fn, B, T, D, V, dtype=jnp.float32) -> int:
    def loss(h, w, t):
        logp, ent = fn(h, w, t)
        return jnp.sum(logp) + jnp.sum(ent)

    args = (jax.ShapeDtypeStruct((B, T, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
            jax.ShapeDtypeStruct((B, T), jnp.int32))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--d_model", type=int, default=64)
    ap.add_argument("--chunk_size", type=int, default=512)
    ap.add_argument("--cases", default=",".join(f"{t}x{v}" for t, v in DEFAULT_CASES),
                    help="comma-separated TxV list")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    B, D, c = args.batch, args.d_model, args.chunk_size
    rows = []
    print(f"backend={jax.default_backend()} B={B} D={D} chunk={c}")
    print(f"{'T':>6} {'V':>7} {'full logits MiB':>16} {'unchunked MiB':>14} "
          f"{'chunked MiB':>12} {'ratio':>6}")
    for case in args.cases.split(","):
        T, V = (int(x) for x in case.lower().split("x"))
        chunked = backward_temp_bytes(
            lambda h, w, t: chunked_token_logprobs(h, w, t, chunk_size=c), B, T, D, V)
        unchunked = backward_temp_bytes(token_logprobs_reference, B, T, D, V)
        full = B * T * V * 4
        rows.append(dict(B=B, T=T, D=D, V=V, chunk_size=c, full_logits_bytes=full,
                         unchunked_temp_bytes=unchunked, chunked_temp_bytes=chunked,
                         ratio=unchunked / max(chunked, 1)))
        mib = 2 ** 20
        print(f"{T:>6} {V:>7} {full / mib:>16.1f} {unchunked / mib:>14.1f} "
              f"{chunked / mib:>12.1f} {unchunked / max(chunked, 1):>6.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(backend=jax.default_backend(), jax_version=jax.__version__,
                           results=rows), f, indent=2)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
