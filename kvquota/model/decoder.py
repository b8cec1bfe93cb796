"""A Qwen2/Llama-family decoder in Flax whose attention reads and writes a KV cache.

RMSNorm, RoPE (rotate-half layout, theta from the preset, positions = the sequence's *logical*
positions, which differ from cache indices after eviction), SwiGLU MLP, grouped-query attention,
optional QKV bias, tied or untied embeddings. Layers are scanned (`nn.scan`), so parameters carry
a leading `[L]` axis (see `kvquota.model.weights`) and compile time does not grow with depth.

One forward call processes a chunk of `T` tokens for each of `B` sequences:

    logits [B, T, V], cache = Decoder(config).apply({"params": p}, tokens, positions, cache, meta)

where `meta` (`ChunkMeta`) says where the chunk sits in the cache: row b's token t is cache index
`meta.start[b] + t` and is real only when `t < meta.num_new[b]` (the rest is padding: its K/V are
never written and its logits mean nothing). The two caches (`DenseKV`, `PagedKV`) and their writes and attention live in
`kvquota.model.caches`.

With `with_mass=True` (on a `PagedKV`: a decode step or a prefill chunk) the call also returns
the attention mass each cached token received, f32[B, L, Hkv, M * P] per layer and KV head by
cache index (M = the block table's width), each the mean over the group's query heads, summed
over the chunk's real queries (causally: none to a later token): the layer scan's output, so
per-head eviction can score each (layer, head) on its own, and H2O accumulates over every query
of the prefill and the decode. Off (the default), nothing of it is traced.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from configs.models import ModelConfig
from kvquota.model.caches import (
    ChunkMeta,
    DenseKV,
    PagedKV,
    _dense_attend,
    _dense_write,
    _paged_attend,
    _paged_attend_mass,
    _paged_write,
    init_dense_cache,
    pool_tables,
)


# --------------------------------------------------------------------------------------------
# RoPE.


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
    """cos, sin f32[B, T, D/2] for logical `positions` i32[B, T] (Su et al., 2021, RoFormer)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, T, H, D] in the rotate-half layout (channel i pairs with i + D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Modules.


class Attention(nn.Module):
    """GQA self-attention that writes this chunk's K/V to the cache, then attends over it."""

    config: ModelConfig
    backend: str = "auto"

    @nn.compact
    def __call__(self, x, layer, cos, sin, cache, meta: ChunkMeta, with_mass: bool = False):
        """-> (output, cache), or (output, cache, mass f32[B, M*P]) with `with_mass`."""
        cfg = self.config
        batch, chunk, _ = x.shape
        d = cfg.head_dim

        def proj(name, heads):
            y = nn.Dense(heads * d, use_bias=cfg.qkv_bias, name=name)(x)
            return y.reshape(batch, chunk, heads, d)

        q = apply_rope(proj("q_proj", cfg.num_q_heads), cos, sin)
        k = apply_rope(proj("k_proj", cfg.num_kv_heads), cos, sin)
        v = proj("v_proj", cfg.num_kv_heads)
        sm_scale = 1.0 / math.sqrt(d)
        mass = None
        if with_mass:  # on a PagedKV (checked by Decoder)
            cache = _paged_write(cache, layer, k, v, meta)
            out, mass = _paged_attend_mass(cache, layer, q, meta, sm_scale, self.backend)
        elif isinstance(cache, DenseKV):
            cache = _dense_write(cache, layer, k, v, meta)
            out = _dense_attend(cache, layer, q, meta, sm_scale)
        elif isinstance(cache, PagedKV):
            cache = _paged_write(cache, layer, k, v, meta)
            out = _paged_attend(cache, layer, q, meta, sm_scale, self.backend)
        else:
            raise TypeError(f"unknown cache type {type(cache).__name__}")
        out = out.astype(x.dtype).reshape(batch, chunk, cfg.num_q_heads * d)
        out = nn.Dense(cfg.hidden_size, use_bias=False, name="o_proj")(out)
        return (out, cache) if mass is None else (out, cache, mass)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer, 2020)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        f = self.config.ffn_size
        gate = nn.Dense(f, use_bias=False, name="gate_proj")(x)
        up = nn.Dense(f, use_bias=False, name="up_proj")(x)
        return nn.Dense(self.config.hidden_size, use_bias=False, name="down_proj")(
            nn.silu(gate) * up
        )


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)). Scanned over layers.

    The carry is (h, cache); with `with_mass` the layer's attention mass f32[B, Hkv, M*P] is
    its scan output (stacked over the layers).
    """

    config: ModelConfig
    backend: str = "auto"
    with_mass: bool = False

    @nn.compact
    def __call__(self, carry, layer, cos, sin, meta):
        h, cache = carry
        eps = self.config.rms_eps
        a, cache, *mass = Attention(self.config, self.backend, name="attn")(
            nn.RMSNorm(epsilon=eps, name="attn_norm")(h), layer, cos, sin, cache, meta,
            self.with_mass,
        )
        h = h + a
        h = h + MLP(self.config, name="mlp")(nn.RMSNorm(epsilon=eps, name="mlp_norm")(h))
        return (h, cache), (mass[0] if self.with_mass else None)


class Decoder(nn.Module):
    """The decoder: tokens i32[B, T], positions i32[B, T] -> logits f32[B, T, V], new cache.

    Attributes:
      config: the model shape preset.
      backend: `kernels.paged_attention` backend for a PagedKV cache ("auto", ...).
    """

    config: ModelConfig
    backend: str = "auto"

    @nn.compact
    def __call__(self, tokens, positions, cache, meta: ChunkMeta, last_only: bool = False,
                 with_mass: bool = False):
        """With `last_only`, logits only at each row's last real token: [B, 1, V] (prefill for
        generation needs no more, and the vocabulary projection is a large share of the work).
        With `with_mass` (PagedKV): (logits, cache, mass f32[B, L, Hkv, M*P]), see the module
        docstring."""
        cfg = self.config
        if isinstance(cache, PagedKV) and cache.compressed:
            cache.check_layout()
            meta = meta.replace(pools=pool_tables(meta.block_tables, meta.lengths,
                                                  cache.pool_starts, cache.pool_sizes,
                                                  cache.k_pages.shape[3]))
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="embed")
        h = embed(tokens)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )(cfg, self.backend, with_mass, name="layers")
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        carry = (h, cache)
        if with_mass:
            if not isinstance(cache, PagedKV):
                raise ValueError("with_mass needs a PagedKV cache (the kernels' mass), got "
                                 f"{type(cache).__name__}")
        (h, cache), per_layer = layers(carry, layer_ids, cos, sin, meta)
        mass = []
        if with_mass:  # under a mesh: replicated, like the per-block metadata it is added to
            from kvquota.sharding import replicated

            mass = [replicated(jnp.moveaxis(per_layer, 0, 1))]  # [B, L, Hkv, M*P]
        if last_only:
            last = jnp.maximum(meta.num_new - 1, 0)[:, None, None]  # [B, 1, 1]
            h = jnp.take_along_axis(h, last, axis=1)  # [B, 1, H]
        h = nn.RMSNorm(epsilon=cfg.rms_eps, name="final_norm")(h)
        if cfg.tie_embeddings:
            logits = embed.attend(h)
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, name="lm_head")(h)
        return (logits.astype(jnp.float32), cache, *mass)


def init_params(config: ModelConfig, seed: int = 0, scale: float = 0.02):
    """Random float32 params for a preset (tiny test models), in the loaders' layout.

    Every leaf is drawn from N(0, scale^2) and norm scales are 1 + noise, so biases and norms
    are not trivially zero/one and a loader that drops them shows in the logits.
    """
    model = Decoder(config)
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = init_dense_cache(config, 1, 1)
    meta = ChunkMeta(start=jnp.zeros((1,), jnp.int32), num_new=jnp.ones((1,), jnp.int32))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens, cache, meta))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes["params"])
    rng = np.random.default_rng(seed)  # numpy: one cheap draw per leaf, no per-shape compiles
    out = []
    for path, leaf in leaves:
        noise = scale * rng.standard_normal(leaf.shape, dtype=np.float32)
        is_norm = any(getattr(p, "key", None) == "scale" for p in path)
        out.append(jnp.asarray(1.0 + noise if is_norm else noise))
    return jax.tree_util.tree_unflatten(treedef, out)
