"""Tokenizer training/loading, the Qwen-style chat template and the SFT loss mask."""
import numpy as np
import pytest

from data_fixtures import tok, tok_dir  # noqa: F401  (fixtures)
from klear_jax.data import tokenizer as tk


def test_trained_tokenizer_is_transformers_loadable(tok_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    for s in (tk.ENDOFTEXT, tk.IM_START, tk.IM_END, tk.THINK, tk.END_THINK):
        ids = t(s, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and t.convert_ids_to_tokens(ids[0]) == s
    assert t.eos_token == tk.IM_END and t.pad_token == tk.ENDOFTEXT
    text = "def f(x):\n    return x + 12  # ünïcode"
    assert t.decode(t(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_matches_qwen_layout(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    text = tk.render(tok, msgs, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    ids = tk.prompt_ids(tok, msgs)
    assert ids.dtype == np.int32 and tok.decode(ids) == text


def test_sft_loss_mask_covers_only_assistant_tokens_and_im_end(tok):
    msgs = [{"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "<think>\nadd</think>\nfour"},
            {"role": "user", "content": "and 3 + 3?"},
            {"role": "assistant", "content": "six"}]
    ids, mask = tk.sft_ids_and_mask(tok, msgs)
    assert ids.shape == mask.shape and set(np.unique(mask)) <= {0, 1}
    assert tok.decode(ids) == tk.render(tok, msgs)
    # The masked tokens, split into contiguous runs, are exactly the two replies + <|im_end|>.
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(int(i))
        elif cur:
            runs.append(cur); cur = []
    if cur:
        runs.append(cur)
    assert [tok.decode(r) for r in runs] == ["<think>\nadd</think>\nfour<|im_end|>", "six<|im_end|>"]
    assert mask[-1] == 0  # the newline after the last <|im_end|> carries no loss


def test_sft_mask_rejects_non_prefix_template(tok):
    # A template that renders turns differently once the conversation continues.
    tok2 = tk.load_tokenizer(tok.name_or_path)
    tok2.chat_template = ("{% for m in messages %}{{ m['role'] + (':' if loop.last else '=') + m['content'] }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
    with pytest.raises(ValueError, match="rec-7: .*not a prefix"):
        tk.sft_ids_and_mask(tok2, [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "yo"}], name="rec-7")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tk.load_tokenizer(str(tmp_path / "nope"))
