"""Model shape presets: frozen, hashable dataclasses, safe to pass to `jax.jit` as static.

Numbers are the published shapes of each checkpoint (the Hugging Face `config.json` of
SmolLM2-135M-Instruct and Qwen2.5-0.5B/7B/72B-Instruct). Everything derived from them (parameter
count, weight bytes, KV bytes) is computed, never typed in.
"""

from __future__ import annotations

import dataclasses

from configs.errors import ConfigError, UnknownModelError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen2/Llama-family decoder.

    Attributes:
      name: preset name, e.g. "qwen2.5-7b".
      hidden_size: width of the residual stream.
      num_layers: number of decoder blocks.
      num_q_heads: query heads per layer.
      num_kv_heads: key/value heads per layer (grouped-query attention: divides num_q_heads).
      head_dim: channels per head.
      ffn_size: inner width of the SwiGLU MLP.
      vocab_size: rows of the embedding table.
      rope_theta: RoPE base frequency.
      rms_eps: epsilon inside RMSNorm.
      tie_embeddings: whether the output projection reuses the input embedding.
      qkv_bias: whether the Q, K and V projections carry a bias (Qwen2 does, Llama does not).
      max_context: the longest sequence, in tokens, the checkpoint supports.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    max_context: int

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.name}: num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def param_count(self) -> int:
        """Number of parameters, counted from the shapes (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        q_width, kv_width = self.num_q_heads * d, self.num_kv_heads * d
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.qkv_bias:
            attention += q_width + 2 * kv_width
        mlp = 3 * h * self.ffn_size  # gate, up, down
        norms = 2 * h
        per_layer = attention + mlp + norms
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # + final norm

    def weight_bytes(self, bytes_per_param: int = 2) -> int:
        """Bytes of the weights at `bytes_per_param` (2 = bf16)."""
        return self.param_count * bytes_per_param


_PRESETS = (
    ModelConfig(
        name="smollm2-135m", hidden_size=576, num_layers=30, num_q_heads=9, num_kv_heads=3,
        head_dim=64, ffn_size=1536, vocab_size=49152, rope_theta=1e5, rms_eps=1e-5,
        tie_embeddings=True, qkv_bias=False, max_context=8192,
    ),
    ModelConfig(
        name="qwen2.5-0.5b", hidden_size=896, num_layers=24, num_q_heads=14, num_kv_heads=2,
        head_dim=64, ffn_size=4864, vocab_size=151936, rope_theta=1e6, rms_eps=1e-6,
        tie_embeddings=True, qkv_bias=True, max_context=32768,
    ),
    ModelConfig(
        name="qwen2.5-7b", hidden_size=3584, num_layers=28, num_q_heads=28, num_kv_heads=4,
        head_dim=128, ffn_size=18944, vocab_size=152064, rope_theta=1e6, rms_eps=1e-6,
        tie_embeddings=False, qkv_bias=True, max_context=32768,
    ),
    ModelConfig(
        name="qwen2.5-72b", hidden_size=8192, num_layers=80, num_q_heads=64, num_kv_heads=8,
        head_dim=128, ffn_size=29568, vocab_size=152064, rope_theta=1e6, rms_eps=1e-6,
        tie_embeddings=False, qkv_bias=True, max_context=32768,
    ),
    # Tiny random-init presets for fast tests: Qwen2-shaped (GQA, QKV bias), tied and untied.
    # Their RMSNorm eps and RoPE theta are their own (no real preset's, nor flax's default eps
    # 1e-6), and large enough to matter at the float64 oracle's tolerance: a decoder that
    # ignored eps or hard-coded a theta fails tests/model/test_numpy_oracle.py.
    ModelConfig(
        name="tiny-qwen", hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
        head_dim=16, ffn_size=128, vocab_size=256, rope_theta=5e3, rms_eps=1e-3,
        tie_embeddings=True, qkv_bias=True, max_context=512,
    ),
    ModelConfig(
        name="tiny-qwen-untied", hidden_size=96, num_layers=3, num_q_heads=6, num_kv_heads=2,
        head_dim=16, ffn_size=160, vocab_size=320, rope_theta=2.5e4, rms_eps=3e-4,
        tie_embeddings=False, qkv_bias=True, max_context=1024,
    ),
)

MODELS: dict[str, ModelConfig] = {preset.name: preset for preset in _PRESETS}


def get_model_config(name: str) -> ModelConfig:
    """Returns the preset called `name`, or raises UnknownModelError listing the valid names."""
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; valid choices: {', '.join(sorted(MODELS))}"
        ) from None
