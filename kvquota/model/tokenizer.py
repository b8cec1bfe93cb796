"""Byte-level BPE tokenizers built with the `tokenizers` package, from a GGUF file or an HF dir.

A GGUF "gpt2"-model vocabulary stores the tokens, the merges and a pre-tokenizer *name*
(`tokenizer.ggml.pre`); the pre-tokenizer regexes are llama.cpp's (llama-vocab.cpp) for those
names. Supported: "smollm" (each digit alone, then the GPT-2 split), "gpt-2"/"default" (GPT-2
split) and "qwen2". Tokens of type CONTROL (3) become special tokens, matched whole in the text
the way llama.cpp's `tokenize(..., special=True)` and Hugging Face do. SmolLM2's GGUF sets
`add_bos_token = false`, so `encode` adds nothing.

The chat template is the Jinja template from the metadata, rendered with jinja2's sandbox when
jinja2 is installed; otherwise a ChatML template (what SmolLM2 and Qwen2 use) is rendered by
`_render_chatml`, which the tests check against jinja2.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvquota.errors import TokenizerError

_CONTROL = 3  # llama.cpp token type of control tokens (<|im_start|>, ...)

# GPT-2's split (Radford et al., 2019), as the `tokenizers` ByteLevel pre-tokenizer applies it.
# Qwen2's split (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(name: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("gpt2", "gpt-2", "default"):
        return byte_level
    if name == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if name == "qwen2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise TokenizerError(
        f"GGUF pre-tokenizer {name!r} is not supported; supported: smollm, gpt-2, qwen2"
    )


@dataclasses.dataclass
class Tokenizer:
    """Text <-> token ids, plus the model's special ids and chat template.

    Attributes:
      backend: the `tokenizers.Tokenizer`.
      eos_id: end-of-sequence id (generation stops on it).
      bos_id: beginning-of-sequence id, or None.
      add_bos: whether `encode` prepends `bos_id` (False for SmolLM2's GGUF).
      chat_template: Jinja chat template text, or None.
    """

    backend: HFTokenizer
    eos_id: int
    bos_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens written in the text are matched whole)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: eos, plus ChatML's end-of-turn when the vocab has it."""
        ids = {self.eos_id}
        for name in ("<|im_end|>", "<|endoftext|>"):
            found = self.backend.token_to_id(name)
            if found is not None:
                ids.add(found)
        return tuple(sorted(ids))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}]) with the model's template."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template")
        try:
            import jinja2.sandbox
        except ImportError:
            return _render_chatml(self.chat_template, messages, add_generation_prompt)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )


def _render_chatml(template: str, messages, add_generation_prompt: bool) -> str:
    """ChatML without jinja2: `<|im_start|>role\\ncontent<|im_end|>\\n` per message.

    A default system message written in the template (SmolLM2's) is added when the first
    message is not a system message, as the template itself does.
    """
    if "<|im_start|>" not in template:
        raise TokenizerError("rendering a non-ChatML chat template needs jinja2 installed")
    out = []
    default = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
    if default and (not messages or messages[0]["role"] != "system"):
        out.append(f"<|im_start|>system\n{default.group(1)}<|im_end|>\n")
    for message in messages:
        out.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def from_gguf(path) -> Tokenizer:
    """Builds the tokenizer stored in a GGUF file's metadata (tokenizer.ggml.*)."""
    from kvquota.model.gguf import _field, _gguf_reader

    reader = _gguf_reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, kind in enumerate(types) if kind == _CONTROL]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials]
    )
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return Tokenizer(
        backend=backend,
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        bos_id=None if bos is None else int(bos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def from_hf_dir(directory) -> Tokenizer:
    """Builds the tokenizer of a Hugging Face checkpoint dir (`tokenizer.json` + its config)."""
    directory = pathlib.Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"no tokenizer.json in {str(directory)!r}")
    backend = HFTokenizer.from_file(str(path))
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def token_id(key):
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return None if value is None else backend.token_to_id(value)

    eos = token_id("eos_token")
    if eos is None:
        raise TokenizerError(f"{str(cfg_path)!r} names no eos_token")
    return Tokenizer(
        backend=backend,
        eos_id=eos,
        bos_id=token_id("bos_token"),
        add_bos=bool(cfg.get("add_bos_token", False)),
        chat_template=cfg.get("chat_template"),
    )


def load_tokenizer(model: str, path=None) -> Tokenizer:
    """The tokenizer matching `kvquota.model.weights.load_pretrained(model, path)`."""
    from kvquota.model.gguf import smollm2_gguf_path

    if path is None:
        return from_gguf(smollm2_gguf_path()) if model == "smollm2-135m" else _no_path(model)
    path = pathlib.Path(path)
    return from_hf_dir(path) if path.is_dir() else from_gguf(path)


def _no_path(model: str):
    raise TokenizerError(f"no tokenizer path given for {model!r}; only smollm2-135m ships one")
