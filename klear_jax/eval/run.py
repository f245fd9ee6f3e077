"""Evaluation: k samples per problem from a checkpoint, scored -> avg@k / pass@k per benchmark.

``checkpoint`` is an Orbax checkpoint (a params-only dir from ``checkpoint.save_params`` or
an SFT / RL workdir; parameters alone are restored onto this run's mesh) or a HF directory
(config.json + *.safetensors); a dir holding config.json and safetensors is taken as HF.
The tokenizer is ``tokenizer`` if set, else the HF dir's own, else the ``data.tokenizer``
of the run config saved in the Orbax checkpoint. Config keys: ``klear_jax.eval.config``.

Benchmark files are JSONL, one problem a line, in the RL prompt-set format
(``klear_jax.data.records``): math ``{"problem", "answer"}``; code ``{"problem", "tests"}``
with tests ``{"inputs": [...], "outputs": [...], ["fn_name"]}`` (stdin/stdout, or
call-based with fn_name; APPS/TACO ``input_output`` accepted, the dict may be a JSON
string). Optional ``id`` names the problem (default: its line number). The prompt is built
exactly as the RL data path builds it (``prepare.rl_example``: ``prompt_template`` around
the problem, then the chat template with the assistant header), so eval and RL agree. A bad
record raises ``RecordError`` "path:line: problem".

Samples come from the rollout engine (``klear_jax.engine``: batch_prompts x
samples_per_call decode slots, refilled as samples end; a setting's ``stop_strings`` end a
sample while decoding); each chunk's finished samples are scored while decoding goes on.
Scoring is the RL reward (math-verify; the sandboxed code runner in soft mode). On several
processes (a pod's hosts, ``sharding.initialize_distributed``) every process draws every
sample on the global mesh, scores its share of the problems (``engine.process_share``), and
the scores are put together on every process; only process 0 writes ``out_dir``. A sample is
*correct* when it earns the full reward (math verifies; code passes every test);
``accuracy`` == ``avg@k`` is the fraction of correct samples, ``pass_rate`` the mean soft
pass rate (code) and ``pass@k`` the unbiased estimator (``klear_jax.eval.metrics``).

Python API (what the demo calls in-process)::

    from klear_jax.eval import evaluate, Benchmark, Setting
    res = evaluate(model_or_ckpt, tokenizer, benchmarks, settings, mesh=None, out_dir=None,
                   seed=0, max_prompt_len=512, batch_prompts=0, samples_per_call=0,
                   math_reward=None, code_reward=None, checkpoint_step=-1,
                   model_overrides=None, log=print)
    res["results"]["math"]["t1_0"]["accuracy"]     # avg@k at that setting

``model_or_ckpt``: a ``Qwen`` model (its params may live on ``mesh``) or a checkpoint path;
``tokenizer``: a tokenizer or its directory (None = find it as above); ``benchmarks`` /
``settings``: lists of ``Benchmark`` / ``Setting`` or dicts of their fields. A setting's
``num_samples`` 0 takes the benchmark's. ``model_overrides``: ModelConfig fields applied when
loading from a path (dtype, rope_scaling for YaRN, ...). Returns the results dict, also
written to ``out_dir/results.json`` with per-sample rows in
``out_dir/samples/<benchmark>__<setting>.jsonl``::

    {"checkpoint": str, "model": {ModelConfig fields}, "seed": int, "wall_time_s": float,
     "settings": {name: {temperature, top_p, top_k, repetition_penalty, max_new_tokens,
                         num_samples, stop_strings, greedy}},
     "benchmarks": {name: {"kind", "path", "num_problems", "num_samples"}},
     "results": {benchmark: {setting: eval_metrics.summarize(...) + {"kind", "time_s",
                                                                  "tokens_per_s"}}}}
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from klear_jax import config as C
from klear_jax import policy
from klear_jax import sharding as shd
from klear_jax.data import records as R
from klear_jax.data.prepare import rl_example
from klear_jax.eval import config as ec
from klear_jax.eval import metrics as em
from klear_jax.rewards import CodeRewardConfig, MathRewardConfig
from klear_jax.rewards.scorers import KINDS, Scorers
from klear_jax.engine import Engine, gather_shares, process_share
from klear_jax.sampler import SamplingParams

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


# ------------------------------------------------------------------------------ specs
@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A JSONL file of problems. ``num_samples``: k per problem (unless the setting says)."""
    name: str
    path: str
    kind: str = "math"
    num_samples: int = 1
    prompt_template: str = "{problem}"

    def __post_init__(self):
        _check_name("Benchmark", self.name)
        if self.kind not in KINDS:
            raise ValueError(f"Benchmark {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"Benchmark {self.name!r}: num_samples must be an int >= 1")
        if "{problem}" not in self.prompt_template:
            raise ValueError(f"Benchmark {self.name!r}: prompt_template must contain '{{problem}}'")


@dataclasses.dataclass(frozen=True)
class Setting:
    """Sampling settings; temperature 0 is greedy; num_samples 0 = the benchmark's k."""
    name: str
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 1024
    num_samples: int = 0
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        _check_name("Setting", self.name)
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not isinstance(self.num_samples, int) or self.num_samples < 0:
            raise ValueError(f"Setting {self.name!r}: num_samples must be an int >= 0")
        self.sampling_params(1)  # validates the rest, naming the field

    def sampling_params(self, n: int, stop_ids: Sequence[int] = ()):
        try:
            return SamplingParams(temperature=float(self.temperature), top_p=float(self.top_p),
                                  top_k=int(self.top_k),
                                  repetition_penalty=float(self.repetition_penalty),
                                  max_new_tokens=self.max_new_tokens, stop_token_ids=stop_ids,
                                  n=n, stop_strings=self.stop_strings)
        except ValueError as e:
            raise ValueError(f"Setting {self.name!r}: {e}") from None


def _check_name(what, name):
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} name must match {_NAME.pattern} (it names output files), "
                         f"got {name!r}")


