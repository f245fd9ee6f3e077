"""Pure pieces of the sampler: logit processing, token choice, per-row keys, and host helpers
(prompt bucketing, left padding, text decoding, stop strings).

Device functions take float32 logits [B, V] (B rows, V vocab). Processing order follows
transformers' ``generate``: repetition penalty, then temperature, then top-k, then top-p.
"""

from __future__ import annotations

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


def row_keys(seed, prompt_hash, sample_id):
    """One PRNG key per row from (seed, hash of the row's prompt, sample id): independent of
    the row's position in the batch. seed int scalar; prompt_hash, sample_id int32 [B]."""
    base = jax.random.key(seed)
    return jax.vmap(lambda h, s: jax.random.fold_in(jax.random.fold_in(base, h), s))(
        prompt_hash, sample_id)


def step_keys(keys, step):
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)


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


def prompt_hashes(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(crc32 of each prompt's tokens as int32 [P], occurrence index of that prompt among
    identical earlier ones int32 [P]), so repeated prompts still get distinct samples."""
    seen: dict[bytes, int] = {}
    hashes, occ = [], []
    for p in prompts:
        b = np.asarray(p, np.int32).tobytes()
        hashes.append(zlib.crc32(b) & 0x7FFFFFFF)
        occ.append(seen.get(b, 0))
        seen[b] = occ[-1] + 1
    return np.asarray(hashes, np.int32), np.asarray(occ, np.int32)


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


def stop_string_lengths(out, tokenizer, stop_strings: Sequence[str]) -> np.ndarray:
    """Per row, the fewest response tokens whose decoded text contains a stop string (-1 when
    none does). Binary search over prefixes: containment is monotone in the prefix."""
    res = np.full(out.tokens.shape[0], -1, np.int32)
    for i in range(out.tokens.shape[0]):
        ids = response_ids(out, i)
        def hit(k):
            return _cut_at_stop(tokenizer.decode(ids[:k]), stop_strings)[1]
        if not ids or not hit(len(ids)):
            continue
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
        res[i] = lo
    return res
