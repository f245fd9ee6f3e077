"""One front for the math and code scorers, shared by RL, evaluation and curation.

    scorers = Scorers(MathRewardConfig(), CodeRewardConfig())
    pending = scorers.submit("code", responses, tests)   # starts scoring in the background
    scored = scorers.score(kinds, responses, refs)         # a mixed batch, code overlapping math
    scored.rewards, scored.correct, scored.pass_rate       # [N] each
    scorers.close()

Each scorer is created on first use (a math-only run needs no sandbox). ``refs`` are the
gold answers (math) or the test dicts (code). A response is *correct* when it earns its
kind's full reward (``max_reward``): math verifies; code passes every test it ran.
``pass_rate`` is the soft pass rate for code (the fraction of tests passed, 0 for a format
failure; read from the reward, so only in code mode "soft", which eval and curation use)
and 0/1 correctness for math.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from klear_jax.rewards.code import CodeRewardConfig, CodeScorer
from klear_jax.rewards.math import MathRewardConfig, MathScorer

KINDS = ("math", "code")
_ATOL = 1e-6


@dataclasses.dataclass
class Scored:
    """Per-response results, each [N]."""
    rewards: np.ndarray      # float32
    correct: np.ndarray      # bool
    pass_rate: np.ndarray    # float32


class Pending:
    """A batch being scored: ``done()`` polls, calling it returns the ``Scored`` (blocks)."""

    def __init__(self, kind: str, future: cf.Future | None, finish: Callable[[Any], Scored]):
        self.kind, self._future, self._finish = kind, future, finish

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def __call__(self) -> Scored:
        return self._finish(None if self._future is None else self._future.result())


class Scorers:
    """See the module docstring."""

    def __init__(self, math_cfg: MathRewardConfig | None = None,
                 code_cfg: CodeRewardConfig | None = None):
        self.math_cfg = math_cfg or MathRewardConfig()
        self.code_cfg = code_cfg or CodeRewardConfig()
        self._math: MathScorer | None = None
        self._code: CodeScorer | None = None
        self._math_bg: cf.ThreadPoolExecutor | None = None  # math batches, one at a time

    @property
    def math(self) -> MathScorer:
        if self._math is None:
            self._math = MathScorer(self.math_cfg)
        return self._math

    @property
    def code(self) -> CodeScorer:
        if self._code is None:
            self._code = CodeScorer(self.code_cfg)
        return self._code

    def max_reward(self, kind: str) -> float:
        """The highest reward a response of ``kind`` can get (math ``correct``; code 1.0)."""
        return float(self.math_cfg.correct) if kind == "math" else 1.0

    def _scored(self, kind: str, rewards) -> Scored:
        r = np.asarray(rewards, np.float32)
        ok = r >= self.max_reward(kind) - _ATOL
        rate = np.maximum(r, 0.0) if kind == "code" else ok.astype(np.float32)
        return Scored(r, ok, rate.astype(np.float32))

    def submit(self, kind: str, responses: Sequence[str], refs: Sequence[Any]) -> Pending:
        """Starts scoring ``responses`` of one kind; returns a callable giving the result
        (it blocks until then). Both kinds run in the background: code in the sandbox pool,
        math in the math-verify pool (its batches one after another), so a caller can keep
        decoding meanwhile (the rollout engine's overlapped scoring)."""
        if kind not in KINDS:
            raise ValueError(f"Scorers: unknown kind {kind!r}; allowed {KINDS}")
        if not responses:
            return Pending(kind, None, lambda _: self._scored(kind, []))
        if kind == "code":
            fut = self.code.submit_batch(list(responses), list(refs))
        else:
            if self._math_bg is None:
                self._math_bg = cf.ThreadPoolExecutor(1, thread_name_prefix="math-batch")
            fut = self._math_bg.submit(self.math.score_batch, list(responses),
                                       [str(a) for a in refs])
        return Pending(kind, fut, lambda r: self._scored(kind, r))

    def score(self, kinds: Sequence[str], responses: Sequence[str], refs: Sequence[Any]) -> Scored:
        """Scores a batch of mixed kinds (``kinds[i]`` of ``responses[i]``): code programs
        are submitted first and collected after the math checks."""
        n = len(responses)
        out = Scored(np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, np.float32))
        order = sorted(KINDS, key=lambda k: k != "code")  # code first: it runs in the background
        pending = []
        for kind in order:
            idx = [i for i in range(n) if kinds[i] == kind]
            if idx:
                pending.append((idx, self.submit(kind, [responses[i] for i in idx],
                                                 [refs[i] for i in idx])))
        for idx, result in pending:
            s = result()
            out.rewards[idx], out.correct[idx], out.pass_rate[idx] = s.rewards, s.correct, s.pass_rate
        return out

    def close(self) -> None:
        if self._math_bg is not None:
            self._math_bg.shutdown(wait=True)
            self._math_bg = None
        for s in (self._math, self._code):
            if s is not None:
                s.close()
        self._math = self._code = None
