"""The paper's code RL stage (GPPO) of Klear-Reasoner-8B on a TPU v5p-64 slice, starting
from the math RL checkpoint (or the SFT one).

Same as ``gppo_math_qwen3_8b.py`` (variants included, ``:semantics=official`` too) except
(paper section 6): lr 5e-7; mini-batches of 32 prompts (4 updates per step; 4 rows per
emulated verl device); soft code reward = fraction of up to 16 tests passed, each run in
the bubblewrap sandbox with the paper's 35 s timeout. ``:semantics=official``: 2p - 1 over
16 tests drawn at random per response, as the authors' reward code does.

    python -m klear_jax.rl --config=configs/gppo_code_qwen3_8b.py \
        --config.workdir=gs://b/rl_code --config.init.path=gs://b/rl_math/checkpoints \
        --config.data.dir=gs://b/tfds --config.data.name=klear_code \
        --config.data.tokenizer=/path/to/tokenizer
"""

import importlib.util
import os


def _math_config():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gppo_math_qwen3_8b.py")
    spec = importlib.util.spec_from_file_location("_gppo_math_qwen3_8b", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def get_config(arg=None):
    c = _math_config().get_config(arg)
    c.data.update(name="")
    # 32 prompts x 8 = 256 rows per mini-batch; micro-batches of one row per batch shard, as
    # in the math config (8 on v5p-64; 16 on v6e-64 :chips=64,tensor=4, where 8 micro-batches
    # of 2 rows per shard needed 34.9 GiB per chip for the train step: tests/test_aot.py).
    shards = c.mesh["data"] * c.mesh["fsdp"]
    c.train.update(num_minibatches=4, num_microbatches=256 // shards)
    c.reward.code.update(timeout_s=35.0, max_tests=16, num_slots=0, allow_unsandboxed=False)
    c.optim.update(lr=5e-7, end_lr=5e-7)
    return c
