"""The RL step's rollout: G responses per prompt from the rollout engine, scored while the
engine keeps decoding.

    scoring = GroupScoring(scorers, records, G, tokenizer, adv_estimator, adv_use_std)
    out = engine.generate(state, prompts, params, seed, on_finish=scoring.add)
    rewards, correct, advantages = scoring.result()

``add`` gets each chunk's finished samples (response p * G + g answers records[p]): it
decodes their text and submits them to ``Scorers`` in one batch per kind (code to the
sandbox pool, math to the math-verify pool, both in the background) and returns at once, so
scoring overlaps the next decode chunk. ``poll`` (called by ``add``) collects what is done;
a group's advantages are computed as soon as its G rewards are in. ``result`` waits for the
rest: after the last chunk only the slowest scores remain, instead of all of them
(decode-then-score, ``overlap=False`` in the loop, for comparison).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from klear_jax.rewards.scorers import Scorers
from klear_jax.rl import batch as rb
from klear_jax.rl import metrics as rm


@dataclasses.dataclass
class Rollout:
    """G responses to each of the P prompts of the global batch (every process holds all of
    them); response p * G + g answers p. This process scores the prompts ``own``."""
    records: list[dict]
    prompts: list[list[int]]
    tokens: np.ndarray       # int32 [P*G, M]
    logprobs: np.ndarray     # float32 [P*G, M] the sampler's
    lengths: np.ndarray      # int32 [P*G]
    truncated: np.ndarray    # bool [P*G]
    own: range               # this process's prompts (engine.process_share)
    texts: list[str]         # the responses to its own prompts, in order
    seconds: float


def record_ref(record: dict) -> tuple[str, object]:
    """(kind, reference): code when the record has tests (the tests), else math (the answer)."""
    kind = rm.record_kind(record)
    return kind, record["tests"] if kind == "code" else record["answer"]


class GroupScoring:
    """See the module docstring. Shapes: P = len(records) groups of G responses."""

    def __init__(self, scorers: Scorers, records: list[dict], G: int, tokenizer,
                 estimator: str = "grpo", use_std: bool = True):
        self.scorers, self.records, self.G, self.tok = scorers, records, G, tokenizer
        self.estimator, self.use_std = estimator, use_std
        P = len(records)
        self.rewards = np.full((P, G), np.nan, np.float32)
        self.correct = np.zeros((P, G), bool)
        self.advantages = np.full((P, G), np.nan, np.float32)
        self.texts: dict[int, str] = {}
        self._pending: list[tuple[list[int], object]] = []
        self.groups_done = 0

    def add(self, finished) -> None:
        """The engine's ``on_finish``: submits ``finished`` (``engine.Finished`` samples) for
        scoring and returns at once."""
        self.submit([f.index for f in finished],
                    [self.tok.decode(f.tokens.tolist(), skip_special_tokens=True)
                     for f in finished])

    def submit(self, indices, texts) -> None:
        """Submits responses ``texts`` (response i answers records[i // G]), one batch per
        kind; returns at once."""
        by_kind: dict[str, list] = {}
        for i, text in zip(indices, texts):
            self.texts[i] = text
            kind, ref = record_ref(self.records[i // self.G])
            by_kind.setdefault(kind, []).append((i, text, ref))
        for kind, items in by_kind.items():
            idx, texts, refs = map(list, zip(*items))
            self._pending.append((idx, self.scorers.submit(kind, texts, refs)))
        self.poll()

    def poll(self, wait: bool = False) -> None:
        """Collects finished scores (all of them with ``wait``); computes the advantages of
        every group whose G rewards are in."""
        still = []
        for idx, pending in self._pending:
            if not wait and not pending.done():
                still.append((idx, pending))
                continue
            s = pending()
            for k, i in enumerate(idx):
                self.rewards[i // self.G, i % self.G] = s.rewards[k]
                self.correct[i // self.G, i % self.G] = s.correct[k]
        self._pending = still
        ready = ~np.isnan(self.rewards).any(1) & np.isnan(self.advantages).any(1)
        for p in np.nonzero(ready)[0]:
            self.advantages[p] = rb.group_advantages(self.rewards[p:p + 1], self.estimator,
                                                     self.use_std)[0]
            self.groups_done += 1

    def result(self):
        """(rewards float32 [P, G], correct bool [P, G], advantages float32 [P, G]) once every
        response is scored (blocks for the rest)."""
        self.poll(wait=True)
        if np.isnan(self.rewards).any():
            raise RuntimeError(f"GroupScoring: {int(np.isnan(self.rewards).sum())} responses "
                               "were never submitted")
        return self.rewards, self.correct, self.advantages
