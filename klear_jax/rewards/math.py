"""Math reward: the final answer after `</think>`, checked with HF math-verify.

Rewards (paper section 5, the Klear code's values; all in MathRewardConfig):
    response lacks `<think>` (only when `require_open_think`)   -> missing_open_think  (-2.0)
    response lacks `</think>`                                   -> missing_close_think (-0.5)
    answer after the last `</think>` verifies against the gold  -> correct (+1.0)
    otherwise (wrong, unparsable, checker hung or crashed)      -> wrong (-1.0)
`think_check` orders the two tag checks (a response lacking both gets the first one's
penalty): "open_first" (default: -2.0), "close_first" (the authors' reward code: -0.5), or
"none" (the official eval judge: no tag is required; the answer is the text after the last
`</think>`, or the whole response). Set `require_open_think=False` when the chat template
puts `<think>` in the prompt (Qwen3-style), so responses never contain it.

The check runs in a DeadlinePool of spawned worker processes (math-verify uses signal
alarms, which only work in a main thread), so a batch's answers are checked in parallel,
one per worker. Each check has one budget, `verify_timeout_s`, shared by parsing the gold,
parsing the answer and every comparison (math-verify's own timeouts are per call, so a
hostile answer could otherwise take several of them): a hostile answer ends inside its
worker in about that time and the worker takes the next one. A check that passes
`deadline_s` anyway (C code ignoring the alarm) is killed, its worker replaced, and it
scores `wrong`. math-verify's log lines quote the answer; workers cap them at
MAX_LOG_CHARS. `math_reward` is the one-off form; the RL loop calls `math_reward_batch`
(or `MathScorer.score_batch`) once per step.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

from klear_jax.rewards.pool import Closing, DeadlinePool, SharedPerConfig

MAX_LOG_CHARS = 300
THINK_CHECKS = ("open_first", "close_first", "none")


@dataclasses.dataclass(frozen=True)
class MathRewardConfig:
    correct: float = 1.0
    wrong: float = -1.0
    missing_close_think: float = -0.5
    missing_open_think: float = -2.0
    require_open_think: bool = True    # False when the prompt already ends with <think>
    num_workers: int = 2
    deadline_s: float = 10.0           # hard per-item limit, enforced by the parent
    verify_timeout_s: int = 5          # one item's budget inside the worker (signal alarms)
    think_check: str = "open_first"    # THINK_CHECKS: order of the tag checks, or none

    def __post_init__(self):
        check_think_check(self)


def check_think_check(cfg) -> None:
    if cfg.think_check not in THINK_CHECKS:
        raise ValueError(f"{type(cfg).__name__}.think_check must be one of {THINK_CHECKS}, "
                         f"got {cfg.think_check!r}")


def _wrap_gold(answer: str) -> str:
    s = answer.strip()
    if "\\boxed" in s or s.startswith("$") or s.startswith("\\("):
        return s
    return f"${s}$"


def verify_answer(text: str, answer: str, timeout_s: int = 5) -> bool:
    """True when the answer in `text` equals `answer` per math-verify, within one budget of
    about `timeout_s` seconds for all of it. Runs in a pool worker's main thread
    (math-verify's timeouts are signal alarms, whole seconds)."""
    from math_verify import parse, verify
    end = time.monotonic() + timeout_s

    def left() -> int:
        return max(1, math.ceil(end - time.monotonic()))

    gold = parse(_wrap_gold(answer), parsing_timeout=left())
    if not gold or time.monotonic() >= end:
        return False
    pred = parse(text, parsing_timeout=left())
    for g in gold:
        for p in pred:
            if time.monotonic() >= end:
                return False
            if verify([g], [p], timeout_seconds=left()):
                return True
    return False


class _CapMessage(logging.Filter):
    """Shortens a log record's message to MAX_LOG_CHARS (math-verify logs whole answers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if len(msg) > MAX_LOG_CHARS:
            record.msg = f"{msg[:MAX_LOG_CHARS]}... [{len(msg)} chars]"
            record.args = ()
        return True


def cap_math_verify_logs() -> None:
    """math-verify's warnings go to stderr with their text capped at MAX_LOG_CHARS."""
    log = logging.getLogger("math_verify")
    if not any(isinstance(f, _CapMessage) for h in log.handlers for f in h.filters):
        handler = logging.StreamHandler()
        handler.addFilter(_CapMessage())
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _warm_up_verify_answer() -> None:
    """Import math-verify/sympy and run one check, so a worker's first item is not slow;
    cap math-verify's log lines."""
    cap_math_verify_logs()
    verify_answer("\\boxed{\\frac{1}{2}}", "0.5")


verify_answer.worker_warm_up = _warm_up_verify_answer


def format_problem(response: str, cfg) -> tuple[float, str] | None:
    """(format penalty, what is missing) for `response`, or None when the format is fine
    (`cfg`: a MathRewardConfig or CodeRewardConfig; `think_check` orders the checks)."""
    if cfg.think_check == "none":
        return None
    checks = [(cfg.require_open_think and "<think>" not in response, cfg.missing_open_think,
               "no <think>"),
              ("</think>" not in response, cfg.missing_close_think, "no </think>")]
    if cfg.think_check == "close_first":
        checks.reverse()
    return next(((penalty, why) for missing, penalty, why in checks if missing), None)


def format_reward(response: str, cfg) -> float | None:
    """The format penalty for `response`, or None when the format is fine."""
    problem = format_problem(response, cfg)
    return None if problem is None else problem[0]


def final_answer_text(response: str) -> str:
    return response.rsplit("</think>", 1)[-1]


class MathScorer(Closing):
    """Owns a worker pool; `score_batch` is thread-safe. Close it (or use `with`)."""

    def __init__(self, cfg: MathRewardConfig | None = None):
        self.cfg = cfg or MathRewardConfig()
        self.pool = DeadlinePool("klear_jax.rewards.math:verify_answer",
                                 num_workers=self.cfg.num_workers, deadline_s=self.cfg.deadline_s)

    def score_batch(self, responses: list[str], answers: list[str]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"math score_batch: {len(responses)} responses but "
                             f"{len(answers)} answers")
        cfg = self.cfg
        rewards: list[float | None] = [format_reward(r, cfg) for r in responses]
        todo = [i for i, r in enumerate(rewards) if r is None]
        items = [(final_answer_text(responses[i]), str(answers[i]), cfg.verify_timeout_s)
                 for i in todo]
        ok = self.pool.map(items, default=False)
        for i, good in zip(todo, ok):
            rewards[i] = cfg.correct if good else cfg.wrong
        return rewards

    def close(self) -> None:
        self.pool.close()


_shared = SharedPerConfig(MathScorer, MathRewardConfig)


def math_reward_batch(responses: list[str], answers: list[str],
                      cfg: MathRewardConfig | None = None) -> list[float]:
    """Rewards for a batch, scored concurrently by a shared per-config pool."""
    return _shared.get(cfg).score_batch(list(responses), list(answers))


def math_reward(response: str, answer: str, cfg: MathRewardConfig | None = None) -> float:
    """+1 / -1 for the answer after `</think>`, or the format penalty (see module doc)."""
    return math_reward_batch([response], [answer], cfg)[0]
