"""Batched autoregressive sampling with a KV cache, on the training mesh and parameters.

Usage::

    from klear_jax.sampler import Sampler, SamplingParams, SampleOutput
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                            max_new_tokens=256, stop_token_ids=(eos,), n=1)
    sampler = Sampler(graphdef, mesh=None, pad_id=0, max_prompt_len=512, cache_dtype=None)
    out = sampler.generate(state, prompts, params, seed)      # prompts: list[list[int]]
    texts = sampler.decode_text(out, tokenizer, stop_strings=("</answer>",))

The rollout engine (``klear_jax.engine.Engine``: refilled decode slots, stop strings while
decoding) draws the same samples and is what the RL loop and eval run; this static sampler
stays as its reference (tests, the ``rollout`` benchmark's baseline) and for the AOT report.

``state`` is the trainer's own parameter State (``graphdef, state = nnx.split(model)``); it is
passed into the jitted functions as an argument, so nothing is copied and the parameter
shardings are the trainer's. Each call runs two jitted functions: ``prefill`` (the left-padded
prompts [Bp, P] through the model into a fresh KV cache (L per-layer [B, K, P + M, hd]) sharded by
``cache_shardings``, the cache repeated n times per prompt, first token sampled) and ``decode``
(a ``lax.while_loop`` of one-token steps that exits as soon as every row has stopped).
Prompt lengths are bucketed to powers of two (``bucket_length``) and prompt rows padded to a
multiple of the mesh's batch size (data x fsdp), so each (rows, bucket, max_new_tokens,
static sampling flags) compiles once; jax.jit caches the executables.

SampleOutput (numpy; N = len(prompts) * n, row i*n + j is sample j of prompt i)::

    tokens        int32 [N, M]  response tokens, pad_id after the stop token
    logprobs      float32 [N, M] log softmax(logits / T)[token]: the log-probability of each
                  sampled token under the model's temperature-scaled distribution, computed
                  from the raw logits BEFORE repetition penalty, top-k and top-p (T = 1 when
                  greedy); 0 after the stop token. This is exactly what the trainer recomputes
                  with ``chunked_token_logprobs(..., temperature=T)``, so the RL loop can use
                  it as the old/behaviour log-prob. With top-k/top-p/penalty active the actual
                  sampling distribution is the truncated one; these values do not describe it.
    lengths       int32 [N]     response length including the stop token
    truncated     bool [N]      reached max_new_tokens without a stop token
    prompt_index  int32 [N]     which prompt each row answers
    prompt_tokens int32 [N, P]  the prompt, left-padded with pad_id to the bucket P
    prompt_lengths int32 [N]
    stop_string_hit bool [N]    ended at a ``SamplingParams.stop_strings`` match (Engine only)

Randomness: each row's key is fold_in(key(seed), crc32(prompt), occurrence, sample j), and
each step folds in the step index, so a row's samples depend on the seed, its prompt and j,
not on its position in the batch or on the other prompts (up to float rounding differences
between batch shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klear_jax import sharding as shd
from klear_jax import sampling_utils as su
from klear_jax.models.qwen import cache_shardings, init_cache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (<= 1e-5) means greedy; top_k 0 and top_p 1.0 switch those filters off;
    repetition_penalty 1.0 is off (HF semantics over prompt + generated tokens)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    stop_strings: tuple[str, ...] = ()  # host-side, by the Engine (which needs a tokenizer)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop_strings, str) or not all(
                isinstance(x, str) and x for x in self.stop_strings):
            raise ValueError(f"SamplingParams.stop_strings must be a sequence of non-empty "
                             f"strings, got {self.stop_strings!r}")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "an int >= 1"),
            ("n", isinstance(self.n, int) and self.n >= 1, "an int >= 1"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= su.GREEDY_TEMPERATURE


@dataclasses.dataclass
class SampleOutput:
    """See the module docstring for the fields' meaning."""

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    prompt_index: np.ndarray
    prompt_tokens: np.ndarray
    prompt_lengths: np.ndarray
    stop_string_hit: np.ndarray | None = None

    @classmethod
    def of_prompts(cls, prompts: Sequence[Sequence[int]], n: int, P: int, pad_id: int,
                   **response) -> "SampleOutput":
        """The output for ``n`` samples of each of ``prompts`` (left-padded to the bucket P):
        the prompt fields built here, the response fields (tokens ... stop_string_hit, rows
        i * n + j) as given."""
        ids, _ = su.left_pad(prompts, len(prompts), P, pad_id)
        return cls(**response, prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), n),
                   prompt_tokens=np.repeat(ids, n, axis=0),
                   prompt_lengths=np.repeat(np.asarray([len(p) for p in prompts], np.int32), n))


