"""GPPO reinforcement learning entry point.

    python -m klear_jax.rl --config=configs/gppo_tiny.py --config.workdir=DIR \
        --config.data.dir=TFDS_DIR --config.data.name=NAME --config.data.tokenizer=TOK

One step: take P prompts; sample G responses each on the training mesh with the current
params; decode and score them (code in the sandbox pool, submitted first and collected
after the math checks); GRPO advantages per group; keep at most ``train.batch_prompts``
groups with a learning signal; recompute the old log-probs with the trainer's chunked
log-probs (the sampler's are only compared against them, as a metric); then up to K
mini-batch updates of the policy loss + alpha x NLL on max-reward responses, both
normalised by global mini-batch denominators (``klear_jax.rl_loss``).

A run restarted with the same workdir resumes from its latest checkpoint (params,
optimizer, RL step, update count, data-iterator position, RNG). Checkpoints are numbered
by RL step. SIGTERM saves at the next step boundary and exits 0. Writes DIR/metrics.jsonl
(one row per RL step), TensorBoard logs in DIR/tb and checkpoints in DIR/checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from klear_jax import checkpoint as ckpt
from klear_jax import config_utils, metrics as metrics_lib, optim, rl_config, train_step as ts
from klear_jax import rl_batch as rb
from klear_jax import rl_loss
from klear_jax import sharding as shd

log = logging.getLogger("klear_jax.rl")


# ------------------------------------------------------------------------------ scoring
class Scorers:
    """Math and code scorers, created on first use (a math-only run needs no sandbox)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._math = self._code = None

    @property
    def math(self):
        if self._math is None:
            from klear_jax.rewards import MathScorer
            self._math = MathScorer(rl_config.math_reward_config(self.cfg))
        return self._math

    @property
    def code(self):
        if self._code is None:
            from klear_jax.rewards import CodeScorer
            self._code = CodeScorer(rl_config.code_reward_config(self.cfg))
        return self._code

    def score(self, records, texts, G: int) -> np.ndarray:
        """rewards float32 [P, G]; response p*G+g answers records[p]. Code runs are
        submitted first and collected after the (blocking) math checks."""
        kinds = [record_kind(r) for r in records]
        rewards = np.zeros(len(texts), np.float32)
        code_idx = [i for i in range(len(texts)) if kinds[i // G] == "code"]
        math_idx = [i for i in range(len(texts)) if kinds[i // G] == "math"]
        fut = None
        if code_idx:
            fut = self.code.submit_batch([texts[i] for i in code_idx],
                                         [records[i // G]["tests"] for i in code_idx])
        if math_idx:
            rewards[math_idx] = self.math.score_batch([texts[i] for i in math_idx],
                                                      [records[i // G]["answer"] for i in math_idx])
        if fut is not None:
            rewards[code_idx] = fut.result()
        return rewards.reshape(len(records), G)

    def close(self):
        for s in (self._math, self._code):
            if s is not None:
                s.close()


def record_kind(rec) -> str:
    return "code" if rec.get("tests") is not None else "math"


def _name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)[:40] or "none"


def rollout_metrics(records, rewards, max_rewards, lengths, truncated, signal, kept,
                    batch_prompts: int) -> dict[str, float]:
    """Host metrics of one rollout: rewards / accuracy per kind and per record source,
    response lengths, truncation, group filtering."""
    P, G = rewards.shape
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std())}
    correct = rewards >= max_rewards[:, None] - 1e-6
    out["accuracy"] = float(correct.mean())
    groups = {}
    for p, r in enumerate(records):
        groups.setdefault(record_kind(r), []).append(p)
        if r.get("source"):
            groups.setdefault("source_" + _name(r["source"]), []).append(p)
    for g, idx in groups.items():
        out[f"reward/{g}_mean"] = float(rewards[idx].mean())
        out[f"reward/{g}_std"] = float(rewards[idx].std())
        out[f"accuracy/{g}"] = float(correct[idx].mean())
    out.update({"response/length_mean": float(np.mean(lengths)),
                "response/length_max": float(np.max(lengths)),
                "response/truncation_rate": float(np.mean(truncated)),
                "groups/signal_frac": float(np.mean(signal)),
                "groups/kept": float(len(kept)),
                "groups/kept_frac": float(len(kept)) / batch_prompts})
    return out


def mean_update_metrics(ms: list[dict]) -> dict[str, float]:
    """Averages over the step's updates; min / max / sums where those are meaningful."""
    if not ms:
        return {"train/num_updates": 0.0}
    out = {}
    for k in ms[0]:
        vals = np.asarray([m[k] for m in ms], np.float64)
        if k == "ratio_min":
            out[f"train/{k}"] = float(vals.min())
        elif k == "ratio_max":
            out[f"train/{k}"] = float(vals.max())
        elif k in ("skipped", "tokens", "sft_tokens", "batch_tokens"):
            out[f"train/{k}"] = float(vals.sum())
        elif k in ("skipped_total",):
            out[f"train/{k}"] = float(vals[-1])
        elif k == "lr":
            out["train/lr"] = float(vals[-1])
        else:
            out[f"train/{k}"] = float(vals.mean())
    out["train/grad_norm_max"] = float(max(m["grad_norm"] for m in ms))
    out["train/num_updates"] = float(len(ms))
    return out


# ------------------------------------------------------------------------------ the loop
def build_prompts(cfg, state: dict | None = None):
    import tensorflow_datasets as tfds
    from klear_jax.data.pipeline import rl_prompt_batches
    d = cfg.data
    src = tfds.data_source(d.name, data_dir=d.dir or None)[d.split]
    # prompts_per_step is global; each process gets its contiguous share of every batch
    it = rl_prompt_batches(src, cfg.rollout.prompts_per_step, seed=cfg.seed, shuffle=d.shuffle,
                           num_epochs=d.num_epochs if d.num_epochs > 0 else None,
                           max_prompt_length=cfg.rollout.max_prompt_len)
    if state:
        it.set_state(state)
    return it


def _global(bsh, mb):
    return {k: jax.make_array_from_process_local_data(bsh, np.asarray(v)) for k, v in mb.items()}


def _max_over_processes(n: int) -> int:
    if jax.process_count() == 1:
        return n
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.asarray(n))))


def run(cfg) -> dict:
    """Trains per ``cfg``; returns {"step", "updates", "stopped": "done" | "preempted" |
    "data_exhausted", "last_metrics"}."""
    from flax import nnx
    from klear_jax.data.tokenizer import load_tokenizer
    from klear_jax.sampler import Sampler, SamplingParams
    from klear_jax.sft import build_model

    shd.initialize_distributed()
    rl_config.validate_rl_config(cfg, jax.device_count())
    mesh = shd.mesh_from_config(cfg.mesh)
    tok = load_tokenizer(cfg.data.tokenizer)
    model, model_cfg = build_model(cfg, mesh)
    if len(tok) > model_cfg.vocab_size:
        raise config_utils.ConfigError("model.vocab_size", f"{model_cfg.vocab_size} is smaller "
                                       f"than the tokenizer's {len(tok)} tokens")
    ro, tr, lc = cfg.rollout, cfg.train, cfg.loss
    G, K = ro.group_size, tr.num_minibatches
    # Schedules count RL steps (verl steps its scheduler once per RL step); the optimizer
    # counts updates, up to K per step, so warmup / decay lengths are scaled by K.
    ocfg = cfg.optim.to_dict()
    ocfg.update(warmup_steps=ocfg["warmup_steps"] * K, decay_steps=ocfg["decay_steps"] * K)
    optimizer, schedule = optim.make_optimizer(ocfg, tr.total_steps * K)
    graphdef, state, shardings = ts.init_train_state(model, optimizer, mesh)
    del model
    checkpointer = ckpt.TrainCheckpointer(cfg.workdir, keep=cfg.checkpoint.keep,
                                          async_save=cfg.checkpoint.async_save)
    rng, data_state, rl_step = jax.random.key(cfg.seed), None, 0
    if checkpointer.latest_step() is not None:
        st, extra, rng = checkpointer.restore(ckpt.abstract_like(state, shardings), with_rng=True)
        rl_step, data_state = int(st.step), extra["iterator"]
        state = dataclasses.replace(st, step=jax.device_put(
            jnp.asarray(extra["updates"], jnp.int32), shardings.step))
        log.info("resumed from %s at RL step %d (%d updates)", checkpointer.dir, rl_step,
                 extra["updates"])
    data = build_prompts(cfg, data_state)

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stop_ids = tuple(sorted({i for i in (tok.eos_token_id, tok.convert_tokens_to_ids(
        "<|endoftext|>")) if isinstance(i, int) and 0 <= i < model_cfg.vocab_size}))
    sampler = Sampler(graphdef, mesh=mesh, pad_id=pad_id, max_prompt_len=ro.max_prompt_len)
    sparams = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                             repetition_penalty=ro.repetition_penalty,
                             max_new_tokens=ro.max_new_tokens, stop_token_ids=stop_ids, n=G)
    loss = rl_loss.make_rl_loss(lc.kind, lc.eps_low, lc.eps_high, lc.beta1, lc.beta2,
                                lc.dual_clip, lc.agg, lc.norm_length, lc.sft_alpha,
                                ro.temperature)
    step_fn = ts.make_train_step(graphdef, optimizer, loss.loss_fn, mesh, tr.num_microbatches,
                                 shardings, schedule=schedule, denom_fn=loss.denom_fn,
                                 loss_weights=loss.loss_weights,
                                 finalize_metrics=loss.finalize_metrics)
    logp_fn = rl_loss.make_logprob_fn(graphdef, mesh, shardings.params, ro.temperature,
                                       tr.num_microbatches)
    scorers = Scorers(cfg)
    bsh = ts.batch_sharding(mesh)
    n_proc = jax.process_count()
    mb_rows = tr.batch_prompts // K * G // n_proc
    cap = ro.max_prompt_len + ro.max_new_tokens
    # rows of steps <= rl_step (already done) are kept on resume
    writer = metrics_lib.MetricWriter(cfg.workdir, start_step=rl_step + 1)
    bar = metrics_lib.ProgressBar(tr.total_steps, rl_step)
    guard = ts.SkipGuard(tr.max_consecutive_skips)
    preempt = ckpt.PreemptionFlag()

    def save():
        extra = {"iterator": data.get_state(), "rl_step": rl_step, "updates": int(state.step)}
        # Checkpoints are numbered by RL step; the update count travels in the JSON item.
        checkpointer.save(dataclasses.replace(state, step=rl_step), data_iter=extra, rng=rng,
                          config=cfg, model_config=model_cfg)

    start, stopped, m = rl_step, "done", {}
    try:
        while rl_step < tr.total_steps:
            t_step = time.perf_counter()
            try:
                records = next(data)
            except StopIteration:
                stopped = "data_exhausted"
                log.warning("prompts exhausted after %d steps (data.num_epochs = %s)", rl_step,
                            cfg.data.num_epochs)
                break
            rng, sub = jax.random.split(rng)
            seed = int(jax.random.randint(sub, (), 0, 2**31 - 1))
            # ---- sample
            t0 = time.perf_counter()
            prompts = [r["prompt_ids"].tolist() for r in records]
            chunk = ro.sample_chunk_prompts // n_proc or len(prompts)
            outs = [sampler.generate(nnx.State(state.params), prompts[i:i + chunk], sparams,
                                     seed + i) for i in range(0, len(prompts), chunk)]
            tokens = np.concatenate([o.tokens for o in outs])
            slogp = np.concatenate([o.logprobs for o in outs])
            lengths = np.concatenate([o.lengths for o in outs])
            truncated = np.concatenate([o.truncated for o in outs])
            t_sample = time.perf_counter() - t0
            # ---- score
            t0 = time.perf_counter()
            texts = [t for o in outs for t in Sampler.decode_text(o, tok)]
            rewards = scorers.score(records, texts, G)
            t_score = time.perf_counter() - t0
            # ---- advantages, filtering, batch
            max_r = np.asarray([rl_config.max_reward(cfg, record_kind(r)) for r in records],
                               np.float32)
            adv = rb.group_advantages(rewards, lc.adv_estimator, lc.adv_use_std)
            kept, signal = rb.select_groups(rewards, tr.batch_prompts // n_proc,
                                            lc.filter_zero_adv)
            positive = rb.positive_mask(rewards, max_r)
            rows_needed = max((len(prompts[p]) + int(lengths[p * G + g])
                               for p in kept for g in range(G)), default=1)
            seq_len = rb.bucket_length(_max_over_processes(rows_needed), tr.length_bucket, cap)
            batch = rb.build_train_batch([np.asarray(p) for p in prompts], tokens, lengths,
                                         truncated, slogp, adv, positive, kept, seq_len,
                                         pad_id, lc.overlong_filter)
            mbs = rb.split_minibatches(batch, mb_rows, pad_id)
            n_upd = _max_over_processes(len(mbs))
            mbs += [rb.empty_rows(mb_rows, seq_len, pad_id) for _ in range(n_upd - len(mbs))]
            # ---- old log-probs on the pre-update params (all mini-batches first)
            t0 = time.perf_counter()
            dev_mbs, stats = [], []
            for mb in mbs:
                g = _global(bsh, mb)
                old, s = logp_fn(state.params, g)
                g.pop("sampler_logp")
                g["old_logp"] = old
                dev_mbs.append(g)
                stats.append(s)
            stats = [metrics_lib.to_floats(s) for s in stats]
            t_logp = time.perf_counter() - t0
            # ---- updates
            t0 = time.perf_counter()
            ums = []
            for g in dev_mbs:
                state, um = step_fn(state, g)
                um = metrics_lib.to_floats(um)
                if guard.update(int(state.step), int(um["skipped"])):
                    log.warning("RL step %d: update skipped (non-finite or empty), %d in a row",
                                rl_step + 1, guard.consecutive)
                ums.append(um)
            t_train = time.perf_counter() - t0
            rl_step += 1
            # ---- metrics
            m = rollout_metrics(records, rewards, max_r, lengths, truncated, signal, kept,
                                tr.batch_prompts // n_proc)
            m.update(mean_update_metrics(ums))
            ntok = sum(s["tokens"] for s in stats)
            m["entropy"] = sum(s["entropy"] for s in stats) / max(ntok, 1.0)
            m["logprob_mismatch/abs_mean"] = sum(s["mismatch_abs"] for s in stats) / max(ntok, 1.0)
            m["logprob_mismatch/kl"] = sum(s["mismatch_kl"] for s in stats) / max(ntok, 1.0)
            m["logprob_mismatch/abs_max"] = max((s["max_mismatch_abs"] for s in stats), default=0.0)
            m["rollout/positive_frac"] = float(positive.mean())
            real = float(sum(int((mb["segment_ids"] > 0).sum()) for mb in mbs)) * n_proc
            m.update({"perf/sample_tokens_per_s": float(lengths.sum()) * n_proc / t_sample,
                      "perf/train_tokens_per_s": real / t_train if t_train > 0 else 0.0,
                      "time/sample_s": t_sample, "time/score_s": t_score,
                      "time/old_logp_s": t_logp, "time/train_s": t_train,
                      "time/step_s": time.perf_counter() - t_step,
                      "train/seq_len": float(seq_len), "updates": float(int(state.step))})
            if rl_step % tr.log_every == 0 or rl_step == tr.total_steps:
                writer.write(rl_step, m)
                bar.update(rl_step, {"loss": m.get("train/loss", float("nan")),
                                     "tokens": real})
            if preempt.should_stop():
                stopped = "preempted"
                break
            if rl_step % cfg.checkpoint.every_steps == 0 and rl_step < tr.total_steps:
                save()
        if rl_step > start and checkpointer.latest_step() != rl_step:
            save()
    finally:
        checkpointer.close()
        writer.close()
        bar.close()
        preempt.restore_handlers()
        scorers.close()
    if stopped == "preempted":
        log.warning("SIGTERM: saved a checkpoint at RL step %d in %s; exiting", rl_step,
                    checkpointer.dir)
    return {"step": rl_step, "updates": int(state.step), "stopped": stopped, "last_metrics": m,
            "params": state.params}


if __name__ == "__main__":
    config_utils.run_config_cli(run, report=lambda out, cfg: log.info(
        "finished: %s", {k: out[k] for k in ("step", "updates", "stopped")}))