def _as(cls, x):
    return x if isinstance(x, cls) else cls(**dict(x))


# ------------------------------------------------------------------------------ problems
@dataclasses.dataclass
class Problem:
    id: str
    line: int
    prompt_ids: list[int]
    answer: str
    tests: dict | None


def load_problems(bench: Benchmark, tokenizer, max_prompt_len: int) -> list[Problem]:
    """Reads and validates ``bench.path``; RecordError "path:line: problem" on a bad record."""
    if not os.path.isfile(bench.path):
        raise FileNotFoundError(f"benchmark {bench.name!r}: file {bench.path!r} does not exist")
    out, seen = [], {}
    for raw in R.iter_raw_records([bench.path]):
        try:
            fields = R.rl_fields(raw.data, "rl_" + bench.kind)
            ex, _ = rl_example(tokenizer, fields, None, bench.prompt_template)
            pid = raw.data.get("id", raw.line)
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise ValueError(f"field 'id' must be a string or int, got {type(pid).__name__}")
            pid = str(pid)
            if pid in seen:
                raise ValueError(f"id {pid!r} repeats line {seen[pid]}")
            n = len(ex["prompt_ids"])
            if n > max_prompt_len:
                raise ValueError(f"prompt has {n} tokens, more than max_prompt_len = "
                                 f"{max_prompt_len} (raise it: eval never drops a problem)")
        except ValueError as e:
            raise R.RecordError(raw.path, raw.line, str(e)) from None
        seen[pid] = raw.line
        out.append(Problem(pid, raw.line, [int(t) for t in ex["prompt_ids"]], fields["answer"],
                           fields["tests"]))
    if not out:
        raise ValueError(f"benchmark {bench.name!r}: {bench.path} holds no problems")
    return out


