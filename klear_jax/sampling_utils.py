"""Pure pieces of the sampler: logit processing, token choice, per-row keys, and host helpers
(prompt bucketing, left padding, text decoding, stop strings).

Device functions take float32 logits [B, V] (B rows, V vocab). Processing order follows
transformers' ``generate``: repetition penalty, then temperature, then top-k, then top-p.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

GREEDY_TEMPERATURE = 1e-5  # at or below this temperature decoding is argmax


# ------------------------------------------------------------------------- device side
def apply_repetition_penalty(logits, presence, penalty):
    """HF ``RepetitionPenaltyLogitsProcessor``: for tokens already seen (presence bool [B, V])
    positive logits are divided by ``penalty`` and negative ones multiplied by it."""
    penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(presence, penalised, logits)


def sampled_logprob(raw_logits, tokens, temperature):
    """log softmax(raw_logits / temperature)[tokens] -> float32 [B].

    ``raw_logits`` are the model's logits (no repetition penalty, no truncation): this is the
    same quantity the trainer recomputes (``logprobs.chunked_token_logprobs(temperature=T)``).
    """
    scaled = raw_logits.astype(jnp.float32) / temperature
    tgt = jnp.take_along_axis(scaled, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return tgt - jax.nn.logsumexp(scaled, axis=-1)


def truncate_sorted(vals, top_p, use_top_p: bool):
    """Nucleus filter on descending-sorted logits [B, k]: keeps the smallest prefix whose
    probability mass reaches ``top_p`` (always at least the first), the rest -> -inf."""
    if not use_top_p:
        return vals
    probs = jax.nn.softmax(vals, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return jnp.where(mass_before < top_p, vals, -jnp.inf)


def choose_tokens(logits, keys, *, greedy: bool, top_k: int, use_top_p: bool, top_p):
    """Picks one token per row from processed (penalised, temperature-scaled) logits [B, V].

    keys: typed PRNG keys [B], one per row. ``top_k`` is static (0 = off); with top-p but no
    top-k the whole vocabulary is sorted. Returns int32 [B].
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    V = logits.shape[-1]
    k = min(top_k, V) if top_k > 0 else (V if use_top_p else 0)
    if k == 0:
        return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
    vals, idx = jax.lax.top_k(logits, k)  # [B, k], descending
    vals = truncate_sorted(vals, top_p, use_top_p)
    pick = jax.vmap(jax.random.categorical)(keys, vals)
    return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SampleFlags:
    """The sampling switches the compiled functions specialise on (static under jit)."""

    greedy: bool
    top_k: int
    use_top_p: bool
    use_penalty: bool

    @classmethod
    def of(cls, params, **extra):
        """The flags of a ``SamplingParams`` (``extra``: a subclass's own fields)."""
        return cls(greedy=params.greedy, top_k=0 if params.greedy else params.top_k,
                   use_top_p=not params.greedy and params.top_p < 1.0,
                   use_penalty=params.repetition_penalty != 1.0, **extra)


def sample_step(raw, presence, keys, temperature, top_p, penalty, flags: SampleFlags):
    """One sampling step of every row: raw float32 logits [B, V] -> (tokens int32 [B],
    logprobs float32 [B]). ``presence`` bool [B, V] (tokens seen, for the repetition penalty;
    None when ``flags.use_penalty`` is off); keys: typed PRNG keys [B] for this step. The
    log-prob is ``sampled_logprob`` of the raw logits (see the sampler's docstring)."""
    logits = raw
    if flags.use_penalty:
        logits = apply_repetition_penalty(logits, presence, penalty)
    t = jnp.float32(1.0) if flags.greedy else temperature
    if not flags.greedy:
        logits = logits / t
    tok = choose_tokens(logits, keys, greedy=flags.greedy, top_k=flags.top_k,
                        use_top_p=flags.use_top_p, top_p=top_p)
    return tok, sampled_logprob(raw, tok, t)


