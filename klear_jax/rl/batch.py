"""Host-side pieces of an RL step: group-relative advantages, group selection, the train
batch and its mini-batches.

Responses arrive flat, N = P * G, response ``p * G + g`` being the g-th sample of prompt p
(the sampler keeps a prompt's responses contiguous). Rewards are [P, G]. The advantage and
filter functions work on numpy arrays (returning numpy) and on JAX arrays, also under jit.

RL batch layout, one row per kept response (rows of a group contiguous), all [R, T]:

    input_ids    int32   prompt ++ response[:length], right-padded with pad_id
    targets      int32   next token (input_ids shifted left; 0 past the end)
    loss_mask    float32 1 where the target is a response token (positions Lp-1 .. Lp+Lr-2),
                         0 for prompt targets, padding and (overlong filter) truncated rows
    segment_ids  int32   1 on real tokens, 0 on padding (attention ignores padding)
    advantages   float32 [R] the response's group-relative advantage
    positive     float32 [R] 1 if the response got the maximum possible reward (SFT term)
    sampler_logp float32 the sampler's log-prob of each target response token (0 elsewhere)

Empty padding rows (mini-batch fill) are all zero with input_ids = pad_id: they add nothing
to any loss sum or denominator.

With ``loss.normalize = "microbatch"`` (the authors' verl run, :func:`verl_microbatch_scales`)
each mini-batch also carries, [R] float32:

    pg_scale   n_m / T_m: rows / response tokens of the emulated verl micro-batch m holding
               the row (0 for padding)
    sft_scale  n_m / P_m for a positive row (P_m: positive response tokens in m), else 0
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

KEYS_2D = ("input_ids", "targets", "loss_mask", "segment_ids", "sampler_logp")
KEYS_1D = ("advantages", "positive")


def round_up(n: int, m: int) -> int:
    return -(-int(n) // int(m)) * int(m)


def bucket_length(needed: int, bucket: int, cap: int) -> int:
    """Row length T: ``needed`` rounded up to a multiple of ``bucket``, at most ``cap``;
    bucket 0 = always ``cap`` (a single compiled shape)."""
    if needed > cap:
        raise ValueError(f"rl.batch: a row needs {needed} tokens, more than the cap {cap} "
                         "(rollout.max_prompt_len + rollout.max_new_tokens)")
    return cap if bucket <= 0 else min(round_up(max(needed, 1), bucket), cap)


def _xp_rewards(rewards, name: str):
    xp = jnp if isinstance(rewards, jax.Array) else np
    r = xp.asarray(rewards)
    if r.ndim != 2:
        raise ValueError(f"rl.batch.{name}: rewards must be [P, G] (prompts x group), got shape {r.shape}")
    if not xp.issubdtype(r.dtype, xp.floating):
        r = r.astype(xp.float32)
    return xp, r


def grpo_advantages(rewards, eps: float = 1e-6, use_std: bool = True):
    """GRPO: (R - group mean) / (unbiased group std + eps); use_std=False drops the division
    (Dr.GRPO). rewards [P, G] with G >= 2 -> advantages [P, G]."""
    xp, r = _xp_rewards(rewards, "grpo_advantages")
    if r.shape[1] < 2:
        raise ValueError(f"rl.batch.grpo_advantages: need G >= 2 responses per prompt for a "
                         f"group baseline / unbiased std, got rewards shape {r.shape}")
    centred = r - xp.mean(r, axis=1, keepdims=True)
    if not use_std:
        return centred
    return centred / (xp.std(r, axis=1, ddof=1, keepdims=True) + eps)


def rloo_advantages(rewards):
    """RLOO: R_i minus the mean of the other G-1 rewards of its group = G/(G-1) (R_i - mean).
    rewards [P, G] with G >= 2 -> advantages [P, G]."""
    xp, r = _xp_rewards(rewards, "rloo_advantages")
    g = r.shape[1]
    if g < 2:
        raise ValueError(f"rl.batch.rloo_advantages: need G >= 2, got rewards shape {r.shape}")
    loo_mean = (xp.sum(r, axis=1, keepdims=True) - r) / (g - 1)
    return r - loo_mean


def group_filter_mask(rewards, atol: float = 0.0):
    """bool [P]: True for groups whose rewards are not all equal (within atol), i.e. groups
    that carry a learning signal; all-right / all-wrong groups are False."""
    xp, r = _xp_rewards(rewards, "group_filter_mask")
    return (xp.max(r, axis=1) - xp.min(r, axis=1)) > atol


def group_advantages(rewards, estimator: str = "grpo", use_std: bool = True) -> np.ndarray:
    """[P, G] rewards -> [P, G] float32 advantages ("grpo" or "rloo")."""
    r = np.asarray(rewards, np.float32)
    if estimator == "grpo":
        a = grpo_advantages(r, use_std=use_std)
    elif estimator == "rloo":
        a = rloo_advantages(r)
    else:
        raise ValueError(f"rl.batch: unknown advantage estimator {estimator!r} (grpo, rloo)")
    return np.asarray(a, np.float32)


def mixed_correct_mask(correct) -> np.ndarray:
    """bool [P]: the group holds a response with the full reward and one without (the
    authors' filter: std of per-response accuracy > 0). correct: bool [P, G]."""
    c = np.asarray(correct, bool)
    return c.any(axis=1) & ~c.all(axis=1)


def select_groups(rewards, batch_prompts: int, filter_zero_adv: bool = True,
                  atol: float = 1e-6, correct=None) -> tuple[np.ndarray, np.ndarray]:
    """(kept prompt indices int [k] in sampling order, has_signal bool [P]).

    A group has a signal when its rewards differ (beyond ``atol``: the paper's text), or,
    given ``correct`` [P, G], when its full correctness is mixed (:func:`mixed_correct_mask`,
    the authors' code: it also drops code groups with partial passes but no full pass and
    math groups differing only by a format penalty). With ``filter_zero_adv`` only groups
    with a signal are candidates; at most ``batch_prompts`` of them are kept (over-generation
    cap). Nothing is padded in: with too few candidates the batch shrinks.
    """
    signal = (np.asarray(group_filter_mask(np.asarray(rewards, np.float32), atol))
              if correct is None else mixed_correct_mask(correct))
    cand = np.nonzero(signal)[0] if filter_zero_adv else np.arange(signal.shape[0])
    return cand[:batch_prompts], signal


def build_rows(prompts: Sequence[np.ndarray], responses: np.ndarray, lengths,
               seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Rows prompt_r ++ responses[r, :lengths[r]], right-padded to ``seq_len``.

    prompts: R int arrays; responses int [R, Tn]; lengths int [R]. Returns input_ids,
    targets, loss_mask, segment_ids, each [R, seq_len] (see the module docstring)."""
    R = len(prompts)
    responses = np.asarray(responses)
    lengths = np.asarray(lengths, np.int64)
    if responses.shape[0] != R or lengths.shape != (R,):
        raise ValueError(f"rl.batch.build_rows: {R} prompts but responses {responses.shape} "
                         f"and lengths {lengths.shape}")
    ids = np.full((R, seq_len), pad_id, np.int32)
    tgt = np.zeros((R, seq_len), np.int32)
    mask = np.zeros((R, seq_len), np.float32)
    seg = np.zeros((R, seq_len), np.int32)
    for r in range(R):
        p = np.asarray(prompts[r], np.int32)
        lp, lr = len(p), int(lengths[r])
        if lp == 0:
            raise ValueError(f"rl.batch.build_rows: row {r} has an empty prompt")
        if not 0 <= lr <= responses.shape[1]:
            raise ValueError(f"rl.batch.build_rows: row {r} length {lr} outside "
                             f"[0, {responses.shape[1]}]")
        n = lp + lr
        if n > seq_len:
            raise ValueError(f"rl.batch.build_rows: row {r} has {n} tokens > seq_len {seq_len}")
        seq = np.concatenate([p, responses[r, :lr].astype(np.int32)])
        ids[r, :n] = seq
        tgt[r, :n - 1] = seq[1:]
        mask[r, lp - 1:n - 1] = 1.0
        seg[r, :n] = 1
    return {"input_ids": ids, "targets": tgt, "loss_mask": mask, "segment_ids": seg}


def scatter_response_values(values: np.ndarray, prompt_lens, lengths, seq_len: int) -> np.ndarray:
    """Per-response-token values [R, Tn] (e.g. the sampler's log-probs) -> [R, seq_len] at
    the positions whose target is that token (Lp - 1 + i), 0 elsewhere."""
    values = np.asarray(values, np.float32)
    out = np.zeros((values.shape[0], seq_len), np.float32)
    for r, (lp, lr) in enumerate(zip(prompt_lens, lengths)):
        out[r, lp - 1:lp - 1 + lr] = values[r, :lr]
    return out


def build_train_batch(prompts: Sequence[np.ndarray], tokens, lengths, truncated, sampler_logp,
                      advantages, positive, kept, seq_len: int, pad_id: int,
                      overlong_filter: bool = False) -> dict[str, np.ndarray]:
    """The RL batch for the kept groups: R = len(kept) * G rows (module docstring layout).

    prompts: P int arrays; tokens / sampler_logp [P*G, Tn]; lengths, truncated [P*G];
    advantages, positive [P, G]; kept int [k] prompt indices.
    """
    P, G = np.asarray(advantages).shape
    tokens = np.asarray(tokens)
    if tokens.shape[0] != P * G:
        raise ValueError(f"rl.batch: {tokens.shape[0]} responses but advantages are [{P}, {G}]")
    kept = np.asarray(kept, np.int64)
    rows = (kept[:, None] * G + np.arange(G)[None, :]).reshape(-1)
    lengths = np.asarray(lengths, np.int64)[rows]
    row_prompts = [prompts[i // G] for i in rows]
    out = build_rows(row_prompts, tokens[rows], lengths, seq_len, pad_id)
    if overlong_filter:
        out["loss_mask"] *= ~np.asarray(truncated, bool)[rows, None]
    out["sampler_logp"] = scatter_response_values(
        np.asarray(sampler_logp)[rows], [len(p) for p in row_prompts], lengths, seq_len)
    out["advantages"] = np.asarray(advantages, np.float32).reshape(-1)[rows]
    out["positive"] = np.asarray(positive, np.float32).reshape(-1)[rows]
    return out


def empty_rows(n: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    out = {k: np.zeros((n, seq_len), np.float32 if k in ("loss_mask", "sampler_logp") else np.int32)
           for k in KEYS_2D}
    out["input_ids"][:] = pad_id
    out.update({k: np.zeros((n,), np.float32) for k in KEYS_1D})
    return out


def split_minibatches(batch: dict[str, np.ndarray], rows_per_minibatch: int, pad_id: int
                      ) -> list[dict[str, np.ndarray]]:
    """Consecutive mini-batches of ``rows_per_minibatch`` rows; the last one is filled up
    with empty rows. An empty batch gives no mini-batches."""
    R = batch["input_ids"].shape[0]
    T = batch["input_ids"].shape[1]
    out = []
    for start in range(0, R, rows_per_minibatch):
        mb = {k: v[start:start + rows_per_minibatch] for k, v in batch.items()}
        short = rows_per_minibatch - mb["input_ids"].shape[0]
        if short:
            fill = empty_rows(short, T, pad_id)
            mb = {k: np.concatenate([v, fill[k].astype(v.dtype)]) for k, v in mb.items()}
        out.append(mb)
    return out


def _balanced_parts(rows: list[int], size: np.ndarray, k: int) -> list[list[int]]:
    """``rows`` split into k parts of near-equal total ``size``: longest first into the
    lightest part (verl balances with Karmarkar-Karp; the same split for <= 3 rows)."""
    parts, load = [[] for _ in range(k)], [0] * k
    for r in sorted(rows, key=lambda r: -int(size[r])):
        j = load.index(min(load))
        parts[j].append(r)
        load[j] += int(size[r])
    return parts


def verl_microbatch_scales(mb: dict[str, np.ndarray], rows_per_device: int, max_tokens: int
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(pg_scale [R], sft_scale [R]) that make the global-denominator loss equal the authors'
    verl update (dp_actor with use_dynamic_bsz, loss_agg_mode token-mean).

    There, each data-parallel group holds ``rows_per_device`` consecutive rows of a
    mini-batch, split into ceil(total tokens / ``max_tokens``) balanced micro-batches (tokens =
    prompt + response, verl's attention mask); each micro-batch m of n_m rows adds
    (n_m / rows_per_device) x [token-mean policy loss over its T_m response tokens + alpha x
    token-mean NLL over its P_m positive-response tokens (0 when it has none)], and gradients
    are averaged over the groups. So the update is (1/R) sum_m n_m (policy_m / T_m +
    alpha sft_m / P_m) with R the mini-batch's rows: per-row scales n_m / T_m and n_m / P_m
    over a denominator of R (``klear_jax.rl.loss``). Padding rows get 0."""
    seq = np.sum(np.asarray(mb["segment_ids"]) > 0, axis=1)
    tok = np.sum(np.asarray(mb["loss_mask"]) > 0, axis=1)
    pos = tok * (np.asarray(mb["positive"]) > 0)
    R = seq.shape[0]
    pg, sft = np.zeros(R, np.float32), np.zeros(R, np.float32)
    for start in range(0, R, rows_per_device):
        rows = [r for r in range(start, min(start + rows_per_device, R)) if seq[r] > 0]
        if not rows:
            continue
        k = min(len(rows), -(-int(seq[rows].sum()) // int(max_tokens)))
        for part in _balanced_parts(rows, seq, k):
            n, t, p = len(part), int(tok[part].sum()), int(pos[part].sum())
            for r in part:
                pg[r] = n / t if t else 0.0
                sft[r] = n / p if p and pos[r] else 0.0
    return pg, sft
