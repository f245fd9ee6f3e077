"""The paper's evaluation protocol (arXiv 2508.07629, section 4 / Table 1) for a
Qwen3-8B-sized checkpoint.

avg pass@1 with temperature 0.6, top_p 0.95, top_k 20, repetition penalty 1.05 (the
authors' benchmarks/inference.py): 64 samples per problem for AIME24, AIME25 and HMMT25
(Feb), 8 for LiveCodeBench v5 / v6. Two budgets, as in the paper's table:

    default            up to 65536 response tokens with YaRN (factor 2.5 over 32768
                       original positions: 81920 positions, the authors' --max-model-len)
    :max_new=32768     the "32K" rows: 32768 response tokens, no YaRN (4096 + 32768 fits
                       Qwen3's native 40960 positions)

Scoring follows the official judges, not the RL reward: no <think> / </think> tag is
required (the answer is taken after the last </think>, or from the whole response when
there is none; benchmarks/judge_math.py checks no tag) and LiveCodeBench runs every test of
a problem (the official harness), not 16. Files are the user's own JSONL (math
{"problem", "answer"}, code {"problem", "tests"}); nothing is downloaded and a benchmark
left without a path is skipped:

    python -m klear_jax.eval --config=configs/eval_qwen3_8b.py --config.checkpoint=HF_OR_ORBAX \
        --config.benchmarks.aime24.path=aime24.jsonl --config.benchmarks.aime25.path=aime25.jsonl \
        --config.benchmarks.hmmt25.path=hmmt25.jsonl \
        --config.benchmarks.lcb_v5.path=lcb_v5.jsonl --config.benchmarks.lcb_v6.path=lcb_v6.jsonl

Memory: each sampled row holds a KV cache of 36 layers x (4096 + 65536) positions x 8 kv
heads x 128 x 2 (k, v) in bfloat16, about 10 GiB, sharded over mesh.data x mesh.fsdp by
row. A sampler call has batch_prompts x samples_per_call rows (4 x 16 = 64 here, ~1 row and
~10 GiB of cache per chip on 64 chips beside the ~16 GiB of bf16 weights): lower them for
smaller slices.
"""

from klear_jax import config as C
from klear_jax.eval import config as ec
from klear_jax.policy import PAPER_SAMPLING

NATIVE_RESPONSE = 32768  # longest budget without YaRN (Qwen3: 40960 positions, prompts <= 4096)


def get_config(arg=None):
    a = C.parse_arg(arg, max_new=65536, aime_k=64, lcb_k=8)
    c = ec.eval_base()
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.model.update(dtype="bfloat16", param_dtype="bfloat16", attention_impl="xla")
    if a.max_new > NATIVE_RESPONSE:
        c.model.update(rope_scaling_factor=2.5, original_max_position_embeddings=32768)
    c.sampling.update(max_prompt_len=4096, batch_prompts=4, samples_per_call=16)
    for name in ("aime24", "aime25", "hmmt25"):
        ec.add_benchmark(c, name, "math", num_samples=a.aime_k)
    for name in ("lcb_v5", "lcb_v6"):
        ec.add_benchmark(c, name, "code", num_samples=a.lcb_k)
    ec.add_setting(c, "paper", **PAPER_SAMPLING, max_new_tokens=a.max_new, num_samples=0)
    # The official judges: no tag required, every LiveCodeBench test run.
    c.reward.math.update(think_check="none", num_workers=8, deadline_s=30.0)
    c.reward.code.update(think_check="none", test_selection="all", timeout_s=35.0, max_tests=16)
    return c
