"""Rollout engine: a fixed set of decode slots on the training mesh, refilled as samples finish.

Usage (the RL loop and the eval command call this)::

    from klear_jax.engine import Engine
    engine = Engine(graphdef, mesh=None, pad_id=0, max_prompt_len=512, slots=64, chunk=16,
                    insert_rows=8, cache_dtype=None, tokenizer=None)
    out = engine.generate(state, prompts, params, seed, budgets=None, on_finish=None)

``generate`` takes and returns what ``Sampler.generate`` does (``SampleOutput``, row i*n + j
is copy j of prompt i) and draws the same samples: the tokens of (prompt i, copy j) depend
only on (seed, prompt i's tokens and occurrence, j) and the weights, never on the slot or the
companions (PRNG keys as in ``sampler.py``, folded with the sample's own step count).

How it runs. The cache (``qwen.init_slot_cache``, ``slots`` rows of S = prompt bucket +
max_new_tokens entries, rounded up to ``backend.decode_block()``) lives for one call. Two
jitted functions, their carry (cache + per-slot state) donated:

    insert  prefill up to ``insert_rows`` pending samples' prompts (each distinct prompt
            once: [Rp, Pb], right-padded, Rp and Pb powers of two), write their k / v into
            free slots, sample each one's first token
    decode  up to ``chunk`` decode steps of every slot (a while loop, ending early when all
            are idle), appending one token to each active slot per step; a slot turns
            idle at a stop token or its budget (``max_new_tokens`` or ``budgets[s]``);
            idle slots compute but emit nothing

Between chunks the host reads the chunk's tokens [chunk, slots], refills freed slots with
pending samples (in order: prompt 0's copies first), and dispatches the next chunk before
handling the finished samples (stop strings, ``on_finish``), so that host work (scoring
submissions in RL) overlaps the device's decoding. Decode attention reads only what each
slot holds (``kernels.slot_attention``).

``on_finish([Finished, ...])`` gets the samples that ended in a chunk, each once, while the
next chunk decodes; ``SamplingParams.stop_strings``
(needs ``tokenizer``) end a sample at the first token whose decoded prefix contains one of
them (``stop_string_hit``; the slot is released at the next chunk).

Several processes (a pod's hosts): every process calls ``generate`` on the same prompts (all
processes' prompts: the host loop decides refills from the tokens it reads back, so every
process makes the same jitted calls) and gets every sample back; each scores only its
``process_share`` of the prompts, and ``gather_shares`` puts the per-prompt results of all
processes together on every process (the RL loop and eval do this).

Statistics of the last call (``last_stats``): chunks, inserts, useful slot-steps (tokens
emitted by decode), slot_utilisation = useful / (chunks x chunk x slots), wall times.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from klear_jax import backend
from klear_jax import sampling_utils as su
from klear_jax import sharding as shd
from klear_jax.models.qwen import cache_shardings, init_slot_cache
from klear_jax.sampler import OnMesh, SampleOutput, SamplingParams


def process_share(n: int, process: int | None = None) -> range:
    """The items (prompts) of ``n`` that process ``process`` (default this one) scores after
    every process decoded all of them: a contiguous block, blocks in process order, sizes
    differing by at most one."""
    i = jax.process_index() if process is None else process
    k = jax.process_count()
    return range(i * n // k, (i + 1) * n // k)


def gather_shares(local, n: int):
    """Every process's ``local`` (a pytree of arrays [len(process_share(n)), ...]: its own
    rows) -> the whole [n, ...] arrays, the same on every process (one collective)."""
    k = jax.process_count()
    if k == 1:
        return local
    width = -(-n // k)

    def pad(x):
        x = np.asarray(x)
        out = np.zeros((width,) + x.shape[1:], x.dtype)
        out[:len(x)] = x
        return out
    everyone = multihost_utils.process_allgather(jax.tree.map(pad, local))  # [k, width, ...]
    return jax.tree.map(lambda x: np.concatenate(
        [np.asarray(x)[p, :len(process_share(n, p))] for p in range(k)]), everyone)


@dataclasses.dataclass
class Finished:
    """One finished sample, handed to ``on_finish``."""
    index: int               # row of the SampleOutput: prompt_index * n + copy
    prompt_index: int
    tokens: np.ndarray       # int32 [length], the stop token included
    logprobs: np.ndarray     # float32 [length]
    truncated: bool          # reached its budget without a stop token / string
    stop_string_hit: bool


SLOT_NAMES = ("act_batch",)


class Engine(OnMesh):
    """See the module docstring."""

    def __init__(self, graphdef, mesh=None, pad_id: int = 0, max_prompt_len: int = 512,
                 slots: int = 64, chunk: int = 16, insert_rows: int = 8, cache_dtype=None,
                 tokenizer=None):
        for name, v in (("max_prompt_len", max_prompt_len), ("slots", slots), ("chunk", chunk),
                        ("insert_rows", insert_rows)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Engine: {name} must be an int >= 1, got {v!r}")
        self.graphdef, self.mesh, self.pad_id = graphdef, mesh, int(pad_id)
        self.max_prompt_len, self.chunk = max_prompt_len, chunk
        m = self.batch_multiple
        self.slots = -(-slots // m) * m
        self.insert_rows = min(insert_rows, self.slots)
        self.cache_dtype, self.tokenizer = cache_dtype, tokenizer
        self._fns: dict = {}
        self.last_stats: dict = {}

    # ----------------------------------------------------------------- placement
    def _carry_shardings(self, carry):
        if self.mesh is None:
            return None
        sh = lambda names: (lambda x: shd.named_sharding(self.mesh, names, x.shape))  # noqa: E731
        out = {k: jax.tree.map(sh(SLOT_NAMES + (None,) * (v.ndim - 1)), v)
               for k, v in carry.items() if k != "cache"}
        out["cache"] = cache_shardings(carry["cache"], self.mesh)
        return out

    def _constrain(self, carry):
        sh = self._carry_shardings(carry)
        return carry if sh is None else jax.lax.with_sharding_constraint(carry, sh)

    # ----------------------------------------------------------------- device functions
    def _init(self, cfg, st: su.SampleFlags, S: int):
        B = self.slots
        zeros = lambda dt: jnp.zeros((B,), dt)  # noqa: E731
        carry = {"cache": init_slot_cache(cfg, B, S, self.cache_dtype), "last": zeros(jnp.int32),
                 "step": zeros(jnp.int32), "budget": zeros(jnp.int32),
                 "active": zeros(jnp.bool_), "phash": zeros(jnp.int32),
                 "sid": zeros(jnp.int32)}
        if st.use_penalty:
            carry["presence"] = jnp.zeros((B, cfg.vocab_size), jnp.bool_)
        return self._constrain(carry)

    def _insert(self, st: su.SampleFlags, state, carry, ids, seg, plen, slots, src, phash, sid,
                budget, seed, temperature, top_p, penalty, stop_ids):
        """Prefills ids [Rp, Pb] (right-padded, seg 1 on real tokens, plen [Rp] lengths) and
        puts row src[r] into slot slots[r] (r < R; slots[r] = B drops the row). Returns
        (carry, first tokens int32 [R], their logprobs float32 [R])."""
        model = nnx.merge(self.graphdef, state)
        Rp = ids.shape[0]
        h, (ks, vs) = model.hidden_states(ids, segment_ids=seg, return_kv=True)
        last = h[jnp.arange(Rp), plen - 1][:, None]                     # [Rp, 1, D]
        raw = model.logits(last)[:, 0][src]                             # [R, V]
        presence = su.prompt_presence(ids, seg, raw.shape[-1])[src] if st.use_penalty else None
        keys = su.step_keys(su.row_keys(seed, phash, sid), 0)
        tok, lp = su.sample_step(raw, presence, keys, temperature, top_p, penalty, st)
        cache = carry["cache"]
        Pb = ids.shape[1]
        put = lambda buf, x, at: buf.at[at].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
        new = dict(carry)
        new["cache"] = {
            "k": tuple(put(c, k[src].transpose(0, 2, 3, 1), (slots, slice(None), slice(None),
                                                             slice(0, Pb)))
                       for c, k in zip(cache["k"], ks)),
            "v": tuple(put(c, v[src].swapaxes(1, 2), (slots, slice(None), slice(0, Pb)))
                       for c, v in zip(cache["v"], vs)),
            "lengths": put(cache["lengths"], plen[src], slots)}
        alive = ~su.is_stop(tok, stop_ids) & (budget > 1)
        for name, value in (("last", tok), ("step", jnp.ones_like(tok)), ("budget", budget),
                            ("active", alive), ("phash", phash), ("sid", sid)):
            new[name] = put(carry[name], value, slots)
        if presence is not None:
            new["presence"] = put(carry["presence"],
                                  presence.at[jnp.arange(tok.shape[0]), tok].set(True), slots)
        return self._constrain(new), tok, lp

    def _decode(self, st: su.SampleFlags, state, carry, keep, seed, temperature, top_p, penalty,
                stop_ids):
        """Up to ``self.chunk`` steps of every slot (fewer when every slot is idle). keep
        bool [B]: slots to keep decoding (False releases a slot the host ended, e.g. at a
        stop string). Returns (carry, tokens int32 [C, B], logprobs float32 [C, B], emitted
        bool [C, B])."""
        model = nnx.merge(self.graphdef, state)
        layers = model.layer_states()  # sliced once, outside the loop
        C, B = self.chunk, carry["last"].shape[0]

        def step(loop):
            i, c, out = loop
            act = c["active"]
            h, cache = model.decode_slots(c["last"], c["cache"], layers)
            cache["lengths"] = jnp.where(act, cache["lengths"], c["cache"]["lengths"])
            raw = model.logits(h)[:, 0]
            keys = su.step_keys(su.row_keys(seed, c["phash"], c["sid"]), c["step"])
            tok, lp = su.sample_step(raw, c.get("presence"), keys, temperature, top_p, penalty, st)
            steps = c["step"] + act.astype(jnp.int32)
            ended = act & (su.is_stop(tok, stop_ids) | (steps >= c["budget"]))
            new = {**c, "cache": cache, "last": jnp.where(act, tok, c["last"]), "step": steps,
                   "active": act & ~ended}
            if "presence" in c:
                new["presence"] = c["presence"].at[jnp.arange(tok.shape[0]), tok].max(act)
            out = (out[0].at[i].set(jnp.where(act, tok, self.pad_id)),
                   out[1].at[i].set(jnp.where(act, lp, 0.0)), out[2].at[i].set(act))
            return i + 1, self._constrain(new), out

        carry = {**carry, "active": carry["active"] & keep}
        out = (jnp.full((C, B), self.pad_id, jnp.int32), jnp.zeros((C, B), jnp.float32),
               jnp.zeros((C, B), jnp.bool_))
        # A while loop, not a scan: the chunk ends early once every slot is idle.
        _, carry, (toks, lps, emitted) = jax.lax.while_loop(
            lambda loop: (loop[0] < C) & jnp.any(loop[1]["active"]), step,
            (jnp.int32(0), carry, out))
        return carry, toks, lps, emitted

    def _functions(self, st: su.SampleFlags, cfg, S: int):
        """(init, insert, decode) jitted for these flags and cache length S."""
        if (st, S) not in self._fns:
            self._fns[st, S] = (
                jax.jit(lambda: self._init(cfg, st, S)),
                jax.jit(lambda *a: self._insert(st, *a), donate_argnums=(1,)),
                jax.jit(lambda *a: self._decode(st, *a), donate_argnums=(1,)))
        return self._fns[st, S]

    def _setup(self, state, params: SamplingParams, prompt_len: int, seed: int = 0):
        """(model config, flags, prompt bucket P, cache length S, device scalars, functions)."""
        cfg = nnx.merge(self.graphdef, state).config
        su.check_stop_ids(params.stop_token_ids, cfg.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("Engine: SamplingParams.stop_strings need Engine(tokenizer=...)")
        st = su.SampleFlags.of(params)
        P = su.bucket_length(prompt_len, self.max_prompt_len)
        with self._ctx():
            block = backend.decode_block()
        S = -(-(P + params.max_new_tokens) // block) * block
        return cfg, st, P, S, su.device_scalars(params, seed), self._functions(st, cfg, S)

    def warmup(self, state, params: SamplingParams, prompt_len: int) -> float:
        """Compiles what ``generate`` runs for prompts of up to ``prompt_len`` tokens (every
        power-of-two count of prompts per insert, the decode chunk) on no-op calls: inserts
        whose rows are all dropped, a chunk with every slot idle. Returns seconds."""
        t0 = time.perf_counter()
        _, _, P, _, scal, (init, insert, decode) = self._setup(state, params, prompt_len)
        B, R = self.slots, self.insert_rows
        with self._ctx():
            carry = init()
            Rp = 1
            while True:
                z = lambda *shape: self._put(np.zeros(shape, np.int32))  # noqa: E731
                carry, *_ = insert(state, carry, z(Rp, P), z(Rp, P), self._put(np.ones(Rp, np.int32)),
                                   self._put(np.full(R, B, np.int32)), z(R), z(R), z(R),
                                   self._put(np.ones(R, np.int32)), *scal)
                if Rp >= R:
                    break
                Rp = min(2 * Rp, R)
            carry, *_ = decode(state, carry, self._put(np.zeros(B, bool), SLOT_NAMES), *scal)
            jax.block_until_ready(carry)
        return time.perf_counter() - t0

    # ----------------------------------------------------------------- host loop
    def generate(self, state, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 seed: int, budgets=None,
                 on_finish: Callable[[list[Finished]], None] | None = None) -> SampleOutput:
        """``params.n`` samples per prompt (see the module docstring). ``budgets``: optional
        int [len(prompts) * n], per-sample caps on new tokens (<= max_new_tokens)."""
        t0 = time.perf_counter()
        prompts = self._checked_prompts(state, prompts, params)
        _, _, P, S, scal, (init, insert, decode) = self._setup(
            state, params, max(map(len, prompts)), seed)
        n, npr, M = params.n, len(prompts), params.max_new_tokens
        N = npr * n
        budget = (np.full(N, M, np.int32) if budgets is None
                  else su.check_budgets(budgets, N, M))
        phash, sid = su.sample_ids(prompts, n, npr)
        B, R = self.slots, self.insert_rows

        samples = _Samples(n, budget, params.stop_token_ids, params.stop_strings, self.tokenizer)
        pending = collections.deque(range(N))
        slot_sample = np.full(B, -1, np.int64)  # the sample each slot decodes, -1: free
        release = np.zeros(B, bool)  # ended by the host: idle them at the next chunk
        stats = collections.Counter()
        t_first = None
        with self._ctx():
            carry = init()
            keep_all = self._put(np.ones(B, bool), SLOT_NAMES)
            while True:
                # ---- refill free slots with pending samples (dispatched, not waited for)
                inserted = []
                free = list(np.nonzero(slot_sample < 0)[0])
                while free and pending:
                    take = [pending.popleft() for _ in range(min(R, len(free), len(pending)))]
                    rows, free = free[:len(take)], free[len(take):]
                    carry, first = self._insert_call(insert, state, carry, prompts, take, rows,
                                                     n, phash, sid, budget, scal)
                    slot_sample[rows], release[rows] = take, False
                    inserted.append((rows, first))
                    stats["inserts"] += 1
                if (slot_sample < 0).all():
                    break
                keep = keep_all if not release.any() else self._put(~release, SLOT_NAMES)
                carry, ct, cl, ce = decode(state, carry, keep, *scal)
                stats["chunks"] += 1
                samples.handoff(on_finish)  # host work on the last chunk's samples overlaps
                # ---- read back the inserts' first tokens, then the chunk's tokens
                for rows, (tok, lp) in inserted:
                    tok, lp = np.asarray(tok), np.asarray(lp)
                    for r, b in enumerate(rows):
                        samples.add(slot_sample[b], tok[r:r + 1], lp[r:r + 1])
                t_first = t_first or time.perf_counter()
                ct, cl, ce = (shd.to_host(x) for x in (ct, cl, ce))
                stats["useful_slot_steps"] += int(ce.sum())
                for b in np.nonzero(slot_sample >= 0)[0]:
                    s = slot_sample[b]
                    if ce[:, b].any():
                        samples.add(s, ct[ce[:, b], b], cl[ce[:, b], b])
                    if samples.ended[s]:  # the device idles it already, unless the host ended it
                        slot_sample[b], release[b] = -1, True
            samples.handoff(on_finish)
        t_end = time.perf_counter()
        out = samples.output(prompts, P, M, self.pad_id)
        C = stats["chunks"] * self.chunk
        self.last_stats = {
            "chunks": stats["chunks"], "inserts": stats["inserts"], "slots": B,
            "chunk": self.chunk, "cache_length": S, "decode_steps": C,
            "useful_slot_steps": stats["useful_slot_steps"],
            "slot_utilisation": stats["useful_slot_steps"] / max(1, C * B),
            "tokens": int(out.lengths.sum()), "total_s": t_end - t0,
            "first_chunk_s": (t_first or t_end) - t0}
        return out

    def _insert_call(self, insert, state, carry, prompts, take, rows, n, phash, sid, budget,
                     scal):
        """Host side of one insert: the distinct prompts of ``take`` (sample indices) padded to
        a power-of-two row count and prompt bucket; slot rows padded to insert_rows."""
        R = self.insert_rows
        pids = list(dict.fromkeys(s // n for s in take))
        Rp = 1
        while Rp < len(pids):
            Rp *= 2
        Pb = su.bucket_length(max(len(prompts[p]) for p in pids), self.max_prompt_len)
        ids = np.full((Rp, Pb), self.pad_id, np.int32)
        seg = np.zeros((Rp, Pb), np.int32)
        plen = np.ones(Rp, np.int32)
        for r, p in enumerate(pids):
            ids[r, :len(prompts[p])], seg[r, :len(prompts[p])] = prompts[p], 1
            plen[r] = len(prompts[p])
        pad = R - len(take)
        idx = np.asarray(take + [take[0]] * pad)
        slots = np.asarray(list(rows) + [self.slots] * pad, np.int32)  # B: dropped
        src = np.asarray([pids.index(s // n) for s in idx], np.int32)
        args = [self._put(ids), self._put(seg), self._put(plen), self._put(slots),
                self._put(src), self._put(phash[idx]), self._put(sid[idx]),
                self._put(budget[idx])]
        carry, tok, lp = insert(state, carry, *args, *scal)
        return carry, (tok, lp)


class _Samples:
    """Host record of one ``generate`` call's N samples (sample s = prompt s // n, copy
    s % n): their tokens as chunks return them, where each one ends (stop token, budget, stop
    string), the hand-over batches and the SampleOutput."""

    def __init__(self, n: int, budget: np.ndarray, stop_ids, stop_strings, tokenizer):
        N = len(budget)
        self.n, self.budget, self.tokenizer = n, budget, tokenizer
        self.stop_ids, self.stop_strings = np.asarray(stop_ids, np.int64), stop_strings
        self.toks: list[list[np.ndarray]] = [[] for _ in range(N)]
        self.lps: list[list[np.ndarray]] = [[] for _ in range(N)]
        self.count = np.zeros(N, np.int64)
        self.ended = np.zeros(N, bool)
        self.lengths = np.zeros(N, np.int32)
        self.truncated = np.zeros(N, bool)
        self.hit = np.zeros(N, bool)
        self.ready: list[int] = []

    def _joined(self, s):
        if len(self.toks[s]) > 1:
            self.toks[s] = [np.concatenate(self.toks[s])]
            self.lps[s] = [np.concatenate(self.lps[s])]
        return self.toks[s][0], self.lps[s][0]

    def add(self, s: int, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Appends sample s's new tokens (int32 [k]) and log-probs; ends it at a stop token,
        its budget or (``stop_strings``) the first token whose text holds one."""
        if self.ended[s]:
            return
        self.toks[s].append(tokens)
        self.lps[s].append(logprobs)
        before, self.count[s] = self.count[s], self.count[s] + len(tokens)
        if self.stop_strings:
            cut = su.stop_string_cut(self.tokenizer, self._joined(s)[0], self.stop_strings,
                                     checked=int(before))
            if cut:
                return self._end(s, cut, hit=True)
        last = tokens[-1]
        if np.isin(last, self.stop_ids) or self.count[s] >= self.budget[s]:
            self._end(s, int(self.count[s]), hit=False)

    def _end(self, s: int, length: int, hit: bool) -> None:
        toks, _ = self._joined(s)
        self.ended[s], self.lengths[s], self.hit[s] = True, length, hit
        self.truncated[s] = not hit and not np.isin(toks[length - 1], self.stop_ids)
        self.ready.append(s)

    def handoff(self, on_finish) -> None:
        """Calls ``on_finish`` with the samples that ended since the last call."""
        if on_finish is not None and self.ready:
            batch = []
            for s in self.ready:
                (toks, lps), L = self._joined(s), int(self.lengths[s])
                batch.append(Finished(s, s // self.n, toks[:L].copy(), lps[:L].copy(),
                                      bool(self.truncated[s]), bool(self.hit[s])))
            on_finish(batch)
        self.ready = []

    def output(self, prompts, P: int, M: int, pad_id: int) -> SampleOutput:
        N = len(self.budget)
        tokens = np.full((N, M), pad_id, np.int32)
        logprobs = np.zeros((N, M), np.float32)
        for s in range(N):
            L = int(self.lengths[s])
            toks, lps = self._joined(s)
            tokens[s, :L], logprobs[s, :L] = toks[:L], lps[:L]
        return SampleOutput.of_prompts(
            prompts, self.n, P, pad_id, tokens=tokens, logprobs=logprobs,
            lengths=self.lengths.copy(), truncated=self.truncated.copy(),
            stop_string_hit=self.hit.copy())
