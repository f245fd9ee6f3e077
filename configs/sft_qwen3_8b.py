"""The paper's long-CoT SFT of Qwen3-8B-Base, for a TPU v5p-64 slice (64 TensorCores =
32 chips; with megacore each chip is one JAX device, so the mesh has 32 devices).

Paper settings: lr 8e-5 cosine-decayed to 4e-5, 4 epochs, 32K-token packed rows; AdamW
(0.9, 0.999), weight decay 0.1, global-norm clipping 1.0. Master weights float32, compute
bfloat16, full remat, fused attention ("auto": splash on TPU; XLA attention does not fit
at 32K, docs/aot.md).

    python -m klear_jax.sft --config=configs/sft_qwen3_8b.py --config.workdir=gs://b/sft \
        --config.init.path=gs://b/Qwen3-8B-Base --config.data.dir=gs://b/tfds --config.data.name=klear_sft
Variants: ``:chips=64`` (devices of the slice), ``:steps=N`` (set from dataset size x 4
epochs / batch), ``:batch=N`` rows per step, ``:semantics=official``.

Semantics: the paper states only "maximum training length 32K". By default a longer row is
truncated to 32K (its first 32K tokens still teach) and norms / biases are not decayed;
``:semantics=official`` drops over-long rows and decays every parameter, as the SFT
trainer of the authors' verl fork does (``klear_jax.sft.config.OFFICIAL``).
"""

from klear_jax import config as C
from klear_jax.sft.config import OFFICIAL, sft_base


def get_config(arg=None):
    a = C.parse_arg(arg, chips=32, steps=2000, batch=64, seq_len=32768, semantics="paper")
    c = sft_base()
    c.seed = 0
    # v5p-64 = 32 chips (megacore: one JAX device per chip). Pure FSDP: 8B params + Adam
    # states (16 B/param f32) = 128 GB spread over 32 chips = 4 GB each.
    c.mesh = dict(data=1, fsdp=a.chips, tensor=1)
    c.init = dict(source="hf", path="", step=-1)
    # Qwen3-8B architecture (overridden by the checkpoint's config.json for init=hf/orbax).
    c.model.update(C.MODEL_PRESETS["qwen3_8b"])
    c.data.update(split="train", num_epochs=4, overlong="truncate", num_packing_bins=128)
    # One 32K row per chip per micro-batch (v5p-64: 2 micro-batches; v6e-64, chips=64: 1):
    # measured by klear_jax.aot, see docs/aot.md.
    c.train.update(total_steps=a.steps, batch_size=a.batch, seq_len=a.seq_len,
                   num_microbatches=max(1, a.batch // a.chips), max_consecutive_skips=5,
                   log_every=1)
    c.optim.update(lr=8e-5, end_lr=4e-5, schedule="cosine", warmup_steps=20, decay_steps=0,
                   b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, weight_decay_mask="matrices",
                   clip_norm=1.0)
    c.checkpoint.update(every_steps=200, keep=3, async_save=True)
    return C.set_semantics(c, a.semantics, OFFICIAL)
