"""The paper's evaluation protocol (arXiv 2508.07629, section 8) for a Qwen3-8B-sized checkpoint.

avg pass@1 with temperature 0.6, top_p 0.95, top_k 20, repetition penalty 1.05, up to
64K response tokens with YaRN (factor 2.5 over 32768 original positions): 64 samples per
problem for AIME-style sets and 8 for LiveCodeBench-style ones. Files are the user's own
JSONL (math {"problem", "answer"}, code {"problem", "tests"}); nothing is downloaded and a
benchmark left without a path is skipped:

    python -m klear_jax.eval --config=configs/eval_qwen3_8b.py --config.checkpoint=HF_OR_ORBAX \
        --config.benchmarks.aime24.path=aime24.jsonl --config.benchmarks.aime25.path=aime25.jsonl \
        --config.benchmarks.lcb_v5.path=lcb_v5.jsonl --config.benchmarks.lcb_v6.path=lcb_v6.jsonl

Memory: each sampled row holds a KV cache of 36 layers x (4096 + 65536) positions x 8 kv
heads x 128 x 2 (k, v) in bfloat16, about 10 GiB, sharded over mesh.data x mesh.fsdp by
row. A sampler call has batch_prompts x samples_per_call rows (4 x 16 = 64 here, ~1 row and
~10 GiB of cache per chip on 64 chips beside the ~16 GiB of bf16 weights): lower them for
smaller slices. Variant ``:max_new=32768`` turns the budget (and YaRN) down.
"""

from klear_jax import config as C
from klear_jax.eval import config as ec


def get_config(arg=None):
    a = C.parse_arg(arg, max_new=65536, aime_k=64, lcb_k=8)
    c = ec.eval_base()
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.model.update(dtype="bfloat16", param_dtype="bfloat16", attention_impl="xla")
    if a.max_new > 32768 - 4096:
        c.model.update(rope_scaling_factor=2.5, original_max_position_embeddings=32768)
    c.sampling.update(max_prompt_len=4096, batch_prompts=4, samples_per_call=16)
    for name in ("aime24", "aime25"):
        ec.add_benchmark(c, name, "math", num_samples=a.aime_k)
    for name in ("lcb_v5", "lcb_v6"):
        ec.add_benchmark(c, name, "code", num_samples=a.lcb_k)
    ec.add_setting(c, "paper", temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05,
                   max_new_tokens=a.max_new, num_samples=0)
    # Qwen3-style chat templates may open <think> in the prompt; then set these to False.
    c.reward.math.update(require_open_think=True, num_workers=8, deadline_s=30.0)
    c.reward.code.update(require_open_think=True, timeout_s=35.0, max_tests=16)
    return c
