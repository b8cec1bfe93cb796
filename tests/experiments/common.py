"""Shared fixtures of the experiment tests: a tiny Qwen2 checkpoint and a CLI runner."""

import json
import os
import subprocess
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import kvquota as kq

TINY_MODEL = "tiny-qwen-untied"  # vocab 320: 256 byte tokens + 3 specials fit
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_checkpoint(path):
    """A Qwen2 safetensors dir with random weights and a byte-level BPE tokenizer (no merges)."""
    config = kq.get_model_config(TINY_MODEL)
    kq.save_safetensors(path, config, kq.init_params(config, seed=21, scale=0.1))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))
    return path


def run_cli(module, *args, cwd=None, timeout=300):
    """Runs `python -m experiments.<module> args...` from the repository root (or `cwd`)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or root,
                          env=env)
