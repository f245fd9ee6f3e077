"""One front for the math and code scorers, shared by RL, evaluation and curation.

    scorers = Scorers(MathRewardConfig(), CodeRewardConfig())
    pending = scorers.submit("code", responses, tests)   # starts the sandboxed runs
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


class Scorers:
    """See the module docstring."""

    def __init__(self, math_cfg: MathRewardConfig | None = None,
                 code_cfg: CodeRewardConfig | None = None):
        self.math_cfg = math_cfg or MathRewardConfig()
        self.code_cfg = code_cfg or CodeRewardConfig()
        self._math: MathScorer | None = None
        self._code: CodeScorer | None = None

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

    def submit(self, kind: str, responses: Sequence[str], refs: Sequence[Any]
               ) -> Callable[[], Scored]:
        """Starts scoring ``responses`` of one kind; returns a callable giving the result.
        Code runs in the sandbox pool in the background; math is checked now."""
        if kind not in KINDS:
            raise ValueError(f"Scorers: unknown kind {kind!r}; allowed {KINDS}")
        if not responses:
            empty = self._scored(kind, [])
            return lambda: empty
        if kind == "code":
            fut = self.code.submit_batch(list(responses), list(refs))
            return lambda: self._scored("code", fut.result())
        done = self._scored("math", self.math.score_batch(list(responses),
                                                          [str(a) for a in refs]))
        return lambda: done

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
        for s in (self._math, self._code):
            if s is not None:
                s.close()
        self._math = self._code = None
