"""The CLI contracts (experiments.score / experiments.generate) on a tiny Qwen2 checkpoint with
its own byte-level tokenizer.json, so no real weights are needed; plus typed errors on bad input.
Only the public API (`import kvquota as kq`) is used."""

import json
import math
import subprocess
import sys
from pydoc_data.topics import topics

import numpy as np
import pytest

import kvquota as kq
from experiments import generate as generate_cli
from tests.experiments.common import TINY_MODEL as MODEL
from tests.experiments.common import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


def test_score_cli_json_contract(checkpoint, tmp_path):
    text = topics["with"]
    text_file = tmp_path / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.score", f"--model={MODEL}", f"--weights={checkpoint}",
         f"--text_file={text_file}", "--max_tokens=40", "--chunk_size=16", "--json"],
        capture_output=True, text=True, check=True, timeout=300)
    record = json.loads(out.stdout.splitlines()[-1])
    tok = kq.from_hf_dir(checkpoint)
    assert record["token_ids"] == tok.encode(text)[:40]
    assert len(record["nll"]) == 39
    assert math.isclose(record["ppl"], math.exp(np.mean(record["nll"])), rel_tol=1e-12)
    # Same numbers as the dense reference engine (paged vs dense tolerance, f32).
    config, params = kq.load_pretrained(MODEL, checkpoint)
    dense = kq.DenseEngine(config, params, capacity=64, chunk_size=64).score(record["token_ids"])
    np.testing.assert_allclose(record["nll"], dense.nll, rtol=0, atol=1e-4)


def test_generate_chat(checkpoint):
    record = generate_cli.run(MODEL, "hi", 5, chat=True, weights_path=str(checkpoint))
    tok = kq.from_hf_dir(checkpoint)
    assert record["prompt_ids"] == tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert record["prompt_ids"][0] == tok.backend.token_to_id("<|im_start|>")
    assert 1 <= len(record["token_ids"]) <= 5
    assert record["finish"] in ("stop", "length")
    assert record["text"] == tok.decode(record["token_ids"])


def test_bad_inputs_give_typed_errors(tmp_path):
    with pytest.raises(kq.WeightsNotFoundError, match="weights path not found"):
        kq.load_pretrained(MODEL, tmp_path / "missing")
    with pytest.raises(kq.WeightsNotFoundError, match="config.json"):
        kq.load_pretrained(MODEL, tmp_path)
    with pytest.raises(kq.WeightsNotFoundError, match="only smollm2-135m ships"):
        kq.load_pretrained("qwen2.5-7b")
    (tmp_path / "x.gguf").write_bytes(b"GGUF but truncated")
    with pytest.raises(kq.WeightsError, match="not a readable GGUF"):
        kq.load_pretrained("smollm2-135m", tmp_path / "x.gguf")
    with pytest.raises(kq.TokenizerError, match="tokenizer.json"):
        kq.from_hf_dir(tmp_path)
