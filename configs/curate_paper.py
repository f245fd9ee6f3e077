"""The paper's data recipes (arXiv 2508.07629, sections 3.1 and 3.2.1) as curation runs.

    python -m klear_jax.curate --config=configs/curate_paper.py:kind=sft,root=/data/raw \
        --config.output.dir=/data/curated --config.output.tokenizer=/models/Qwen3-8B-Base
    python -m klear_jax.curate --config=configs/curate_paper.py:kind=rl_math,root=/data/raw ...
    python -m klear_jax.curate --config=configs/curate_paper.py:kind=rl_code,ref=/ckpt/ref ...

SFT (kind=sft): prompts from a few top sources per domain (math: OpenThoughts, NuminaMath,
AceReason-Nemotron 1.1; code: OpenThoughts, OpenCodeReasoning, AceReason, TACO, APPS,
Codeforces), exact query dedup and 9-gram decontamination against the test sets; DeepSeek-
R1-0528 traces, up to 16 per prompt (``dedup.max_per_prompt = 16``); every trace is kept,
incorrect ones included ("all responses are retained since most samples qualify as
difficult"), so no labelling / retention step runs; rows up to 32K tokens. Files under ROOT:
  sft_math/*.jsonl, sft_code/*.jsonl   {"prompt", "response", ...} (one trace a line)

RL (kind=rl_math / rl_code): exact dedup and 9-gram decontamination; code problems need >=
16 tests; a reference model (the paper: DeepSeek-R1-0120) samples 16 responses per problem
and a problem is kept when more than half pass (pass rate >= 9/16): ``ref=`` is that
checkpoint (Orbax or HF dir). Its sampling settings are not in the paper (R1's recommended
temperature 0.6, top_p 0.95 here). Without ``ref`` the pass rate comes from 16 precomputed
``samples`` per record. Files under ROOT:
  rl_math/*.jsonl  {"problem", "answer"}      rl_code/*.jsonl  {"problem", "tests"}
Benchmarks for decontamination: ROOT/bench/{aime24,aime25,hmmt25,lcb_v5,lcb_v6}.jsonl.
"""
from klear_jax import config as C
from klear_jax.curate import curate_base, source

REF_SAMPLES = 16
MAJORITY = (REF_SAMPLES // 2 + 1) / REF_SAMPLES  # "more than half" of 16 = 9/16


def get_config(arg=None):
    a = C.parse_arg(arg, kind="sft", root="data/raw", ref="")
    c = curate_base()
    c.kind, c.seed, r = a.kind, 0, a.root
    c.select.top_n_per_domain = 0  # the sources listed are already the few top ones
    c.dedup.update(prompt=True, max_unique=0)
    c.decontam.benchmarks = {b: [f"{r}/bench/{b}.jsonl"]
                             for b in ("aime24", "aime25", "hmmt25", "lcb_v5", "lcb_v6")}
    c.decontam.n = 9
    if a.kind == "sft":
        c.sources.sft_math = source(paths=[f"{r}/sft_math/*.jsonl"], domain="math", quality=1.0)
        c.sources.sft_code = source(paths=[f"{r}/sft_code/*.jsonl"], domain="code", quality=1.0)
        c.dedup.update(max_per_prompt=16, response=True)
        c.label.enabled = False  # every trace is retained: nothing to decide on
        c.retain.update(keep_incorrect_hard=True, keep_incorrect_easy=True)
        c.output.update(max_length=32768, overlong="truncate")
    else:
        domain = a.kind.split("_")[1]
        c.sources[a.kind] = source(paths=[f"{r}/{a.kind}/*.jsonl"], domain=domain, quality=1.0)
        c.dedup.update(max_per_prompt=1, response=False)
        c.rl_filter.update(min_pass_rate=MAJORITY, max_pass_rate=1.0,
                           min_tests=16 if domain == "code" else 0)
        c.label.update(code_timeout_s=35.0, code_max_tests=16, math_workers=8)
        c.pass_rate.update(source="model" if a.ref else "samples", samples_field="samples",
                           batch_size=64)
        c.pass_rate.model.update(checkpoint=a.ref, num_samples=REF_SAMPLES, temperature=0.6,
                                 top_p=0.95, max_new_tokens=32768, batch_prompts=8, seed=0,
                                 max_prompt_len=4096, dtype="bfloat16",
                                 mesh=dict(data=1, fsdp=-1, tensor=1))
        c.output.max_length = 4096
    c.output.update(dir="data/curated", name=f"klear_{a.kind}", tfds=True, tokenizer="",
                    val_fraction=0.0, drop_fields=("samples",))
    return c
