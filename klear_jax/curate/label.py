"""Correctness labels, pass rates and the decisions built on them (curation steps).

Which checker: by the record's domain (set from its source's `domain`): "math" -> the
project's math reward (klear_jax.rewards.math, math-verify) against the record's `answer`;
"code" -> the sandboxed code reward against the record's `tests` / `input_output`. Other
domains are left unlabelled (correct = None) and pass every correctness-based step.

A trace is correct when its reward equals MathRewardConfig.correct (math) or when it passes
every test it was run on (code; the first `max_tests`). Annotations written into the record:
    correct (bool | None), label_reward (float)   from LabelStep
    pass_rate (float in [0, 1]), pass_samples (int) from PassRateStep
Pass rate sources: "field" (a number in the record), "samples" (the record's list of
responses, e.g. k samples of a reference model, scored with the same checkers: the fraction
that is correct), "model" (ModelSamples: k responses per problem sampled here from a
reference checkpoint with the rollout engine, klear_jax.engine, then scored exactly like
"samples"). Scoring is batched: one batch of records is sampled / scored at a time.
"""
from __future__ import annotations

import math
from typing import Any

from flax import nnx

from klear_jax import policy
from klear_jax import sharding as shd
from klear_jax.curate.steps import Batched, Filter, response_text
from klear_jax.data import records as R
from klear_jax.data.prepare import rl_example
from klear_jax.data.records import RawRecord, RecordError
from klear_jax.rewards.scorers import Scorers
from klear_jax.engine import Engine
from klear_jax.sampler import Sampler, SamplingParams


def reference(d: dict, domain: str) -> tuple[Any, str | None]:
    """(answer or tests, None) or (None, drop reason) for a record of a checked domain."""
    if domain == "math":
        a = d.get("answer")
        if isinstance(a, bool) or not isinstance(a, (str, int, float)) or not str(a).strip():
            return None, "no_answer"
        return str(a), None
    try:
        return R.parse_tests(d), None
    except ValueError:
        return None, "no_tests"


CHECKED = ("math", "code")


def _score_groups(scorers: Scorers, items: list[tuple[int, str, str, Any]]):
    """items: (slot, domain, response, ref) -> {slot: [(correct, reward), ...]} (in order)."""
    out: dict[int, list] = {}
    for domain in CHECKED:
        sel = [it for it in items if it[1] == domain]
        s = scorers.submit(domain, [it[2] for it in sel], [it[3] for it in sel])()
        for it, c, rw in zip(sel, s.correct, s.rewards):
            out.setdefault(it[0], []).append((bool(c), float(rw)))
    return out


def label_step(scorers: Scorers, batch_size: int) -> Batched:
    """Labels each teacher trace correct / incorrect (see the module docstring)."""

    def decide_batch(batch: list[RawRecord]):
        reasons: list[str | None] = [None] * len(batch)
        items = []
        for k, r in enumerate(batch):
            dom = r.data.get("domain")
            if dom not in CHECKED:
                r.data["correct"] = None
                step.counter.info["unlabelled"] += 1
                continue
            ref, why = reference(r.data, dom)
            if why:
                reasons[k] = why
                continue
            items.append((k, dom, response_text(r.data), ref))
        scored = _score_groups(scorers, items)
        for k, [(c, rw)] in scored.items():
            batch[k].data["correct"], batch[k].data["label_reward"] = bool(c), float(rw)
            step.counter.info["correct" if c else "incorrect"] += 1
        return reasons

    step = Batched("label", decide_batch, batch_size)
    step.counter.info.update(correct=0, incorrect=0, unlabelled=0)
    return step


class ModelSamples:
    """k responses per problem from a reference model (pass_rate.source "model").

    ``m`` is the ``pass_rate.model`` config block (``klear_jax.curate.config``). The
    checkpoint (Orbax params / SFT / RL dir, or a HF dir) and its tokenizer are loaded
    lazily with klear_jax.policy onto the block's mesh; the prompt is built as the RL data
    path and eval build it (prepare.rl_example: `prompt_template` around the problem, then
    the chat template). Batch number b of a run samples with seed `seed + b`; a short last
    batch is padded with copies of its first prompt (after the real rows, so their keys are
    unchanged) so every call has `batch_prompts` rows and one compiled shape.
    """

    def __init__(self, m, prompt_template: str):
        self.m, self.template, self.k, self.seed = m, prompt_template, m.num_samples, m.seed
        self.batch_prompts, self.max_prompt_len = m.batch_prompts, m.max_prompt_len
        self.calls, self._loaded = 0, None

    def _load(self):
        if self._loaded is None:
            m = self.m
            tok = policy.resolve_tokenizer(m.tokenizer or None, m.checkpoint, m.checkpoint_step)
            mesh = shd.mesh_from_config(m.mesh.to_dict())
            model = policy.load_model(m.checkpoint, mesh, m.checkpoint_step, dtype=m.dtype)
            vocab = model.config.vocab_size
            policy.check_vocab(tok, vocab, "pass_rate.model.checkpoint")
            graphdef, state = nnx.split(model)
            pad, stop_ids = policy.special_ids(tok, vocab)
            params = SamplingParams(temperature=float(m.temperature), top_p=float(m.top_p),
                                    max_new_tokens=m.max_new_tokens, n=self.k,
                                    stop_token_ids=stop_ids)
            engine = Engine(graphdef, mesh=mesh, pad_id=pad, max_prompt_len=self.max_prompt_len,
                            slots=self.batch_prompts * self.k)
            self._loaded = (tok, engine, state, params)
        return self._loaded

    def prompt_ids(self, d: dict, domain: str) -> list[int]:
        """Token ids of the templated prompt (ValueError on a record that is no RL problem)."""
        ex, _ = rl_example(self._load()[0], R.rl_fields(d, "rl_" + domain), None, self.template)
        return [int(t) for t in ex["prompt_ids"]]

    def sample(self, prompts: list[list[int]]) -> list[list[str]]:
        """[P] prompts (P <= batch_prompts) -> [P][k] decoded responses."""
        tok, engine, state, params = self._load()
        out = engine.generate(state, prompts, params, self.seed + self.calls)
        self.calls += 1
        texts: list[list[str]] = [[] for _ in prompts]
        for i, t in zip(out.prompt_index, Sampler.decode_text(out, tok)):
            texts[int(i)].append(t)
        return texts


