"""Curating a long-CoT SFT set the Klear way (arXiv 2508.07629, sections 4 and 7).

    python -m klear_jax.curate --config=configs/curate_example.py:root=/data/raw \
        --config.output.dir=/data/curated --config.output.tokenizer=/models/tok

Files expected under ROOT (HF-style JSONL or Parquet; see klear_jax/data/records.py):
  math_a/*.jsonl, math_b/*.jsonl, math_c/*.jsonl   {"prompt", "response", "answer", "difficulty"}
  code_a/*.jsonl, code_b/*.jsonl                   {"prompt", "response", "tests", "difficulty"}
  bench/aime24.jsonl, bench/aime25.jsonl, bench/lcb_v5.jsonl   {"problem" | "question" | "prompt"}
Quality scores rank sources within a domain (e.g. from a small ablation); only the top two
per domain are read ("few top sources beat many"). Incorrect teacher traces are kept for
hard problems (difficulty >= 0.7) and dropped for easy ones: the paper's section 5.1.1
ablation, not its final recipe, which keeps every trace (up to 16 per prompt): that recipe,
and the paper's RL filters, are ``configs/curate_paper.py``.
Variants: `:kind=rl_math` makes an RL prompt set instead (pass-rate band from `pass_rate`),
from k precomputed `samples` per problem, or with `:kind=rl_math,ref=/ckpt/sft_model` from 8
samples per problem drawn here from that reference checkpoint (Orbax or HF dir; its
tokenizer, or set pass_rate.model.tokenizer) with the project's sampler and math reward.
"""
from klear_jax import config as C
from klear_jax.curate import curate_base, source


def get_config(arg=None):
    a = C.parse_arg(arg, root="data/raw", kind="sft", ref="")
    c = curate_base()
    c.kind = a.kind
    c.seed = 0
    r = a.root
    if a.kind == "sft":
        c.sources.math_a = source(paths=[f"{r}/math_a/*.jsonl"], domain="math", quality=0.9)
        c.sources.math_b = source(paths=[f"{r}/math_b/*.jsonl"], domain="math", quality=0.7, cap=200_000)
        c.sources.math_c = source(paths=[f"{r}/math_c/*.jsonl"], domain="math", quality=0.3)
        c.sources.code_a = source(paths=[f"{r}/code_a/*.jsonl"], domain="code", quality=0.8)
        c.sources.code_b = source(paths=[f"{r}/code_b/*.jsonl"], domain="code", quality=0.6, weight=0.5)
        c.label.update(enabled=True, batch_size=256, require_open_think=True, math_workers=8,
                       code_timeout_s=35.0, code_max_tests=16)
        c.difficulty.update(source="field", field="difficulty", hard_min=0.7)
        c.retain.update(keep_incorrect_hard=True, keep_incorrect_easy=False)
        c.output.max_length = 32768
    else:  # RL math prompts with k precomputed reference samples per problem
        c.sources.math_rl = source(paths=[f"{r}/math_rl/*.jsonl"], domain="math", quality=1.0)
        c.dedup.response = False
        c.pass_rate.update(source="samples", samples_field="samples", batch_size=64)
        if a.ref:  # sample the pass rate from a reference model instead
            c.pass_rate.source = "model"
            c.pass_rate.model.update(checkpoint=a.ref, num_samples=8, temperature=1.0, top_p=1.0,
                                     max_new_tokens=8192, batch_prompts=32, seed=0,
                                     max_prompt_len=1024, dtype="bfloat16",
                                     mesh=dict(data=1, fsdp=-1, tensor=1))
        c.rl_filter.update(min_pass_rate=0.05, max_pass_rate=0.95)
        c.output.max_length = 4096
    c.select.top_n_per_domain = 2
    c.dedup.update(prompt=True, max_unique=0)
    c.decontam.benchmarks = dict(aime24=[f"{r}/bench/aime24.jsonl"], aime25=[f"{r}/bench/aime25.jsonl"],
                                 lcb_v5=[f"{r}/bench/lcb_v5.jsonl"])
    c.decontam.n = 9
    c.output.update(dir="data/curated", name=f"klear_{a.kind}", tfds=True, tokenizer="",
                    val_fraction=0.0, drop_fields=("samples",))
    return c
