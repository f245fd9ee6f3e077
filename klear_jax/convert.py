"""Convert between HF safetensors directories and Orbax parameter checkpoints.

    python -m klear_jax.convert --from_hf HF_DIR --to CKPT_DIR [--param_dtype float32]
    python -m klear_jax.convert --from CKPT_DIR --to_hf HF_DIR [--step N] [--dtype bfloat16]

``--from`` accepts a params-only checkpoint (written by ``--to``), a training checkpoint
directory, or a training workdir (its ``checkpoints/``); the latest step unless ``--step``.
Parameters go through one device per leaf; set JAX_PLATFORMS / a mesh flag for huge models
(``--fsdp N`` shards them over N local devices while converting).
"""

from __future__ import annotations

import argparse
import sys

import jax

from klear_jax.checkpoint import restore_params, save_params
from klear_jax.models import from_hf, to_hf
from klear_jax.sharding import make_mesh


def hf_to_orbax(hf_dir: str, ckpt_dir: str, param_dtype: str = "float32", mesh=None,
                step: int = 0) -> None:
    model = from_hf(hf_dir, dtype=param_dtype, param_dtype=param_dtype, mesh=mesh)
    save_params(ckpt_dir, model, step=step)


def orbax_to_hf(ckpt_dir: str, hf_dir: str, step: int | None = None, dtype: str | None = None,
                mesh=None) -> None:
    model = restore_params(ckpt_dir, mesh=mesh, step=step)
    to_hf(model, hf_dir, dtype=dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m klear_jax.convert", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from_hf", help="HF directory (config.json + *.safetensors)")
    src.add_argument("--from", dest="from_ckpt", help="Orbax checkpoint dir or training workdir")
    p.add_argument("--to", help="output Orbax params checkpoint dir (with --from_hf)")
    p.add_argument("--to_hf", help="output HF directory (with --from)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--param_dtype", default="float32", choices=("float32", "bfloat16"),
                   help="stored parameter dtype of the Orbax checkpoint")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="safetensors dtype (default: the parameters' own)")
    p.add_argument("--fsdp", type=int, default=0, help="shard over this many local devices")
    a = p.parse_args(argv)
    if a.from_hf and not a.to:
        p.error("--from_hf needs --to CKPT_DIR")
    if a.from_ckpt and not a.to_hf:
        p.error("--from needs --to_hf HF_DIR")
    mesh = None
    if a.fsdp:
        mesh = make_mesh(fsdp=a.fsdp, devices=jax.devices()[:a.fsdp])
    try:
        if a.from_hf:
            hf_to_orbax(a.from_hf, a.to, a.param_dtype, mesh, step=a.step or 0)
            print(f"wrote Orbax params checkpoint {a.to}")
        else:
            orbax_to_hf(a.from_ckpt, a.to_hf, a.step, a.dtype, mesh)
            print(f"wrote HF directory {a.to_hf}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
