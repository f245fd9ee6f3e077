"""The RL (GPPO) config schema: the SFT schema's shared blocks plus rollout / loss / reward.

Config files (``configs/gppo_*.py``) call ``rl_base()`` and fill in values; the result is
locked, so a typo fails naming the key. ``validate_rl_config`` checks everything up front.
Shared blocks (``workdir``, ``seed``, ``mesh``, ``init``, ``model``, ``optim``,
``checkpoint``, ``reward``) mean what ``klear_jax.config`` says; the RL-specific keys:

    data.dir / data.name / data.split   TFDS dataset written by ``klear_jax.data.prepare``
                                  with --kind rl_math or rl_code (a record with tests is
                                  scored as code, otherwise as math)
    data.shuffle            bool  shuffle prompts (seeded by ``seed``)
    data.num_epochs         int   passes over the prompts (0 = repeat forever)
    data.tokenizer          str   tokenizer directory (decodes responses; eos / pad ids)
    rollout.prompts_per_step int  P prompts sampled per step (over-generation when >
                                  train.batch_prompts: zero-advantage groups are dropped and
                                  at most batch_prompts groups are kept)
    rollout.group_size      int   G responses per prompt (>= 2)
    rollout.temperature, top_p, top_k, repetition_penalty   sampling (top_k 0 = off)
    rollout.max_prompt_len  int   longer prompts are skipped by the data pipeline
    rollout.max_new_tokens  int   response budget; a response hitting it is "truncated"
    rollout.decode_slots    int   decode slots of the rollout engine (``klear_jax.engine``):
                                  samples decoded at once, each slot a KV-cache row of
                                  max_prompt_len + max_new_tokens (bounds the cache); a
                                  finished sample's slot is refilled with the next one
                                  (0 = prompts_per_step x group_size: one slot per sample)
    rollout.decode_chunk    int   decode steps per engine call (slots are refilled between)
    rollout.weights_dtype   str   the sampler's copy of the policy: "auto" (the model's compute
                                  dtype: bf16 rollouts under bf16 compute; one cast per rollout
                                  phase, sharded like the params, the f32 masters stay for the
                                  update) | "float32" | "bfloat16"
    rollout.overlap_scoring bool  score samples as they finish, while decoding goes on
                                  (False: decode everything, then score)
    train.total_steps       int   RL steps (each: sample, score, up to K updates)
    train.batch_prompts     int   groups per step used for updates (the paper's 128)
    train.num_minibatches   int   K: updates per step; a mini-batch holds
                                  batch_prompts / K groups (the paper's 8 / 4)
    train.num_microbatches  int   gradient-accumulation splits of a mini-batch
    train.length_bucket     int   rows are right-padded to a multiple of this (capped at
                                  max_prompt_len + max_new_tokens); 0 = always the cap (one
                                  compiled shape)
    train.partial_minibatch str   a last mini-batch with fewer groups than the others (a
                                  short step): "full" (a full-size step, default) |
                                  "scaled" (loss x its rows / a full mini-batch's, verl's
                                  actor) | "drop" (not trained on: the authors' trainer cuts
                                  a short batch to whole device multiples)
    train.max_consecutive_skips, train.log_every   as in SFT
    loss.kind               str   klear_jax.losses.POLICY_LOSSES ("gppo")
    loss.eps_low / eps_high float clip range (0.2 / 0.28)
    loss.beta1 / beta2      float GPPO-general scales of the clipped branches
    loss.dual_clip          float cap for A<0 tokens (10; 0 = off)
    loss.agg / norm_length        aggregation (klear_jax.losses.AGG_MODES); norm_length for
                                  seq-mean-token-sum-norm
    loss.sft_alpha          float weight of the NLL on max-reward responses (0.1)
    loss.adv_estimator      str   "grpo" | "rloo"
    loss.adv_use_std        bool  GRPO divides by the group std (False = Dr.GRPO)
    loss.normalize          str   "minibatch" (the paper's 1 / sum_j T_j over the whole
                                  mini-batch, per agg; default) | "microbatch" (the
                                  authors' verl run: token-mean per emulated micro-batch,
                                  klear_jax.rl.loss; agg must be token-mean)
    loss.verl_devices       int   data-parallel groups of the emulated verl run (256 GPUs /
                                  Ulysses 4 = 64): each holds mini-batch rows / verl_devices
                                  rows, split into micro-batches of at most max_prompt_len +
                                  max_new_tokens tokens (only with normalize = microbatch)
    loss.filter_zero_adv    bool  drop groups without a learning signal (filter_by)
    loss.filter_by          str   "reward" (rewards not all equal: the paper's text) |
                                  "correct" (some response with the full reward and some
                                  without: the authors' code, filter metric "acc")
    loss.overlong_filter    bool  mask truncated responses out of the loss
    optim.warmup_steps / decay_steps  count RL steps, as in verl (the optimizer sees up to
                                  K updates per step; ``klear_jax.rl.step.rl_optimizer``
                                  scales both by K)

The paper-setting configs (``configs/gppo_*_qwen3_8b.py``) default to the paper's text;
their variant ``:semantics=official`` sets every key of :data:`OFFICIAL` to the authors'
released run at once (``klear_jax.config.set_semantics``; docs/reproduce.md).
"""