def prompt_presence(ids, seg, vocab_size: int):
    """bool [R, V]: the tokens of each row's prompt (ids int32 [R, P], seg 1 on real tokens),
    the repetition penalty's starting set."""
    R = ids.shape[0]
    return jnp.zeros((R, vocab_size), jnp.int32).at[jnp.arange(R)[:, None], ids].max(seg) > 0


def row_keys(seed, prompt_hash, sample_id):
    """One PRNG key per row from (seed, hash of the row's prompt, sample id): independent of
    the row's position in the batch. seed int scalar; prompt_hash, sample_id int32 [B]."""
    base = jax.random.key(seed)
    return jax.vmap(lambda h, s: jax.random.fold_in(jax.random.fold_in(base, h), s))(
        prompt_hash, sample_id)


def step_keys(keys, step):
    """keys [B] folded with ``step``: an int scalar (every row at the same step) or int32 [B]
    (each row at its own step, as in a rollout engine's slots)."""
    step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, step)


def device_scalars(params, seed: int) -> tuple:
    """The traced arguments every sampling function takes after its own: (seed uint32,
    temperature, top_p, repetition penalty float32, stop ids int32 [S] (``pad_stop_ids``))."""
    return (jnp.asarray(int(seed) % 2**32, jnp.uint32),
            jnp.float32(max(params.temperature, GREEDY_TEMPERATURE)),
            jnp.float32(params.top_p), jnp.float32(params.repetition_penalty),
            jnp.asarray(pad_stop_ids(params.stop_token_ids), jnp.int32))


def check_stop_ids(stop_ids: Sequence[int], vocab_size: int) -> None:
    for t in stop_ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"SamplingParams.stop_token_ids: {t} outside [0, {vocab_size})")