class OnMesh:
    """Placement shared by the Sampler and the Engine: ``mesh`` None runs on one device,
    else sample rows are split over the mesh's batch axes (data x fsdp)."""

    mesh = None

    @property
    def batch_multiple(self) -> int:
        if self.mesh is None:
            return 1
        return int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])

    def _ctx(self):
        return shd.use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _put(self, x, names=None):
        """x on the mesh under logical ``names`` (default: replicated)."""
        if self.mesh is None:
            return jnp.asarray(x)
        x = np.asarray(x)
        return jax.device_put(x, shd.named_sharding(self.mesh, names or (None,) * x.ndim, x.shape))

    def _checked_prompts(self, state, prompts, params):
        """The prompts of a ``generate`` call as lists of ints; raises on bad input."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{type(self).__name__}.generate: params must be SamplingParams, "
                            f"got {type(params)}")
        cfg = nnx.merge(self.graphdef, state).config
        prompts = su.validate_prompts(prompts, cfg.vocab_size, self.max_prompt_len)
        su.check_stop_ids(params.stop_token_ids, cfg.vocab_size)
        return prompts


@dataclasses.dataclass(frozen=True)
class _Static(su.SampleFlags):
    """Everything the compiled functions specialise on besides array shapes."""

    max_new_tokens: int
    n: int


class Sampler(OnMesh):
    """Prefill + while_loop decode for a Qwen graphdef. See the module docstring."""

    def __init__(self, graphdef, mesh=None, pad_id: int = 0, max_prompt_len: int = 512,
                 cache_dtype=None):
        if max_prompt_len < 1:
            raise ValueError(f"Sampler: max_prompt_len must be >= 1, got {max_prompt_len}")
        self.graphdef = graphdef
        self.mesh = mesh
        self.pad_id = int(pad_id)
        self.max_prompt_len = int(max_prompt_len)
        self.cache_dtype = cache_dtype
        self._fns: dict[_Static, tuple] = {}
        self.compiled_shapes: set[tuple] = set()  # (static, rows, prompt bucket) seen so far
        self.last_decode_steps = 0
        self.last_timings: dict[str, float] = {}

    # ----------------------------------------------------------------- sharding helpers
    def _constrain_cache(self, cache):
        if self.mesh is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, self.mesh))

    # ----------------------------------------------------------------- traced functions
    def _prefill(self, st: _Static, state, ids, seg, valid, phash, sid, seed, temperature,
                 top_p, penalty, stop_ids):
        model = nnx.merge(self.graphdef, state)
        cfg = model.config
        Bp, P = ids.shape
        M, n = st.max_new_tokens, st.n
        cache = self._constrain_cache(init_cache(cfg, Bp, P + M, self.cache_dtype))
        h, cache = model.hidden_states(ids, segment_ids=seg, cache=cache, fresh_cache=True)
        raw = model.logits(h[:, -1:])[:, 0]  # [Bp, V]; left padding: last slot is real
        presence = su.prompt_presence(ids, seg, raw.shape[-1]) if st.use_penalty else None
        if n > 1:
            rep = lambda x, axis: jnp.repeat(x, n, axis=axis)
            rows = {k: v for k, v in cache.items() if k != "index"}  # every leaf: rows first
            cache = {**jax.tree.map(lambda x: rep(x, 0), rows), "index": cache["index"]}
            raw = rep(raw, 0)
            presence = None if presence is None else rep(presence, 0)
        cache = self._constrain_cache(cache)
        B = Bp * n
        keys = su.row_keys(seed, phash, sid)
        tok, lp = su.sample_step(raw, presence, su.step_keys(keys, 0), temperature, top_p,
                                 penalty, st)
        stop = su.is_stop(tok, stop_ids)
        valid = jnp.repeat(valid, n) if n > 1 else valid
        tokens = jnp.full((B, M), self.pad_id, jnp.int32).at[:, 0].set(
            jnp.where(valid, tok, self.pad_id))
        logprobs = jnp.zeros((B, M), jnp.float32).at[:, 0].set(jnp.where(valid, lp, 0.0))
        if presence is not None:
            presence = presence.at[jnp.arange(B), tok].set(True)
        return {"step": jnp.int32(1), "cache": cache, "tokens": tokens, "logprobs": logprobs,
                "done": stop | ~valid, "lengths": jnp.where(stop, 1, M).astype(jnp.int32),
                "last": tok, "presence": presence}

    def _decode(self, st: _Static, state, carry, phash, sid, seed, temperature, top_p, penalty,
                stop_ids, budget):
        model = nnx.merge(self.graphdef, state)
        layers = model.layer_states()  # per-layer weights, sliced once outside the loop
        M = st.max_new_tokens
        keys = su.row_keys(seed, phash, sid)
        # budget int32 [B]: a row ends after budget[row] tokens (<= M) as it would at M
        carry = {**carry, "done": carry["done"] | (budget <= 1),
                 "lengths": jnp.minimum(carry["lengths"], budget)}

        def cond(c):
            return (c["step"] < M) & ~jnp.all(c["done"])

        def body(c):
            i = c["step"]
            last = c["last"][:, None]
            h, cache = model.hidden_states(last, segment_ids=jnp.ones_like(last),
                                           cache=c["cache"], layers=layers)
            raw = model.logits(h)[:, 0]
            tok, lp = su.sample_step(raw, c["presence"], su.step_keys(keys, i), temperature,
                                     top_p, penalty, st)
            live = ~c["done"]
            stop = live & su.is_stop(tok, stop_ids)
            presence = c["presence"]
            if presence is not None:
                presence = presence.at[jnp.arange(tok.shape[0]), tok].set(True)
            return {"step": i + 1, "cache": cache,
                    "tokens": c["tokens"].at[:, i].set(jnp.where(live, tok, self.pad_id)),
                    "logprobs": c["logprobs"].at[:, i].set(jnp.where(live, lp, 0.0)),
                    "done": c["done"] | stop | (i + 1 >= budget),
                    "lengths": jnp.where(stop, i + 1, c["lengths"]),
                    "last": tok, "presence": presence}

        # The whole final carry is returned (the caller keeps what it needs) so that every
        # donated input buffer, the KV cache above all, aliases the loop's: no second copy.
        return jax.lax.while_loop(cond, body, carry)

    def _functions(self, st: _Static):
        if st not in self._fns:
            prefill = jax.jit(lambda *a: self._prefill(st, *a))
            # The carry (holding the KV cache) is donated: decode updates it in place.
            decode = jax.jit(lambda *a: self._decode(st, *a), donate_argnums=(1,))
            self._fns[st] = (prefill, decode)
        return self._fns[st]

    # ----------------------------------------------------------------- public API
    def generate(self, state, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 seed: int, budgets=None) -> SampleOutput:
        """Samples ``params.n`` responses per prompt. See the module docstring. ``budgets``:
        optional int [len(prompts) * n], a per-sample cap on new tokens (<= max_new_tokens;
        reaching it ends the sample like max_new_tokens, truncated): the rollout
        benchmark's stop schedule."""
        t0 = time.perf_counter()
        prompts = self._checked_prompts(state, prompts, params)
        if params.stop_strings:
            raise ValueError("Sampler.generate: stop_strings are applied while decoding by "
                             "klear_jax.engine.Engine, not by the static sampler")
        st = _Static.of(params, max_new_tokens=params.max_new_tokens, n=params.n)
        n, npr = params.n, len(prompts)
        m = self.batch_multiple
        Bp = -(-npr // m) * m
        P = su.bucket_length(max(len(p) for p in prompts), self.max_prompt_len)
        ids, seg = su.left_pad(prompts, Bp, P, self.pad_id)
        valid = np.arange(Bp) < npr
        phash, sid = su.sample_ids(prompts, n, Bp)

        row2 = ("act_batch", None)
        row = ("act_batch",)
        scal = su.device_scalars(params, seed)
        budget = np.full(Bp * n, params.max_new_tokens, np.int32)
        if budgets is not None:
            budget[:npr * n] = su.check_budgets(budgets, npr * n, params.max_new_tokens)
        prefill, decode = self._functions(st)
        self.compiled_shapes.add((st, Bp * n, P))
        with self._ctx():
            args_p = (self._put(ids, row2), self._put(seg, row2), self._put(valid, row))
            args_k = (self._put(phash, row), self._put(sid, row))
            carry = prefill(state, *args_p, *args_k, *scal)
            jax.block_until_ready(carry["tokens"])
            t1 = time.perf_counter()
            final = decode(state, carry, *args_k, *scal, self._put(budget, row))
            del carry
        tokens, logprobs, lengths = (final[k] for k in ("tokens", "logprobs", "lengths"))
        self.last_decode_steps = int(final["step"])  # < max_new_tokens after an early exit
        del final
        N = npr * n
        tokens, logprobs, lengths = (shd.to_host(x)[:N] for x in (tokens, logprobs, lengths))
        stopped = su.ends_with_stop(tokens, lengths, params.stop_token_ids)
        t2 = time.perf_counter()
        # Wall times of the last call (compilation included on a shape's first call):
        # ttft_s = host prep + prefill + first token; decode_s = the while_loop + host copy.
        self.last_timings = {"ttft_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}
        return SampleOutput.of_prompts(
            prompts, n, P, self.pad_id, tokens=tokens.astype(np.int32),
            logprobs=logprobs.astype(np.float32), lengths=lengths.astype(np.int32),
            truncated=~stopped, stop_string_hit=np.zeros(N, bool))

    @staticmethod
    def decode_text(out: SampleOutput, tokenizer, stop_strings: Sequence[str] = (),
                    skip_special_tokens: bool = True) -> list[str]:
        """Response strings (cut after the earliest stop string, which is kept)."""
        return su.decode_text(out, tokenizer, stop_strings, skip_special_tokens)
