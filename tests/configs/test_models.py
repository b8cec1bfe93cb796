"""Model presets: published shapes, derived sizes computed by hand, and lookup errors."""

import dataclasses

import pytest

from configs.models import MODELS, UnknownModelError, get_model_config


def _hand_param_count(h, layers, hq, hkv, d, ffn, vocab, tied, bias):
    # q and o projections are h x (hq d); k and v are h x (hkv d); SwiGLU has three h x ffn
    # matrices; two RMSNorm weights per layer, one final norm; embeddings once if tied.
    per_layer = 2 * h * hq * d + 2 * h * hkv * d + 3 * h * ffn + 2 * h
    if bias:
        per_layer += hq * d + 2 * hkv * d
    return layers * per_layer + vocab * h * (1 if tied else 2) + h


@pytest.mark.parametrize(
    "name, shape",
    [
        ("smollm2-135m", (576, 30, 9, 3, 64, 1536, 49152, True, False)),
        ("qwen2.5-0.5b", (896, 24, 14, 2, 64, 4864, 151936, True, True)),
        ("qwen2.5-7b", (3584, 28, 28, 4, 128, 18944, 152064, False, True)),
        ("qwen2.5-72b", (8192, 80, 64, 8, 128, 29568, 152064, False, True)),
    ],
)
def test_preset_shapes_and_param_count(name, shape):
    cfg = get_model_config(name)
    h, layers, hq, hkv, d, ffn, vocab, tied, bias = shape
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads) == (h, layers, hq, hkv)
    assert (cfg.head_dim, cfg.ffn_size, cfg.vocab_size) == (d, ffn, vocab)
    assert (cfg.tie_embeddings, cfg.qkv_bias) == (tied, bias)
    assert cfg.param_count == _hand_param_count(*shape)
    assert cfg.weight_bytes() == 2 * cfg.param_count


def test_published_parameter_counts():
    # Model cards: SmolLM2-135M 134.5M, Qwen2.5-0.5B 0.49B, Qwen2.5-7B 7.61B, Qwen2.5-72B 72.7B.
    assert round(MODELS["smollm2-135m"].param_count / 1e6, 1) == 134.5
    assert round(MODELS["qwen2.5-0.5b"].param_count / 1e9, 2) == 0.49
    assert round(MODELS["qwen2.5-7b"].param_count / 1e9, 2) == 7.62
    assert round(MODELS["qwen2.5-72b"].param_count / 1e9, 1) == 72.7
    # ~15.2 GB of bf16 weights for Qwen2.5-7B (the figure DESIGN.md §1.1 compares KV against).
    assert round(MODELS["qwen2.5-7b"].weight_bytes() / 1e9, 1) == 15.2


def test_context_limits_and_rope():
    assert MODELS["smollm2-135m"].max_context == 8192
    assert MODELS["smollm2-135m"].rope_theta == 1e5 and MODELS["smollm2-135m"].rms_eps == 1e-5
    for name in ("qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b"):
        assert MODELS[name].max_context == 32768
        assert MODELS[name].rope_theta == 1e6 and MODELS[name].rms_eps == 1e-6


def test_presets_are_frozen_and_hashable():
    cfg = get_model_config("tiny-qwen")
    assert hash(cfg) == hash(get_model_config("tiny-qwen"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]


def test_unknown_model_names_the_choices():
    with pytest.raises(UnknownModelError, match="qwen2.5-7b.*smollm2-135m"):
        get_model_config("llama-9000")


def test_heads_must_group():
    with pytest.raises(ValueError, match="not a multiple"):
        dataclasses.replace(get_model_config("tiny-qwen"), num_q_heads=5)
