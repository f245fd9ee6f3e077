"""GPPO on a tiny Qwen3-shaped model: tests, the CPU demo, smoke runs.

    python -m klear_jax.rl --config=configs/gppo_tiny.py --config.workdir=/tmp/rl \
        --config.data.dir=/tmp/tfds --config.data.name=my_rl_math \
        --config.data.tokenizer=/tmp/tok [--config.init.source=orbax --config.init.path=SFT_DIR]
Variants: ``configs/gppo_tiny.py:vocab=512,steps=50`` (vocab must match the tokenizer).
Over-generates 8 -> 4 groups of 8, two mini-batch updates per step; 8 devices split the
16-row mini-batch (tests run with 8 fake CPU devices). ``:semantics=official`` as in
``gppo_math_qwen3_8b.py`` (8 emulated verl devices of 2 rows).
"""

from klear_jax import config as C
from klear_jax.rl.config import OFFICIAL, rl_base


def get_config(arg=None):
    a = C.parse_arg(arg, vocab=256, steps=4, semantics="paper")
    c = rl_base()
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.model.update(C.MODEL_PRESETS["tiny"], vocab_size=a.vocab)
    c.data.update(num_epochs=0)
    c.rollout.update(prompts_per_step=8, group_size=8, temperature=1.0, top_p=1.0,
                     max_prompt_len=64, max_new_tokens=32, decode_slots=32, decode_chunk=8)
    c.train.update(total_steps=a.steps, batch_prompts=4, num_minibatches=2,
                   num_microbatches=1, length_bucket=32, max_consecutive_skips=3, log_every=1)
    c.loss.update(kind="gppo", eps_low=0.2, eps_high=0.28, dual_clip=10.0, sft_alpha=0.1,
                  verl_devices=8)
    c.reward.math.update(num_workers=1)
    c.reward.code.update(timeout_s=5.0, max_tests=8)
    c.optim.update(lr=1e-3, end_lr=1e-3, schedule="constant", warmup_steps=0,
                   weight_decay=0.0, clip_norm=1.0)
    c.checkpoint.update(every_steps=2, keep=2, async_save=False)
    return C.set_semantics(c, a.semantics, OFFICIAL)