def pass_rate_step(scorers: Scorers, source: str, field: str, samples_field: str,
                   batch_size: int, drop_unrated: bool = True,
                   model: ModelSamples | None = None, keep_samples: bool = False) -> Batched:
    """Sets data['pass_rate'] from a record field, by scoring the record's samples, or by
    scoring `model`'s k samples (batches of model.batch_prompts records; with keep_samples
    the responses are stored in data[samples_field]). info['samples_scored'] counts the
    scored responses.

    A record that cannot be rated (no field / samples / answer / tests, or a domain without
    a checker) is dropped for that reason, or with drop_unrated=False (SFT, where only
    incorrect traces need a difficulty) kept without a pass rate and counted in info.
    """

    def from_field(r: RawRecord):
        v = r.data.get(field)
        if v is None:
            return "no_pass_rate"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise RecordError(r.path, r.line, f"field {field!r} must be a number in [0, 1], got {v!r}")
        r.data["pass_rate"] = float(v)
        return None

    def decide_batch(batch: list[RawRecord]):
        reasons = rate(batch)
        if drop_unrated:
            return reasons
        for why in filter(None, reasons):
            info[f"unrated:{why}"] = info.get(f"unrated:{why}", 0) + 1
        return [None] * len(batch)

    def rate(batch: list[RawRecord]):
        if source == "field":
            return [from_field(r) for r in batch]
        reasons: list[str | None] = [None] * len(batch)
        items, todo = [], []
        for k, r in enumerate(batch):
            dom, samples = r.data.get("domain"), r.data.get(samples_field)
            if dom not in CHECKED:
                reasons[k] = "unchecked_domain"
                continue
            if source == "model":
                ref, reasons[k] = reference(r.data, dom)
                if reasons[k]:
                    continue
                try:
                    ids = model.prompt_ids(r.data, dom)
                except ValueError as e:
                    raise RecordError(r.path, r.line, f"cannot template the problem: {e}") from None
                if len(ids) > model.max_prompt_len:
                    reasons[k] = "prompt_too_long"
                    continue
                todo.append((k, dom, ref, ids))
                continue
            if samples is None or (isinstance(samples, list) and not samples):
                reasons[k] = "no_samples"
                continue
            if not isinstance(samples, list) or not all(isinstance(s, str) for s in samples):
                raise RecordError(r.path, r.line, f"field {samples_field!r} must be a list of strings")
            ref, why = reference(r.data, dom)
            if why:
                reasons[k] = why
                continue
            items.extend((k, dom, s, ref) for s in samples)
        if todo:
            for (k, dom, ref, _), texts in zip(todo, model.sample([t[3] for t in todo])):
                items.extend((k, dom, s, ref) for s in texts)
                if keep_samples:
                    batch[k].data[samples_field] = texts
        info["samples_scored"] += len(items)
        for k, res in _score_groups(scorers, items).items():
            batch[k].data["pass_rate"] = sum(c for c, _ in res) / len(res)
            batch[k].data["pass_samples"] = len(res)
        return reasons

    step = Batched("pass_rate", decide_batch, model.batch_prompts if source == "model" else batch_size)
    info = step.counter.info
    if source != "field":
        info["samples_scored"] = 0
    return step


def retain_step(difficulty_source: str, field: str, hard_min: float, hard_max_pass_rate: float,
                keep_incorrect_hard: bool, keep_incorrect_easy: bool) -> Filter:
    """Difficulty-aware retention of incorrect traces (paper section 7).

    Correct and unlabelled traces are kept. An incorrect one is kept when its problem is
    hard and keep_incorrect_hard (or easy and keep_incorrect_easy). Hard: difficulty field
    >= hard_min ("field"), or pass_rate <= hard_max_pass_rate ("pass_rate").
    """

    def hard(d: dict) -> bool | None:
        if difficulty_source == "pass_rate":
            p = d.get("pass_rate")
            return None if p is None else p <= hard_max_pass_rate
        v = d.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return None
        return v >= hard_min

    def decide(r: RawRecord):
        if r.data.get("correct") is not False:
            return None
        h = hard(r.data)
        if h is None:
            return "incorrect_unknown_difficulty"
        if h:
            return None if keep_incorrect_hard else "incorrect_hard"
        return None if keep_incorrect_easy else "incorrect_easy"

    return Filter("retain", decide)


def min_tests_step(min_tests: int) -> Filter:
    """Code problems need at least `min_tests` test cases (the paper: 16)."""

    def decide(r: RawRecord):
        if r.data.get("domain") != "code":
            return None
        tests, why = reference(r.data, "code")
        if why:
            return why
        return None if len(tests["inputs"]) >= min_tests else "too_few_tests"

    return Filter("min_tests", decide)


def pass_band_step(lo: float, hi: float) -> Filter:
    """RL prompt filter: keep lo <= pass_rate <= hi (too easy / too hard otherwise)."""

    def decide(r: RawRecord):
        p = r.data.get("pass_rate")
        if p is None:
            return "no_pass_rate"
        if p < lo:
            return "too_hard"
        if p > hi:
            return "too_easy"
        return None

    return Filter("pass_band", decide)
