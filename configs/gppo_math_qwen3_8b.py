"""The paper's math RL stage (GPPO) of Klear-Reasoner-8B on a TPU v5p-64 slice (32 chips,
megacore: one JAX device per chip), starting from the SFT checkpoint.

Paper settings (arXiv 2508.07629, sections 2-6): 128 prompts x 8 responses per step, over-generated
from 256 prompts so zero-advantage groups can be dropped; mini-batches of 16 prompts (8
updates per step); lr 1e-6 constant after 10 warmup steps; AdamW(0.9, 0.999), wd 0.1,
clip 1.0; GPPO eps 0.2 / 0.28, dual clip 10, beta1 = beta2 = 1; SFT term alpha 0.1 on
all-correct responses; temperature 1.0, top_p 1; prompt 4096 + response 32768 tokens.

    python -m klear_jax.rl --config=configs/gppo_math_qwen3_8b.py \
        --config.workdir=gs://b/rl_math --config.init.path=gs://b/sft/checkpoints \
        --config.data.dir=gs://b/tfds --config.data.name=klear_math \
        --config.data.tokenizer=/path/to/tokenizer
Variants: ``:chips=N`` (devices), ``:tensor=N`` (tensor-parallel ways; v6e-64 uses
``:chips=64,tensor=4``), ``:steps=N``, ``:semantics=official``.

Semantics. By default this file follows the paper's text wherever the paper states a rule:
one token-mean over the whole mini-batch (Eq. 11's 1 / sum_j T_j), groups dropped when all
rewards are equal (zero advantage), the soft code reward p. Where the paper is silent it
keeps the project's choice (first 16 tests, <think> checked before </think>, norms and
biases not decayed, a short last mini-batch trained at full size). ``:semantics=official``
switches every one of these to what the authors' released verl run does
(``klear_jax.rl.config.OFFICIAL``: per-micro-batch token-mean, mixed-correctness group
filter, 2p - 1 over 16 random tests, </think> checked first, decay on every parameter,
short mini-batches dropped). docs/reproduce.md lists each with its source.
"""

from klear_jax import config as C
from klear_jax.rl.config import OFFICIAL, rl_base


def get_config(arg=None):
    a = C.parse_arg(arg, chips=32, steps=500, tensor=1, semantics="paper")
    shards = a.chips // a.tensor  # data x fsdp: rows are split over these
    c = rl_base()
    c.seed = 0
    # v5p-64: pure FSDP over 32 chips. v6e-64 (32 GB/chip): ``:chips=64,tensor=4`` also splits
    # heads / MLP / the KV cache's kv heads 4 ways (measured by klear_jax.aot, docs/aot.md).
    c.mesh = dict(data=1, fsdp=shards, tensor=a.tensor)
    c.init = dict(source="orbax", path="", step=-1)  # the SFT run's checkpoints
    c.model.update(C.MODEL_PRESETS["qwen3_8b"])
    c.data.update(split="train", shuffle=True, num_epochs=0)
    # 8 decode slots per batch shard (the rollout engine refills them as responses finish):
    # 8 x 36.8K tokens x 147 KB/token (bf16 KV) = 43 GB per shard, split over `tensor` chips
    # by kv heads.
    c.rollout.update(prompts_per_step=256, group_size=8, temperature=1.0, top_p=1.0, top_k=0,
                     repetition_penalty=1.0, max_prompt_len=4096, max_new_tokens=32768,
                     decode_slots=8 * shards, decode_chunk=64)
    # 16 prompts x 8 = 128 rows per mini-batch; micro-batches of one row per batch shard.
    c.train.update(total_steps=a.steps, batch_prompts=128, num_minibatches=8,
                   num_microbatches=128 // shards, length_bucket=4096, max_consecutive_skips=5,
                   log_every=1)
    c.train.partial_minibatch = "full"
    # verl_devices: the authors' 256 GPUs / Ulysses 4 = 64 data-parallel groups, 2 rows each
    # per 128-row mini-batch (used by loss.normalize = microbatch only).
    c.loss.update(kind="gppo", eps_low=0.2, eps_high=0.28, beta1=1.0, beta2=1.0,
                  dual_clip=10.0, agg="token-mean", sft_alpha=0.1, normalize="minibatch",
                  verl_devices=64, adv_estimator="grpo", adv_use_std=True,
                  filter_zero_adv=True, filter_by="reward", overlong_filter=False)
    c.reward.math.update(correct=1.0, wrong=-1.0, missing_close_think=-0.5,
                         missing_open_think=-2.0, think_check="open_first", num_workers=16)
    c.reward.code.update(mode="soft", test_selection="first", think_check="open_first")
    c.optim.update(lr=1e-6, end_lr=1e-6, schedule="constant", warmup_steps=10,
                   b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, weight_decay_mask="matrices",
                   clip_norm=1.0)
    c.checkpoint.update(every_steps=10, keep=3, async_save=True)
    return C.set_semantics(c, a.semantics, OFFICIAL)
