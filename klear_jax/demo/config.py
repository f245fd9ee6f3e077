"""The CPU demo's configs (``python -m klear_jax.demo``): SFT -> GPPO -> eval of a small
Qwen3 model. Inside the package, so an installed klear_jax runs the demo from anywhere.

One file, big_vision style; the variant string picks the stage and size:

    stage=sft            SFT config (klear_jax.sft)
    stage=rl             GPPO config (klear_jax.rl)
    stage=rl,size=tiny   the miniature used by tests/test_demo.py

The demo fills in workdir / data / init paths itself; to run a stage by hand, pass them
(``python -c 'import klear_jax.demo.config as c; print(c.__file__)'`` prints the path):

    python -m klear_jax.sft --config=DEMO_CONFIG:stage=sft --config.workdir=W/sft \
        --config.data.dir=W/tfds --config.data.name=demo_sft
    python -m klear_jax.rl --config=DEMO_CONFIG:stage=rl --config.workdir=W/rl_math \
        --config.data.dir=W/tfds --config.data.name=demo_rl_math \
        --config.data.tokenizer=W/tokenizer --config.init.source=orbax \
        --config.init.path=W/sft/checkpoints

``demo_settings(size)`` holds the non-trainer knobs (task sizes, teacher error rates,
evaluation k / temperatures) so that the demo and its tests read them from one place.
"""

import ml_collections

from klear_jax import config as C
from klear_jax.rl.config import rl_base
from klear_jax.sft.config import sft_base

SIZES = {
    # hidden, layers, heads, kv heads, head_dim, mlp, vocab
    "default": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                    intermediate_size=384, vocab=512),
    "tiny": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                 intermediate_size=64, vocab=384),
}


def demo_settings(size: str = "default") -> ml_collections.ConfigDict:
    """Task / teacher / evaluation settings of the demo (not trainer configs)."""
    tiny = size == "tiny"
    return ml_collections.ConfigDict(dict(
        n_sft=300 if tiny else 6000, n_rl=64 if tiny else 2000, n_eval=8 if tiny else 64,
        math_error=0.25, code_error=0.3, code_frac=0.4, num_ops=(1, 2), max_operand=5,
        num_tests=4,
        vocab=SIZES[size]["vocab"],
        # code RL: fewer prompts per step (each response runs num_tests sandboxed programs)
        # code RL at 1e-4 x 10 steps: 2e-4 x 15 raised code as much (+20 points) but took
        # math back down 5.5 points (seed 0) and ~1.5 min more; 1e-4 x 10: code +19.6, math -2.
        code_rl_steps=2 if tiny else 10,
        code_rl_overrides=("rollout.prompts_per_step=8", "train.batch_prompts=8",
                           "optim.lr=1e-4", "optim.end_lr=1e-4"),
        # RL stages in order, each from the previous one's weights (SFT first). Code first,
        # math last: math then code lost 2-7 points of the math gain in the code stage (seeds
        # 0/1: final math +7.8/+4.7); code then math kept both (math +10.2/+12.1, code
        # +15.6/+23.0 from the same SFT checkpoints, docs/demo.md).
        rl_order=("code", "math"),
        # avg@k at T=1.0 (the RL temperature, the target's figure) and at the paper's 0.6;
        # greedy is always added.
        eval_k=4, eval_temperatures=(1.0, 0.6), eval_top_p=1.0, eval_max_new_tokens=48,
        ablation_seeds=3, ablation_losses=("gppo", "clip", "cispo"),
        ablation_code_modes=("soft", "all_or_nothing"), ablation_minibatches=8))


def _model(c, size):
    s = SIZES[size]
    c.model.update(vocab_size=s["vocab"], hidden_size=s["hidden_size"],
                   intermediate_size=s["intermediate_size"], num_layers=s["num_layers"],
                   num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"],
                   head_dim=s["head_dim"], max_position_embeddings=256, rope_theta=10000.0,
                   dtype="float32", param_dtype="float32", logprob_chunk_size=64,
                   tie_word_embeddings=True)


def sft_config(size: str, steps: int) -> ml_collections.ConfigDict:
    c = sft_base()
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    _model(c, size)
    c.data.update(num_epochs=0, name="demo_sft")
    # 500 steps: at 250 the model had only a blurred table of arithmetic facts (held-out math
    # greedy 0.31, T=1.0 0.24, seed 0) and RL could not generalise across problems; at 500
    # greedy is 0.88 and T=1.0 0.62, the regime where RL sharpens sampling (docs/demo.md).
    c.train.update(total_steps=steps or (6 if size == "tiny" else 500),
                   batch_size=8 if size == "tiny" else 32, seq_len=128, num_microbatches=1,
                   log_every=10 if size != "tiny" else 1)
    c.optim.update(lr=3e-3, end_lr=1e-4, schedule="cosine", warmup_steps=30,
                   weight_decay=0.0, clip_norm=1.0)
    c.checkpoint.update(every_steps=100000, keep=1, async_save=False)
    return c


def rl_config_(size: str, steps: int) -> ml_collections.ConfigDict:
    c = rl_base()
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    _model(c, size)
    c.init.update(source="orbax")
    c.data.update(num_epochs=0, name="demo_rl_math")
    tiny = size == "tiny"
    c.rollout.update(prompts_per_step=8 if tiny else 16, group_size=8, temperature=1.0,
                     top_p=1.0, max_prompt_len=64, max_new_tokens=48, decode_slots=0)
    c.train.update(total_steps=steps or (2 if tiny else 60), batch_prompts=8 if tiny else 16,
                   num_minibatches=2, num_microbatches=1, length_bucket=0,
                   max_consecutive_skips=5, log_every=1)
    c.loss.update(kind="gppo", eps_low=0.2, eps_high=0.28, dual_clip=10.0, sft_alpha=0.1)
    # A response that never closes </think> scores like a wrong answer (the paper's -0.5
    # would pay a weak model to ramble to the length cap instead of answering).
    c.reward.math.update(num_workers=1, deadline_s=10.0, missing_close_think=-1.0)
    # dedupe: a group's 8 samples often repeat one program; each runs its tests once.
    c.reward.code.update(mode="soft", timeout_s=5.0, max_tests=4, memory_mb=512, dedupe=True)
    # Math RL at 1e-4 x 60 steps: from the 500-step SFT model (seed 0) held-out avg@4 at
    # T=1.0 rose 0.617 -> 0.746, greedy 0.875 -> 0.891 (math stage alone, docs/demo.md).
    # From the weaker 250-step SFT model no lr worked (2e-4 lowered held-out math).
    # Code RL overrides this with 2e-4 (demo_settings).
    c.optim.update(lr=1e-4, end_lr=1e-4, schedule="constant", warmup_steps=0,
                   weight_decay=0.0, clip_norm=1.0)
    c.checkpoint.update(every_steps=100000, keep=1, async_save=False)
    return c


def get_config(arg=None):
    a = C.parse_arg(arg, stage="sft", size="default", steps=0)
    if a.size not in SIZES:
        raise ValueError(f"demo config: unknown size {a.size!r}; allowed {sorted(SIZES)}")
    if a.stage == "sft":
        return sft_config(a.size, a.steps)
    if a.stage == "rl":
        return rl_config_(a.size, a.steps)
    raise ValueError(f"demo config: unknown stage {a.stage!r}; allowed ('sft', 'rl')")
