"""The SFT config schema (``python -m klear_jax.sft``): the shared blocks of
``klear_jax.config`` plus data / train.

Config files (``configs/sft_*.py``) call ``sft_base()`` and fill in values; the result is
locked, so a typo fails naming the key. ``validate_sft_config`` checks every value up front.

    data.dir                str   TFDS data_dir holding the dataset written by
                                  ``python -m klear_jax.data.prepare`` ("" = TFDS default)
    data.name               str   TFDS dataset name
    data.split              str   split to train on ("train")
    data.shuffle            bool  shuffle records (seeded by ``seed``) and packing bins
    data.num_epochs         int   passes over the data (0 = repeat forever); the run stops
                                  early with "data_exhausted" when they run out
    data.overlong           str   "truncate" | "drop" sequences longer than train.seq_len
    data.num_packing_bins   int   first-fit packing bins (0 = max(batch, 32))
    train.total_steps       int   optimizer steps to run
    train.batch_size        int   rows per step (global, over all hosts); divisible by
                                  num_microbatches * mesh.data * mesh.fsdp
    train.seq_len           int   tokens per packed row (T)
    train.num_microbatches  int   gradient-accumulation micro-batches per step (lax.scan)
    train.max_consecutive_skips int  stop after this many non-finite steps in a row
    train.log_every         int   host-side metric logging cadence (steps)
    train.loss_agg          str   SFT loss aggregation, klear_jax.losses.AGG_MODES

The paper-setting config (``configs/sft_qwen3_8b.py``) takes ``:semantics=official`` like
the RL ones: it sets :data:`OFFICIAL` (the SFT trainer of the authors' verl fork: over-long
rows are refused, not truncated; AdamW decays every parameter). Their SFT run itself is not
released (docs/reproduce.md).
"""

from __future__ import annotations

import ml_collections

from klear_jax import config as C

OFFICIAL = {"data.overlong": "drop", "optim.weight_decay_mask": "all"}


def sft_base() -> ml_collections.ConfigDict:
    """Every key with a default value (see the module docstring and ``klear_jax.config``)."""
    c = C.base_config()
    c.data = dict(dir="", name="", split="train", shuffle=True, num_epochs=1,
                  overlong="truncate", num_packing_bins=0)
    c.train = dict(total_steps=1, batch_size=8, seq_len=512, num_microbatches=1,
                   max_consecutive_skips=5, log_every=1, loss_agg="token-mean")
    return c


def validate_sft_config(c, num_devices: int | None = None) -> None:
    """Raises ConfigError naming the first bad key. Cheap: touches no device or file data."""
    sizes = C.validate_run(c, num_devices)
    t = "train"
    C.check_int(c, f"{t}.total_steps", lo=1)
    bs = C.check_int(c, f"{t}.batch_size", lo=1)
    C.check_int(c, f"{t}.seq_len", lo=1)
    nm = C.check_int(c, f"{t}.num_microbatches", lo=1)
    C.check_int(c, f"{t}.max_consecutive_skips", lo=1)
    C.check_int(c, f"{t}.log_every", lo=1)
    C.need(bs % nm == 0, f"{t}.batch_size",
           f"{bs} is not divisible by train.num_microbatches = {nm}")
    shards = C.batch_shards(sizes, num_devices)
    if shards is not None:
        C.need((bs // nm) % shards == 0, f"{t}.batch_size",
               f"micro-batch of {bs // nm} rows is not divisible by mesh.data * mesh.fsdp = "
               f"{shards}")
    C.check_str(c, "data.name", "must name the TFDS dataset to train on")
    C.check_int(c, "data.num_epochs", lo=0)
    C.check_int(c, "data.num_packing_bins", lo=0)
    C.need(c.data.overlong in ("truncate", "drop"), "data.overlong",
           f"must be 'truncate' or 'drop', got {c.data.overlong!r}")
    C.validate_agg(c, f"{t}.loss_agg")
    C.validate_optim(c)
    C.validate_checkpoint(c)
