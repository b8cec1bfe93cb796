"""Weight loaders: safetensors round trip (QKV bias used), GGUF facts, and typed errors."""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import get_model_config
from kvquota import errors
from kvquota import model as M
from kvquota.model import gguf as gguf_weights
from kvquota.model import weights


def _logits(config, params, tokens):
    """Full-sequence logits [T, V] of one sequence on the dense cache."""
    t = len(tokens)
    cache = M.init_dense_cache(config, 1, t)
    meta = M.ChunkMeta(start=jnp.zeros((1,), jnp.int32), num_new=jnp.full((1,), t, jnp.int32))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    out, _ = jax.jit(M.Decoder(config).apply)(
        {"params": params}, jnp.asarray([tokens], jnp.int32), pos, cache, meta
    )
    return np.asarray(out[0])


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-qwen-untied"])
def test_safetensors_round_trip(tmp_path, name):
    config = get_model_config(name)
    params = M.init_params(config, seed=3)
    weights.save_safetensors(tmp_path, config, params)
    loaded_config, loaded = weights.load_safetensors(tmp_path, name)
    assert loaded_config == config
    # Every leaf comes back bit for bit (float32 all the way).
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, loaded
    )
    # Without a preset, the shapes come from config.json alone.
    inferred, _ = weights.load_safetensors(tmp_path)
    assert {**vars(inferred), "name": name} == vars(config)
    tokens = [5, 17, 3, 99, 42, 7]
    np.testing.assert_array_equal(_logits(config, params, tokens), _logits(config, loaded, tokens))


def test_safetensors_qkv_bias_is_used(tmp_path):
    """Zeroing the checkpoint's Q/K/V biases changes the logits: the loader must not drop them."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=4)
    weights.save_safetensors(tmp_path, config, params)
    _, loaded = weights.load_safetensors(tmp_path, config)
    no_bias = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if path[-1].key == "bias" else x, loaded
    )
    tokens = [1, 2, 3, 4]
    assert np.abs(_logits(config, loaded, tokens) - _logits(config, no_bias, tokens)).max() > 1e-3


def test_safetensors_missing_files(tmp_path):
    with pytest.raises(errors.WeightsNotFoundError, match="config.json"):
        weights.load_safetensors(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(errors.WeightsNotFoundError, match="safetensors"):
        weights.load_safetensors(tmp_path)
    assert issubclass(errors.WeightsNotFoundError, FileNotFoundError)


def test_safetensors_wrong_architecture(tmp_path):
    config = get_model_config("tiny-qwen")
    weights.save_safetensors(tmp_path, config, M.init_params(config))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        weights.load_safetensors(tmp_path)


def test_safetensors_preset_mismatch(tmp_path):
    config = get_model_config("tiny-qwen")
    weights.save_safetensors(tmp_path, config, M.init_params(config))
    with pytest.raises(errors.ConfigMismatchError,
                       match="hidden_size: checkpoint 64 vs preset 96"):
        weights.load_safetensors(tmp_path, "tiny-qwen-untied")


def test_gguf_missing_and_wrong_architecture(tmp_path):
    with pytest.raises(errors.WeightsNotFoundError, match="not found"):
        weights.load_gguf(tmp_path / "missing.gguf")
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(errors.UnsupportedArchitectureError, match="'gpt2'"):
        weights.load_gguf(path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(errors.WeightsError):
        weights.load_gguf(tmp_path / "junk.gguf")


def _llama_cpp_permute(w, heads):
    """llama.cpp's convert_hf_to_gguf.py Q/K permutation, from its published formula:
    reshape(heads, 2, D/2, ...) -> swap axes 1, 2 -> reshape back."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(3 * 8, 5), (2 * 4,)])
def test_unpermute_inverts_llama_cpp_permutation(shape):
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    heads = 3 if shape[0] == 24 else 2
    np.testing.assert_array_equal(
        gguf_weights._unpermute_rope_rows(_llama_cpp_permute(w, heads), heads), w
    )
