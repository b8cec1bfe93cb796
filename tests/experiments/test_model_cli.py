"""The CLI contracts (experiments.score / experiments.generate) on a tiny Qwen2 checkpoint with
its own byte-level tokenizer.json, so no real weights are needed; plus typed errors on bad input."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from pydoc_data.topics import topics
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from configs.models import get_model_config
from experiments import generate as generate_cli
from kvquota import serving as E
from kvquota import model as M
from kvquota.model import tokenizer as tk
from kvquota.model import weights

MODEL = "tiny-qwen-untied"  # vocab 320: 256 byte tokens + 3 specials fit
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen2 safetensors dir with random weights and a byte-level BPE tokenizer (no merges)."""
    path = tmp_path_factory.mktemp("tiny_ckpt")
    config = get_model_config(MODEL)
    weights.save_safetensors(path, config, M.init_params(config, seed=21, scale=0.1))
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


def test_score_cli_json_contract(checkpoint, tmp_path):
    text = topics["with"]
    text_file = tmp_path / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.score", f"--model={MODEL}", f"--weights={checkpoint}",
         f"--text_file={text_file}", "--max_tokens=40", "--chunk_size=16", "--json"],
        capture_output=True, text=True, check=True, timeout=300)
    record = json.loads(out.stdout)
    tok = tk.from_hf_dir(checkpoint)
    assert record["token_ids"] == tok.encode(text)[:40]
    assert len(record["nll"]) == 39
    assert math.isclose(record["ppl"], math.exp(np.mean(record["nll"])), rel_tol=1e-12)
    # Same numbers as the dense reference engine (paged vs dense tolerance, f32).
    config, params = weights.load_safetensors(checkpoint, MODEL)
    dense = E.DenseEngine(config, params, capacity=64, chunk_size=64).score(record["token_ids"])
    np.testing.assert_allclose(record["nll"], dense.nll, rtol=0, atol=1e-4)


def test_generate_chat(checkpoint):
    record = generate_cli.run(MODEL, "hi", 5, chat=True, weights_path=str(checkpoint))
    tok = tk.from_hf_dir(checkpoint)
    assert record["prompt_ids"] == tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert record["prompt_ids"][0] == tok.backend.token_to_id("<|im_start|>")
    assert 1 <= len(record["token_ids"]) <= 5
    assert record["finish"] in ("stop", "length")
    assert record["text"] == tok.decode(record["token_ids"])


def test_bad_inputs_give_typed_errors(tmp_path):
    with pytest.raises(weights.WeightsNotFoundError, match="weights path not found"):
        weights.load_pretrained(MODEL, tmp_path / "missing")
    with pytest.raises(weights.WeightsNotFoundError, match="config.json"):
        weights.load_pretrained(MODEL, tmp_path)
    with pytest.raises(weights.WeightsNotFoundError, match="only smollm2-135m ships"):
        weights.load_pretrained("qwen2.5-7b")
    (tmp_path / "x.gguf").write_bytes(b"GGUF but truncated")
    with pytest.raises(weights.WeightsError, match="not a readable GGUF"):
        weights.load_pretrained("smollm2-135m", tmp_path / "x.gguf")
    with pytest.raises(tk.TokenizerError, match="tokenizer.json"):
        tk.from_hf_dir(tmp_path)


def test_score_cli_bad_weights_path_exits_2(tmp_path):
    text_file = tmp_path / "t.txt"
    text_file.write_text("hello")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.score", f"--model={MODEL}",
         f"--weights={tmp_path / 'nowhere'}", f"--text_file={text_file}", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "error: WeightsNotFoundError: weights path not found" in out.stderr
    assert out.stdout == ""
