"""Tokenizer helpers: load a local transformers tokenizer, train a tiny Qwen-style one, and
turn chat records into (input_ids, loss_mask) with loss only on assistant tokens.

Nothing here downloads anything: tokenizers come from local directories or are trained
locally with HF `tokenizers` (byte-level BPE, Qwen2/3 pre-tokenizer regex).
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Qwen2/Qwen3-style ChatML template (no tool calls). Unlike Qwen3's own template it does
# not strip <think> blocks from earlier assistant turns, so every rendered prefix of a
# conversation is a prefix of the rendering of the whole conversation.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2 / Qwen3 pre-tokenizer split pattern.
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def load_tokenizer(path: str):
    """Loads a transformers tokenizer from a local directory; it must carry a chat template."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer at {path!r} has no chat_template")
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str):
    """Trains a byte-level BPE with Qwen special tokens and chat template; saves it to out_dir.

    Returns the loaded PreTrainedTokenizerFast. eos = <|im_end|>, pad = <|endoftext|>;
    <think>/</think> are added (non-special) tokens as in Qwen3.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [ENDOFTEXT, IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, bos_token=None,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return load_tokenizer(out_dir)


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages: Sequence[dict]) -> np.ndarray:
    """Chat-templated prompt ending with the assistant header -> int32 [T]."""
    return np.asarray(encode(tokenizer, render(tokenizer, messages, True)), np.int32)


def sft_ids_and_mask(tokenizer, messages: Sequence[dict], name: str = "record") -> tuple[np.ndarray, np.ndarray]:
    """Tokenises a conversation -> (input_ids int32 [T], loss_mask uint8 [T]).

    loss_mask is 1 on each assistant turn's content tokens and its closing <|im_end|>
    (not on the newline the template emits after it, nor on headers / other roles).
    Spans come from tokenising rendered prefixes; each must be a token-level prefix of the
    full conversation, otherwise ValueError naming `name`.
    """
    full = encode(tokenizer, render(tokenizer, messages))
    mask = np.zeros(len(full), np.uint8)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)

    def checked_prefix(ids: list[int], what: str) -> int:
        if ids != full[: len(ids)]:
            raise ValueError(
                f"{name}: tokenisation of the conversation up to {what} is not a prefix of the "
                "whole conversation's tokenisation (chat template or tokenizer merges across turns)")
        return len(ids)

    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = checked_prefix(encode(tokenizer, render(tokenizer, messages[:i], True)), f"turn {i} header")
        end = checked_prefix(encode(tokenizer, render(tokenizer, messages[: i + 1])), f"end of turn {i}")
        span = full[start:end]
        if im_end not in span:
            raise ValueError(f"{name}: assistant turn {i} does not end with {IM_END}")
        stop = start + len(span) - span[::-1].index(im_end)  # one past the last <|im_end|>
        mask[start:stop] = 1
    return np.asarray(full, np.int32), mask
