"""Tiny CPU evaluation: greedy, T=1.0 (the RL sampling temperature) and T=0.6 (the paper's)
in one model load, on a math and a code JSONL file (tests, the demo's held-out sets).

    python -m klear_jax.eval --config=configs/eval_tiny.py --config.checkpoint=DIR \
        --config.tokenizer=TOK --config.benchmarks.math.path=math.jsonl \
        [--config.benchmarks.code.path=code.jsonl] [--config.out_dir=OUT]
Variants: ``configs/eval_tiny.py:k=8,max_new=128`` (k samples per problem for the
sampled settings; greedy always takes 1). A benchmark whose path is "" is skipped.
"""

from klear_jax import config as C
from klear_jax.eval import config as ec


def get_config(arg=None):
    a = C.parse_arg(arg, k=4, max_new=64, prompt_len=128)
    c = ec.eval_base()
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.model.update(dtype="float32", param_dtype="float32")
    c.sampling.update(max_prompt_len=a.prompt_len, batch_prompts=0, samples_per_call=0)
    ec.add_benchmark(c, "math", "math", num_samples=a.k)
    ec.add_benchmark(c, "code", "code", num_samples=a.k)
    ec.add_setting(c, "greedy", temperature=0.0, max_new_tokens=a.max_new, num_samples=1)
    ec.add_setting(c, "t1_0", temperature=1.0, top_p=1.0, max_new_tokens=a.max_new)
    ec.add_setting(c, "t0_6", temperature=0.6, top_p=0.95, max_new_tokens=a.max_new)
    c.reward.math.update(num_workers=1)
    c.reward.code.update(timeout_s=5.0, max_tests=8)
    return c