from __future__ import annotations

import ml_collections

from klear_jax import config as C
from klear_jax import losses
from klear_jax.rl.loss import NORMALIZE, PARTIAL_MINIBATCH

ADV_ESTIMATORS = ("grpo", "rloo")
FILTER_BY = ("reward", "correct")

# ``:semantics=official`` on the RL configs: the authors' released run (their verl fork,
# recipe/dapo/perf_run_dapo_ours_{math,code}.sh) where it departs from the paper's text.
# docs/reproduce.md has one row per key, with the paper's value and the reason.
OFFICIAL = {
    "loss.normalize": "microbatch",          # dp_actor: token-mean per dynamic micro-batch
    "loss.filter_by": "correct",             # filter_groups.metric = acc
    "train.partial_minibatch": "drop",       # batch cut to a multiple of the GPU count
    "reward.code.mode": "two_p_minus_one",   # mean of +1 / -1 per test
    "reward.code.test_selection": "random",  # random.sample(tests, 16) per response
    "reward.math.think_check": "close_first",  # </think> checked before <think>
    "reward.code.think_check": "close_first",
    "optim.weight_decay_mask": "all",        # torch AdamW over model.parameters()
}


def rl_base() -> ml_collections.ConfigDict:
    """Every key with a default value (see the module docstring)."""
    c = C.base_config()
    c.data = dict(dir="", name="", split="train", shuffle=True, num_epochs=0, tokenizer="")
    c.rollout = dict(prompts_per_step=256, group_size=8, temperature=1.0, top_p=1.0, top_k=0,
                     repetition_penalty=1.0, max_prompt_len=4096, max_new_tokens=32768,
                     decode_slots=0, decode_chunk=16, overlap_scoring=True,
                     weights_dtype="auto")
    c.train = dict(total_steps=1, batch_prompts=128, num_minibatches=8, num_microbatches=1,
                   length_bucket=0, partial_minibatch="full", max_consecutive_skips=5,
                   log_every=1)
    c.loss = dict(kind="gppo", eps_low=0.2, eps_high=0.28, beta1=1.0, beta2=1.0,
                  dual_clip=10.0, agg="token-mean", norm_length=0.0, sft_alpha=0.1,
                  normalize="minibatch", verl_devices=64, adv_estimator="grpo",
                  adv_use_std=True, filter_zero_adv=True, filter_by="reward",
                  overlong_filter=False)
    c.reward = C.reward_block()
    c.optim.update(lr=1e-6, end_lr=1e-6, schedule="constant", warmup_steps=10,
                   weight_decay=0.1, clip_norm=1.0)
    return c


