"""A tiny Qwen3-shaped model that trains on CPU in seconds (tests, the demo, smoke runs).

    python -m klear_jax.sft --config=configs/sft_tiny.py --config.workdir=/tmp/w \
        --config.data.dir=/tmp/tfds --config.data.name=my_sft
Variant: ``configs/sft_tiny.py:vocab=512`` (vocab must match the tokenizer).
"""

from klear_jax import config as C
from klear_jax.sft.config import sft_base


def get_config(arg=None):
    a = C.parse_arg(arg, vocab=256, steps=20)
    c = sft_base()
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.model.update(C.MODEL_PRESETS["tiny"], vocab_size=a.vocab)
    c.data.update(num_epochs=0)  # repeat: tiny generated sets are a few steps long
    c.train.update(total_steps=a.steps, batch_size=16, seq_len=64, num_microbatches=2,
                   max_consecutive_skips=3, log_every=1)
    c.optim.update(lr=1e-3, end_lr=1e-4, schedule="cosine", warmup_steps=2, weight_decay=0.0)
    c.checkpoint.update(every_steps=10, keep=2, async_save=True)
    return c