# ------------------------------------------------------------------------------ evaluation
def _sample_and_score(engine, state, tok, problems, bench, setting, k, stop_ids, seed,
                      scorers, all_texts: bool = True):
    """-> per-sample arrays [P, k] (texts, rewards, correct, pass_rate, lengths, truncated).
    One engine call draws all P x k samples (on every process); each process scores the
    samples of its ``process_share`` of the problems while the engine decodes on, and the
    scores of all processes are put together on every process. ``texts`` holds every
    sample's response with ``all_texts`` (the process writing them), else only the scored
    ones' ("" elsewhere)."""
    P = len(problems)
    own = process_share(P)
    texts = [[""] * k for _ in range(P)]
    pending = []

    def submit(finished):
        finished = [f for f in finished if all_texts or f.index // k in own]
        for f in finished:
            texts[f.index // k][f.index % k] = tok.decode(f.tokens.tolist(),
                                                         skip_special_tokens=True)
        idx = [(f.index // k, f.index % k) for f in finished if f.index // k in own]
        if idx:
            refs = [problems[p].tests if bench.kind == "code" else problems[p].answer
                    for p, _ in idx]
            pending.append((idx, scorers.submit(bench.kind, [texts[p][j] for p, j in idx],
                                                refs)))

    out = engine.generate(state, [p.prompt_ids for p in problems],
                          setting.sampling_params(k, stop_ids), seed, on_finish=submit)
    rewards = np.zeros((len(own), k), np.float32)
    correct = np.zeros((len(own), k), bool)
    pass_rate = np.zeros((len(own), k), np.float32)
    for idx, done in pending:
        s = done()
        for (p, j), a, b, c in zip(idx, s.rewards, s.correct, s.pass_rate):
            q = p - own.start
            rewards[q, j], correct[q, j], pass_rate[q, j] = a, b, c
    rewards, correct, pass_rate = gather_shares((rewards, correct, pass_rate), P)
    return (texts, rewards, correct, pass_rate, out.lengths.reshape(P, k),
            out.truncated.reshape(P, k))


def evaluate(model_or_ckpt, tokenizer, benchmarks, settings, mesh=None, out_dir=None, *,
             seed: int = 0, max_prompt_len: int = 512, batch_prompts: int = 0,
             samples_per_call: int = 0, math_reward=None, code_reward=None,
             checkpoint_step: int = -1, model_overrides: dict | None = None,
             log: Callable[[str], Any] | None = print) -> dict:
    """Samples, scores and summarises every (benchmark, setting). See the module docstring."""
    t_start = time.perf_counter()
    benchmarks = [_as(Benchmark, b) for b in benchmarks]
    settings = [_as(Setting, s) for s in settings]
    for what, items in (("benchmark", benchmarks), ("setting", settings)):
        names = [x.name for x in items]
        if not items or len(set(names)) != len(names):
            raise ValueError(f"evaluate: need at least one {what}, with distinct names: {names}")
    ckpt_path = model_or_ckpt if isinstance(model_or_ckpt, (str, os.PathLike)) else None
    tok = policy.resolve_tokenizer(tokenizer, os.fspath(ckpt_path) if ckpt_path else None,
                            checkpoint_step)
    problems = {b.name: load_problems(b, tok, max_prompt_len) for b in benchmarks}
    if ckpt_path is not None:
        model = policy.load_model(os.fspath(ckpt_path), mesh, checkpoint_step,
                                  **dict(model_overrides or {}))
    else:
        model = model_or_ckpt
    mcfg = model.config
    policy.check_vocab(tok, mcfg.vocab_size, "model.vocab_size (of the checkpoint)")
    graphdef, state = nnx.split(model)
    pad_id, stop_ids = policy.special_ids(tok, mcfg.vocab_size)
    engines: dict[int, Engine] = {}  # by slot count (each keeps its compiled functions)
    # Soft code mode always: the pass rate is the reward, so both metrics come from it.
    scorers = Scorers(math_reward or MathRewardConfig(),
                      dataclasses.replace(code_reward or CodeRewardConfig(), mode="soft"))
    if any(b.kind == "code" for b in benchmarks):
        scorers.code  # the sandbox's containment check (SandboxUnavailable) before sampling
    results: dict[str, dict] = {b.name: {} for b in benchmarks}
    writer = bool(out_dir) and jax.process_index() == 0  # one report for all processes
    if writer:
        os.makedirs(os.path.join(out_dir, "samples"), exist_ok=True)
    try:
        for s in settings:
            for b in benchmarks:
                k = s.num_samples or b.num_samples
                slots = (batch_prompts or len(problems[b.name])) * min(samples_per_call or k, k)
                engine = engines.setdefault(slots, Engine(
                    graphdef, mesh=mesh, pad_id=pad_id, max_prompt_len=max_prompt_len,
                    slots=slots, tokenizer=tok))
                t0 = time.perf_counter()
                texts, rewards, correct, pass_rate, lengths, trunc = _sample_and_score(
                    engine, state, tok, problems[b.name], b, s, k, stop_ids, seed, scorers,
                    all_texts=writer)
                dt = time.perf_counter() - t0
                m = {"kind": b.kind, **em.summarize(correct, pass_rate, rewards, lengths, trunc),
                     "time_s": dt, "tokens_per_s": float(lengths.sum()) / max(dt, 1e-9)}
                results[b.name][s.name] = m
                if log:
                    log(f"[eval] {b.name} / {s.name}: avg@{k} {m['accuracy']:.4f}  pass_rate "
                        f"{m['pass_rate']:.4f}  pass@{k} {m['pass@k'][str(k)]:.4f}  ({dt:.1f} s)")
                if writer:
                    _write_samples(os.path.join(out_dir, "samples", f"{b.name}__{s.name}.jsonl"),
                                   b, s, problems[b.name], texts, rewards, correct, pass_rate,
                                   lengths, trunc)
    finally:
        scorers.close()
    out = {
        "checkpoint": os.fspath(ckpt_path) if ckpt_path else None,
        "model": json.loads(json.dumps(dataclasses.asdict(mcfg))), "seed": int(seed),
        "max_prompt_len": int(max_prompt_len),
        "settings": {s.name: {**{f: v for f, v in dataclasses.asdict(s).items() if f != "name"},
                              "greedy": s.sampling_params(1).greedy} for s in settings},
        "benchmarks": {b.name: {"kind": b.kind, "path": b.path, "num_problems": len(problems[b.name]),
                                "num_samples": b.num_samples} for b in benchmarks},
        "results": results, "wall_time_s": time.perf_counter() - t_start}
    if writer:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(out, f, indent=2)
    if log:
        log(em.format_table(results))
    return out


def _write_samples(path, b, s, problems, texts, rewards, correct, pass_rate, lengths, trunc):
    with open(path, "w") as f:
        for p, prob in enumerate(problems):
            for j in range(len(texts[p])):
                f.write(json.dumps({
                    "benchmark": b.name, "setting": s.name, "problem_id": prob.id,
                    "line": prob.line, "sample": j, "response": texts[p][j],
                    "reward": float(rewards[p, j]), "correct": bool(correct[p, j]),
                    "pass_rate": float(pass_rate[p, j]), "length": int(lengths[p, j]),
                    "truncated": bool(trunc[p, j])}) + "\n")


# ------------------------------------------------------------------------------ CLI
def run(cfg) -> dict:
    """Validates ``cfg`` (``klear_jax.eval.config`` schema) and evaluates (on several
    processes when KLEAR_COORDINATOR etc. say so: ``sharding.initialize_distributed``)."""
    shd.initialize_distributed()
    ec.validate_eval_config(cfg, jax.device_count())
    mesh = shd.mesh_from_config(cfg.mesh)
    out_dir = cfg.out_dir or os.path.join(cfg.checkpoint, "eval")
    return evaluate(cfg.checkpoint, cfg.tokenizer or None, ec.benchmarks_from_config(cfg),
                    ec.settings_from_config(cfg), mesh=mesh, out_dir=out_dir, seed=cfg.seed,
                    max_prompt_len=cfg.sampling.max_prompt_len,
                    batch_prompts=cfg.sampling.batch_prompts,
                    samples_per_call=cfg.sampling.samples_per_call,
                    math_reward=C.math_reward_config(cfg), code_reward=C.code_reward_config(cfg),
                    checkpoint_step=cfg.checkpoint_step, model_overrides=ec.model_overrides(cfg))
