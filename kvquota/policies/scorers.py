"""The published eviction methods, each one scoring hook (facts from the papers; code our own).
Each scores every layer and KV head on its own (`TokenView`: [B, L, Hkv, C]); on a view of the
whole model (L = Hkv = 1) the same rule reads the summed statistics.

* StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"):
  keep the first `sinks` tokens and the most recent ones.
* H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
  Large Language Models"): the budget split half heavy hitters (the largest attention
  accumulated over every query so far, among the tokens older than the recent window), half the
  most recent tokens; `h2o-fixed` keeps a fixed `recent` window and heavy hitters in the rest.
* SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"):
  the observation window's attention pooled over neighbouring tokens (max-pool of width
  `kernel` as in the paper's LongBench setting, or kvpress's average) so clusters survive
  together. The attention is the state's accumulated mass: what the caller recorded, e.g. the
  prompt's body unrecorded, then its last W tokens (the window) with recording on.
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

from kvquota.errors import InvalidArgumentError
from kvquota.policies.base import EvictionPolicy, TokenView


@dataclasses.dataclass(frozen=True)
class StreamingLLM(EvictionPolicy):
    name = "streamingllm"
    sinks: int = 4

    def score(self, view: TokenView):
        # Sinks above every other token (the earliest first), then the most recent.
        c = view.mass.shape[-1]
        i = view.index.astype(jnp.float32)
        return jnp.where(view.index < self.sinks, c + self.sinks - i, i) * jnp.ones_like(view.mass)


@dataclasses.dataclass(frozen=True)
class H2O(EvictionPolicy):
    """H2O as published: `recent_share` 1/2 of the kept tokens are the most recent (floor: an
    odd budget's extra token is a heavy hitter), the rest the heaviest older tokens, per layer
    and KV head (the authors' code: `hh_score` summed over queries, top-k over the tokens before
    the recent window). The mass is whatever the state recorded: prefill and decode queries when
    the engine records attention during prefill too."""

    name = "h2o"
    reads_mass = True
    recent_share: float = 0.5

    def score(self, view: TokenView):
        return view.mass


@dataclasses.dataclass(frozen=True)
class H2OFixedWindow(H2O):
    """H2O with a fixed recent window (the caller's `recent` tokens) and heavy hitters in all
    the rest of the budget: this project's h2o before the published split."""

    name = "h2o-fixed"
    recent_share: float = 0.0


SNAPKV_POOLS = ("max", "avg")


@dataclasses.dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """SnapKV's rule: each token's attention mass from the observation window, pooled over
    `kernel` neighbouring tokens (stride 1, `kernel // 2` padding on the left) so clusters
    survive together, per layer and KV head. The observation window is the `recent` window (always
    kept); the pooled sequence is the prefix before it, padded past both of its ends, as in the
    paper's code and kvpress (scores in the window are +inf, like kvpress's max + 1).

    pool "max": max-pooling, padding ignored (the paper's LongBench setting, the default); "avg":
    the mean over all `kernel` places, padding counted as zero (kvpress: torch's avg_pool1d with
    count_include_pad). The mass is already summed over the query heads of each KV head's group
    (kvpress pools each query head, then averages the group: the same ranking for "avg", not
    exactly for "max")."""

    name = "snapkv"
    reads_mass = True
    kernel: int = 7
    pool: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.kernel, int) or isinstance(self.kernel, bool) or self.kernel < 1:
            raise InvalidArgumentError(f"snapkv: kernel must be an integer >= 1, got "
                                       f"{self.kernel!r}")
        if self.pool not in SNAPKV_POOLS:
            raise InvalidArgumentError(f"snapkv: pool must be one of {SNAPKV_POOLS}, got "
                                       f"{self.pool!r}")

    def score(self, view: TokenView):
        pad = self.kernel // 2
        window = [(0, 0)] * 3 + [(pad, self.kernel - 1 - pad)]
        prefix = view.index < (view.lengths - self.recent)[:, None, None, None]
        if self.pool == "max":
            m = jnp.where(prefix, view.mass, -jnp.inf)
            pooled = jax.lax.reduce_window(m, -jnp.inf, jax.lax.max, (1, 1, 1, self.kernel),
                                           (1, 1, 1, 1), window)
        else:
            m = jnp.where(prefix, view.mass, 0.0)
            pooled = jax.lax.reduce_window(m, 0.0, jax.lax.add, (1, 1, 1, self.kernel),
                                           (1, 1, 1, 1), window) / self.kernel
        return jnp.where(prefix, pooled, jnp.where(view.valid, jnp.inf, 0.0))


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
