"""The GPPO loop, one RL step as named phases:

    rollout            P prompts x G responses from the rollout engine (``klear_jax.engine``)
                       on the training mesh with the current params; each chunk's finished
                       responses are submitted for scoring while decoding goes on
                       (``rollout.overlap_scoring``; ``klear_jax.rl.rollout``)
    score              wait for the scores still running (all of them when not overlapped:
                       decode-then-score); group advantages
    build_minibatches  group advantages; keep at most ``train.batch_prompts`` groups with a
                       learning signal; the rows, split into K mini-batches
    old_logprobs       the trainer's chunked log-probs on the pre-update params (the
                       sampler's are compared against them, as a metric)
    update             K train steps of the policy loss + alpha x NLL on max-reward responses
    log                host metrics of the step

A run restarted with the same workdir resumes from its latest checkpoint (params,
optimizer, RL step, update count, data-iterator position, RNG); checkpoints are numbered by
RL step. See ``klear_jax.rl`` for the command line.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds
from flax import nnx

from klear_jax import config as C
from klear_jax import metrics as metrics_lib
from klear_jax import policy
from klear_jax import sharding as shd
from klear_jax import train_step as ts
from klear_jax.data.pipeline import decode_rl_example, rl_prompt_batches
from klear_jax.data.tokenizer import load_tokenizer
from klear_jax.engine import Engine, gather_shares, process_share
from klear_jax.rewards.scorers import Scorers
from klear_jax.rl import batch as rb
from klear_jax.rl import metrics as rm
from klear_jax.rl.config import validate_rl_config
from klear_jax.rl.rollout import GroupScoring, Rollout
from klear_jax.rl.step import (build_logprob_fn, build_rl_step, build_rollout_cast,
                               minibatch_rows, rl_optimizer, verl_rows_per_device)
from klear_jax.sampler import Sampler, SamplingParams
from klear_jax.trainer import Trainer


def has_code_prompts(src, probe: int = 256) -> bool:
    """Whether any of ~``probe`` records spread over ``src`` carries tests (a code prompt)."""
    n = len(src)
    return any(rm.record_kind(decode_rl_example(src[i])) == "code"
               for i in range(0, n, max(1, n // probe)))


def build_prompts(cfg, state: dict | None = None):
    """(every global batch of prompts (prompts_per_step), positioned at ``state`` when
    resuming; whether the prompts include code). Every process reads the whole batch: the
    engine decodes all of it on every process, each scores its ``process_share``."""
    d = cfg.data
    P = cfg.rollout.prompts_per_step
    src = tfds.data_source(d.name, data_dir=d.dir or None)[d.split]
    it = rl_prompt_batches(src, P, seed=cfg.seed, shuffle=d.shuffle,
                           num_epochs=d.num_epochs if d.num_epochs > 0 else None,
                           max_prompt_length=cfg.rollout.max_prompt_len, rows=range(P))
    if state:
        it.set_state(state)
    return it, has_code_prompts(src)


class RLStep:
    """Everything an RL step needs, built once per run; each phase is a method."""

    def __init__(self, cfg, mesh, graphdef, optimizer, schedule, shardings, tok, model_cfg):
        ro, tr = cfg.rollout, cfg.train
        self.cfg, self.mesh, self.tok = cfg, mesh, tok
        self.G = ro.group_size
        self.pad_id, stop_ids = policy.special_ids(tok, model_cfg.vocab_size)
        self.engine = Engine(graphdef, mesh=mesh, pad_id=self.pad_id,
                             max_prompt_len=ro.max_prompt_len,
                             slots=ro.decode_slots or ro.prompts_per_step * ro.group_size,
                             chunk=ro.decode_chunk, tokenizer=tok)
        self.sparams = SamplingParams(temperature=ro.temperature, top_p=ro.top_p,
                                      top_k=ro.top_k, repetition_penalty=ro.repetition_penalty,
                                      max_new_tokens=ro.max_new_tokens, stop_token_ids=stop_ids,
                                      n=self.G)
        self.cast = build_rollout_cast(cfg, model_cfg, shardings)  # bf16 rollouts
        self.step_fn = build_rl_step(cfg, graphdef, optimizer, schedule, mesh, shardings)
        self.logp_fn = build_logprob_fn(cfg, graphdef, mesh, shardings)
        self.scorers = Scorers(C.math_reward_config(cfg), C.code_reward_config(cfg))
        self.bsh = ts.batch_sharding(mesh)
        self.mb_rows = minibatch_rows(cfg)
        self.verl_rows = verl_rows_per_device(cfg)
        self.batch_prompts = tr.batch_prompts
        self.cap = ro.max_prompt_len + ro.max_new_tokens

    def _scoring(self, records) -> GroupScoring:
        """Scoring of ``records`` (this process's share) with their group advantages."""
        lc = self.cfg.loss
        return GroupScoring(self.scorers, records, self.G, self.tok, lc.adv_estimator,
                            lc.adv_use_std)

    # ------------------------------------------------------------------ phases
    def rollout(self, params, records, seed: int) -> tuple[Rollout, GroupScoring | None]:
        """The responses to every prompt of the global batch (every process decodes all of
        them), and (overlapped scoring) the scores of this process's share in flight."""
        t0 = time.perf_counter()
        prompts = [r["prompt_ids"].tolist() for r in records]
        own = process_share(len(records))
        scoring = (self._scoring(records[own.start:own.stop])
                   if self.cfg.rollout.overlap_scoring else None)
        lo, hi = own.start * self.G, own.stop * self.G

        def mine(finished):  # score this process's samples, indexed within its share
            scoring.add([dataclasses.replace(f, index=f.index - lo,
                                             prompt_index=f.prompt_index - own.start)
                         for f in finished if lo <= f.index < hi])
        weights = self.cast(params) if self.cast is not None else params  # freed after
        out = self.engine.generate(nnx.State(weights), prompts, self.sparams, seed,
                                   on_finish=mine if scoring else None)
        del weights
        rows = slice(lo, hi)
        texts = Sampler.decode_text(dataclasses.replace(out, tokens=out.tokens[rows],
                                                        lengths=out.lengths[rows]), self.tok)
        return Rollout(records, prompts, out.tokens, out.logprobs, out.lengths, out.truncated,
                       own, texts, time.perf_counter() - t0), scoring

    def score(self, ro: Rollout, scoring: GroupScoring | None):
        """(rewards, correct, advantages), each [P, G] over the global batch: this process
        scores its share (group advantages as its groups complete), then the shares of all
        processes are put together."""
        if scoring is None:
            scoring = self._scoring(ro.records[ro.own.start:ro.own.stop])
            scoring.submit(range(len(ro.texts)), ro.texts)
        return gather_shares(scoring.result(), len(ro.records))

    def build_minibatches(self, ro: Rollout, adv, rewards, correct):
        """(global host mini-batches, kept group indices, has-signal mask [P], row length),
        the same on every process (each device later takes its rows).

        ``train.partial_minibatch = "drop"`` keeps whole mini-batches of groups only;
        ``loss.normalize = "microbatch"`` adds each mini-batch's verl scales."""
        lc, G = self.cfg.loss, self.G
        kept, signal = rb.select_groups(rewards, self.batch_prompts, lc.filter_zero_adv,
                                        correct=correct if lc.filter_by == "correct" else None)
        if self.cfg.train.partial_minibatch == "drop":
            kept = kept[:len(kept) // (self.mb_rows // G) * (self.mb_rows // G)]
        needed = max((len(ro.prompts[p]) + int(ro.lengths[p * G + g])
                      for p in kept for g in range(G)), default=1)
        seq_len = rb.bucket_length(needed, self.cfg.train.length_bucket, self.cap)
        batch = rb.build_train_batch([np.asarray(p) for p in ro.prompts], ro.tokens, ro.lengths,
                                     ro.truncated, ro.logprobs, adv, correct, kept, seq_len,
                                     self.pad_id, lc.overlong_filter)
        mbs = rb.split_minibatches(batch, self.mb_rows, self.pad_id)
        if lc.normalize == "microbatch":
            for mb in mbs:
                mb["pg_scale"], mb["sft_scale"] = rb.verl_microbatch_scales(
                    mb, self.verl_rows, self.cap)
        return mbs, kept, signal, seq_len

    def old_logprobs(self, params, mbs):
        """Device mini-batches with ``old_logp`` from the pre-update params, and the passes'
        stats (all mini-batches first: every update of the step ratios against them)."""
        dev_mbs, stats = [], []
        for mb in mbs:
            g = {k: jax.device_put(np.asarray(v), self.bsh) for k, v in mb.items()}
            old, s = self.logp_fn(params, g)
            g.pop("sampler_logp")
            g["old_logp"] = old
            dev_mbs.append(g)
            stats.append(s)
        return dev_mbs, [metrics_lib.to_floats(s) for s in stats]

    def update(self, state, dev_mbs, trainer: Trainer, rl_step: int):
        ums = []
        for g in dev_mbs:
            state, um = self.step_fn(state, g)
            um = metrics_lib.to_floats(um)
            trainer.check_skipped(rl_step, um["skipped"])
            ums.append(um)
        return state, ums

    def close(self):
        self.scorers.close()


def run(cfg) -> dict:
    """Trains per ``cfg``; returns {"step", "updates", "stopped": "done" | "preempted" |
    "data_exhausted", "last_metrics", "params"}."""
    shd.initialize_distributed()
    validate_rl_config(cfg, jax.device_count())
    mesh = shd.mesh_from_config(cfg.mesh)
    tok = load_tokenizer(cfg.data.tokenizer)
    tr = cfg.train
    optimizer, schedule = rl_optimizer(cfg)
    with Trainer(cfg, tr.total_steps) as t:
        model_cfg, graphdef, state, shardings, extra = t.initial_state(optimizer, mesh)
        rng, data_state, rl_step = jax.random.key(cfg.seed), None, 0
        if extra is not None:
            if "rng" not in extra:  # saved before the key moved into the JSON item
                _, _, rng = t.restore(t.abstract_state, with_rng=True)
            else:
                rng = jax.random.wrap_key_data(np.asarray(extra["rng"], np.uint32))
            # Checkpoints are numbered by RL step; the update count travels in the JSON item.
            rl_step, data_state = int(state.step), extra["iterator"]
            state = dataclasses.replace(state, step=jax.device_put(
                jnp.asarray(extra["updates"], jnp.int32), shardings.step))
        policy.check_vocab(tok, model_cfg.vocab_size)
        data, has_code = build_prompts(cfg, data_state)
        steps = RLStep(cfg, mesh, graphdef, optimizer, schedule, shardings, tok, model_cfg)
        if has_code:  # the sandbox's containment check (SandboxUnavailable) before any work
            steps.scorers.code

        def save():
            # The key in the JSON item, not as an array item: an array saved by N processes
            # restores only onto N processes without a target sharding.
            extra = {"iterator": data.get_state(), "rl_step": rl_step, "updates": int(state.step),
                     "rng": np.asarray(jax.random.key_data(rng)).tolist()}
            t.checkpointer.save(dataclasses.replace(state, step=rl_step), data_iter=extra,
                                config=cfg, model_config=model_cfg)

        t.start(rl_step)
        m = {}
        try:
            while rl_step < tr.total_steps:
                t_step = time.perf_counter()
                try:
                    records = next(data)
                except StopIteration:
                    t.data_exhausted(rl_step, "prompts")
                    break
                rng, sub = jax.random.split(rng)
                seed = int(jax.random.randint(sub, (), 0, 2**31 - 1))
                ro, scoring = steps.rollout(state.params, records, seed)
                t0 = time.perf_counter()
                rewards, correct, adv = steps.score(ro, scoring)
                t_score = time.perf_counter() - t0
                mbs, kept, signal, seq_len = steps.build_minibatches(ro, adv, rewards, correct)
                t0 = time.perf_counter()
                dev_mbs, stats = steps.old_logprobs(state.params, mbs)
                t_logp = time.perf_counter() - t0
                t0 = time.perf_counter()
                state, ums = steps.update(state, dev_mbs, t, rl_step + 1)
                t_train = time.perf_counter() - t0
                rl_step += 1
                # ---- log
                m = rm.rollout_metrics(records, rewards, correct, ro.lengths, ro.truncated,
                                       signal, kept, steps.batch_prompts)
                m.update(rm.mean_update_metrics(ums))
                m.update(rm.logprob_metrics(stats))
                m["rollout/positive_frac"] = float(correct.mean())
                real = float(sum(int((mb["segment_ids"] > 0).sum()) for mb in mbs))
                m.update({"perf/sample_tokens_per_s": float(ro.lengths.sum()) / ro.seconds,
                          "perf/train_tokens_per_s": real / t_train if t_train > 0 else 0.0,
                          "time/sample_s": ro.seconds, "time/score_s": t_score,
                          "time/old_logp_s": t_logp, "time/train_s": t_train,
                          "time/step_s": time.perf_counter() - t_step,
                          "train/seq_len": float(seq_len), "updates": float(int(state.step))})
                if t.end_of_step(rl_step, m, save, {"loss": m.get("train/loss", float("nan")),
                                                    "tokens": real}):
                    break
            t.finish(rl_step, save)
        finally:
            steps.close()
    return {"step": rl_step, "updates": int(state.step), "stopped": t.stopped,
            "last_metrics": m, "params": state.params}