def pad_stop_ids(stop_ids: Sequence[int], multiple: int = 8) -> np.ndarray:
    """Stop ids padded with -1 (never a token) to a multiple of 8, so the number of stop
    ids does not change the compiled shape."""
    n = max(multiple, -(-len(stop_ids) // multiple) * multiple)
    out = np.full(n, -1, np.int32)
    out[:len(stop_ids)] = stop_ids
    return out


def is_stop(tokens, stop_ids):
    """tokens int32 [B], stop_ids int32 [S] (S may be 0) -> bool [B]."""
    return jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)


# ------------------------------------------------------------------------- host side
def bucket_length(n: int, max_len: int, minimum: int = 16) -> int:
    """Prompt bucket: the next power of two >= n (at least ``minimum``), capped at max_len.
    Bounds recompiles to ~log2(max_len) prompt shapes."""
    b = minimum
    while b < n:
        b *= 2
    return min(b, max_len)


def sample_ids(prompts: Sequence[Sequence[int]], n: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The PRNG inputs of ``n`` samples of each of ``rows`` prompt rows (``prompts`` then
    padding rows, which hash to 0), row-major (sample i * n + j is copy j of row i):
    (crc32 of the prompt's tokens int32 [rows * n], sample id int32 [rows * n] = occurrence
    of that prompt among identical earlier ones * n + j), so repeated prompts still get
    distinct samples."""
    seen: dict[bytes, int] = {}
    hashes, occ = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for i, p in enumerate(prompts):
        b = np.asarray(p, np.int32).tobytes()
        hashes[i] = zlib.crc32(b) & 0x7FFFFFFF
        occ[i] = seen.get(b, 0)
        seen[b] = occ[i] + 1
    sid = np.repeat(occ, n) * n + np.tile(np.arange(n), rows)
    return np.repeat(hashes, n), sid.astype(np.int32)


def left_pad(prompts: Sequence[Sequence[int]], rows: int, width: int, pad_id: int):
    """(ids int32 [rows, width] left-padded with pad_id, segment ids int32 [rows, width]
    with 1 on real tokens). Rows beyond len(prompts) hold one dummy token."""
    ids = np.full((rows, width), pad_id, np.int32)
    seg = np.zeros((rows, width), np.int32)
    for i in range(rows):
        p = prompts[i] if i < len(prompts) else [pad_id]
        ids[i, width - len(p):] = p
        seg[i, width - len(p):] = 1
    return ids, seg


def validate_prompts(prompts, vocab_size: int, max_prompt_len: int) -> list[list[int]]:
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("Sampler.generate: prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"Sampler.generate: prompts[{i}] must be a non-empty 1-D list of "
                             f"int token ids, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size > max_prompt_len:
            raise ValueError(f"Sampler.generate: prompts[{i}] has {arr.size} tokens, more than "
                             f"max_prompt_len={max_prompt_len}")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"Sampler.generate: prompts[{i}] has token ids outside "
                             f"[0, {vocab_size}) (min {arr.min()}, max {arr.max()})")
        out.append([int(t) for t in arr])
    return out


def check_budgets(budgets, n: int, max_new_tokens: int) -> np.ndarray:
    """Per-sample token budgets int [n], each in [1, max_new_tokens] -> int32 [n]."""
    b = np.asarray(budgets)
    if b.shape != (n,) or not np.issubdtype(b.dtype, np.integer) or (n and (
            b.min() < 1 or b.max() > max_new_tokens)):
        raise ValueError(f"budgets must be {n} ints in [1, max_new_tokens={max_new_tokens}], "
                         f"got shape {b.shape} dtype {b.dtype}")
    return b.astype(np.int32)


def ends_with_stop(tokens: np.ndarray, lengths: np.ndarray, stop_ids: Sequence[int]) -> np.ndarray:
    """bool [N]: row i's last response token (tokens[i, lengths[i] - 1]) is a stop token."""
    last = tokens[np.arange(tokens.shape[0]), np.maximum(lengths, 1) - 1]
    return np.isin(last, np.asarray(stop_ids, np.int64)) & (lengths > 0)


def response_ids(out, i: int) -> list[int]:
    """Row i's response tokens up to and including its stop token."""
    return [int(t) for t in out.tokens[i, :out.lengths[i]]]


def _cut_at_stop(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
    hits = [(text.find(s), s) for s in stop_strings if s and s in text]
    if not hits:
        return text, False
    pos, s = min(hits)
    return text[:pos + len(s)], True


def decode_text(out, tokenizer, stop_strings: Sequence[str] = (),
                skip_special_tokens: bool = True) -> list[str]:
    """Response strings, one per row of a SampleOutput. With ``stop_strings`` each text is cut
    right after the earliest stop string it contains (the stop string is kept)."""
    texts = []
    for i in range(out.tokens.shape[0]):
        t = tokenizer.decode(response_ids(out, i), skip_special_tokens=skip_special_tokens)
        texts.append(_cut_at_stop(t, stop_strings)[0])
    return texts


def stop_string_cut(tokenizer, ids: Sequence[int], stop_strings: Sequence[str],
                    checked: int = 0) -> int:
    """The fewest tokens of ``ids`` whose decoded text contains a stop string, or 0 when
    ``ids`` has none. The first ``checked`` tokens are known to hold none: only a tail window
    covering the new tokens and the longest stop string (in UTF-8 bytes, the most tokens it
    can span) is decoded, and on a hit the cut is found by binary search over prefixes
    (containment is monotone in the prefix). Cost per call: one decode of the window."""
    ids = [int(t) for t in ids]
    span = max(len(s.encode()) for s in stop_strings)
    lo = max(0, checked - span)
    if not ids or not _cut_at_stop(tokenizer.decode(ids[lo:]), stop_strings)[1]:
        return 0

    def hit(k):
        return _cut_at_stop(tokenizer.decode(ids[:k]), stop_strings)[1]
    if not hit(len(ids)):  # the window's text differed from the full text's (byte pieces)
        return 0
    lo, hi = max(1, checked), len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
    return lo
