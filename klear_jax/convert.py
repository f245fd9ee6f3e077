"""Convert between HF safetensors directories and Orbax parameter checkpoints.

    python -m klear_jax.convert --from_hf HF_DIR --to CKPT_DIR [--param_dtype float32]
    python -m klear_jax.convert --from CKPT_DIR --to_hf HF_DIR [--step N] [--dtype bfloat16]
        [--tokenizer TOKDIR]

``--from`` accepts a params-only checkpoint (written by ``--to``), a training checkpoint
directory, or a training workdir (its ``checkpoints/``); the latest step unless ``--step``.
The HF export carries the tokenizer (``--tokenizer``, else the one the run's saved config
names: ``policy.resolve_tokenizer``) with its chat template, and a generation_config.json
with the paper's sampling (``policy.PAPER_SAMPLING``) and the stop / pad ids; from a
checkpoint that knows no tokenizer it is config.json and weights only, with a warning.
Parameters go through one device per leaf; set JAX_PLATFORMS / a mesh flag for huge models
(``--fsdp N`` shards them over N local devices while converting).
"""

from __future__ import annotations

import argparse
import logging
import sys

import jax

from klear_jax import logs, policy
from klear_jax.checkpoint import restore_params, save_params
from klear_jax.models import from_hf, to_hf
from klear_jax.sharding import make_mesh

log = logging.getLogger(__name__)


def hf_to_orbax(hf_dir: str, ckpt_dir: str, param_dtype: str = "float32", mesh=None,
                step: int = 0) -> None:
    model = from_hf(hf_dir, dtype=param_dtype, param_dtype=param_dtype, mesh=mesh)
    save_params(ckpt_dir, model, step=step)


def orbax_to_hf(ckpt_dir: str, hf_dir: str, step: int | None = None, dtype: str | None = None,
                mesh=None, tokenizer: str | None = None) -> bool:
    """Writes the HF export; True when it carries a tokenizer and generation config."""
    model = restore_params(ckpt_dir, mesh=mesh, step=step)
    vocab = model.config.vocab_size
    if tokenizer:
        tok = policy.resolve_tokenizer(tokenizer)
    else:
        try:
            tok = policy.resolve_tokenizer(None, ckpt_dir, -1 if step is None else step)
        except (ValueError, OSError) as e:
            log.warning("exporting config.json and weights only: %s (or pass --tokenizer DIR)",
                        e)
            tok = None
    if tok is not None:
        policy.check_vocab(tok, vocab, key="--tokenizer")
    to_hf(model, hf_dir, dtype=dtype, tokenizer=tok,
          generation_config=None if tok is None else policy.generation_config(tok, vocab))
    return tok is not None


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
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir for the HF export (default: the run's own)")
    logs.add_argument(p)
    a = p.parse_args(argv)
    logs.setup(a.verbosity)
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
            with_tok = orbax_to_hf(a.from_ckpt, a.to_hf, a.step, a.dtype, mesh, a.tokenizer)
            print(f"wrote HF directory {a.to_hf}"
                  + (" with the tokenizer and generation_config.json" if with_tok else ""))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
