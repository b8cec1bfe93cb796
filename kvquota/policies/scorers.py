"""The published eviction methods, each one scoring hook (facts from the papers; code our own).
Each scores every layer and KV head on its own (`TokenView`: [B, L, Hkv, C]); on a view of the
whole model (L = Hkv = 1) the same rule reads the summed statistics.

* StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"):
  keep the first `sinks` tokens and the most recent ones.
* H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle"): keep the tokens with the largest
  accumulated attention, plus a recent window.
* SnapKV (Li et al., 2024): attention pooled over neighbouring tokens (max-pool of width
  `kernel`) so clusters survive together. Here the attention is the state's accumulated decode
  mass, not a prefill observation window.
* TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the tokens the last query
  attends to most, per layer with the layer's heads averaged (needs the last step's attention).
* Key norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
  Compression"): keys with a LOW L2 norm draw attention, so they are kept.
* random (seeded) and oldest-first: the baselines.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvquota.policies.base import EvictionPolicy, TokenView


@dataclasses.dataclass(frozen=True)
class StreamingLLM(EvictionPolicy):
    """Sinks plus the most recent tokens. Positions are NOT re-indexed as in the paper's rolling
    cache (a kept token's position there is its slot in the cache): this project keeps every
    token at its original position (keys stay rotated there, new tokens decode at their own
    index), as kvpress's StreamingLLMPress does without its KeyRerotationPress wrapper."""

    name = "streamingllm"
    sinks: int = 4

    def score(self, view: TokenView):
        # Sinks above every other token (the earliest first), then the most recent.
        c = view.mass.shape[-1]
        i = view.index.astype(jnp.float32)
        return jnp.where(view.index < self.sinks, c + self.sinks - i, i) * jnp.ones_like(view.mass)


@dataclasses.dataclass(frozen=True)
class H2O(EvictionPolicy):
    name = "h2o"
    reads_mass = True

    def score(self, view: TokenView):
        return view.mass


@dataclasses.dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    name = "snapkv"
    reads_mass = True
    kernel: int = 7

    def score(self, view: TokenView):
        pad = self.kernel // 2
        m = jnp.where(view.valid, view.mass, -jnp.inf)
        pooled = jax.lax.reduce_window(m, -jnp.inf, jax.lax.max, (1, 1, 1, self.kernel),
                                       (1, 1, 1, 1),
                                       [(0, 0)] * 3 + [(pad, self.kernel - 1 - pad)])
        return jnp.where(view.valid, pooled, 0.0)


@dataclasses.dataclass(frozen=True)
class TOVA(EvictionPolicy):
    name = "tova"
    needs = ("last_attention",)

    def score(self, view: TokenView):
        return jnp.mean(view.last_attention, axis=2, keepdims=True)  # one choice per layer


@dataclasses.dataclass(frozen=True)
class KeyNorm(EvictionPolicy):
    name = "knorm"
    needs = ("key_norm",)

    def score(self, view: TokenView):
        return -view.key_norm


@dataclasses.dataclass(frozen=True)
class Random(EvictionPolicy):
    name = "random"
    seed: int = 0

    def score(self, view: TokenView):
        return jax.random.uniform(jax.random.key(self.seed), view.mass.shape)


@dataclasses.dataclass(frozen=True)
class OldestFirst(EvictionPolicy):
    name = "oldest"

    def score(self, view: TokenView):
        return view.index.astype(jnp.float32) * jnp.ones_like(view.mass)