def validate_rl_config(c, num_devices: int | None = None) -> None:
    """Raises ConfigError naming the first bad key. Touches no device or file data."""
    sizes = C.validate_run(c, num_devices)
    C.check_str(c, "data.name", "must name the TFDS RL prompt dataset")
    C.check_str(c, "data.tokenizer",
                "must be the tokenizer directory (responses are decoded for scoring)")
    C.check_int(c, "data.num_epochs", lo=0)
    C.check_bool(c, "data.shuffle")

    r = "rollout"
    P = C.check_int(c, f"{r}.prompts_per_step", lo=1)
    C.check_int(c, f"{r}.group_size", lo=2)
    C.check_num(c, f"{r}.temperature", lo=0, open_lo=True)
    C.check_num(c, f"{r}.top_p", lo=0, hi=1, open_lo=True)
    C.check_int(c, f"{r}.top_k", lo=0)
    C.check_num(c, f"{r}.repetition_penalty", lo=0, open_lo=True)
    lp = C.check_int(c, f"{r}.max_prompt_len", lo=1)
    ln = C.check_int(c, f"{r}.max_new_tokens", lo=1)
    C.check_int(c, f"{r}.decode_slots", lo=0)
    C.check_int(c, f"{r}.decode_chunk", lo=1)
    C.check_bool(c, f"{r}.overlap_scoring")
    C.check_choice(c, f"{r}.weights_dtype", ("auto",) + C.DTYPES, "dtype")
    if c.init.source == "scratch":
        C.need(lp + ln <= c.model.max_position_embeddings, f"{r}.max_new_tokens",
               f"max_prompt_len + max_new_tokens = {lp + ln} exceeds "
               f"model.max_position_embeddings = {c.model.max_position_embeddings}")

    t = "train"
    C.check_int(c, f"{t}.total_steps", lo=1)
    bp = C.check_int(c, f"{t}.batch_prompts", lo=1)
    C.need(bp <= P, f"{t}.batch_prompts",
           f"{bp} groups wanted but only rollout.prompts_per_step = {P} sampled")
    k = C.check_int(c, f"{t}.num_minibatches", lo=1)
    C.need(bp % k == 0, f"{t}.num_minibatches",
           f"train.batch_prompts = {bp} is not divisible by {k} mini-batches")
    nm = C.check_int(c, f"{t}.num_microbatches", lo=1)
    rows = bp // k * c.rollout.group_size
    C.need(rows % nm == 0, f"{t}.num_microbatches",
           f"a mini-batch of {rows} rows (batch_prompts / num_minibatches * group_size) is "
           f"not divisible by {nm} micro-batches")
    shards = C.batch_shards(sizes, num_devices)
    if shards is not None:
        C.need((rows // nm) % shards == 0, f"{t}.num_microbatches",
               f"micro-batch of {rows // nm} rows is not divisible by mesh.data * mesh.fsdp = "
               f"{shards}")
    C.check_int(c, f"{t}.length_bucket", lo=0)
    C.check_choice(c, f"{t}.partial_minibatch", PARTIAL_MINIBATCH, "mode")
    C.check_int(c, f"{t}.max_consecutive_skips", lo=1)
    C.check_int(c, f"{t}.log_every", lo=1)

    L = "loss"
    C.check_choice(c, f"{L}.kind", tuple(losses.POLICY_LOSSES), "policy loss")
    C.check_num(c, f"{L}.eps_low", lo=0, hi=0.999)
    C.check_num(c, f"{L}.eps_high", lo=0)
    C.check_num(c, f"{L}.beta1", lo=0)
    C.check_num(c, f"{L}.beta2", lo=0)
    dc = C.check_num(c, f"{L}.dual_clip", lo=0)
    C.need(dc == 0 or dc > 1, f"{L}.dual_clip", f"must be 0 (off) or > 1, got {dc}")
    C.validate_agg(c, f"{L}.agg")
    nl = C.check_num(c, f"{L}.norm_length", lo=0)
    if c.loss.agg == "seq-mean-token-sum-norm":
        C.need(nl > 0, f"{L}.norm_length", "must be > 0 with agg = seq-mean-token-sum-norm")
    C.check_num(c, f"{L}.sft_alpha", lo=0)
    if C.check_choice(c, f"{L}.normalize", NORMALIZE, "normalisation") == "microbatch":
        C.need(c.loss.agg == "token-mean", f"{L}.agg",
               f"must be token-mean with loss.normalize = microbatch, got {c.loss.agg!r}")
        dev = C.check_int(c, f"{L}.verl_devices", lo=1)
        C.need(rows % dev == 0, f"{L}.verl_devices",
               f"a mini-batch of {rows} rows is not divisible by {dev} emulated devices")
    C.check_choice(c, f"{L}.filter_by", FILTER_BY, "filter")
    C.check_choice(c, f"{L}.adv_estimator", ADV_ESTIMATORS, "estimator")
    for b in ("adv_use_std", "filter_zero_adv", "overlong_filter"):
        C.check_bool(c, f"{L}.{b}")
    C.validate_rewards(c)
    C.validate_optim(c)
    C.validate_checkpoint(c)
