"""The shape every eviction policy has (as kvpress's scorer presses): a small registered
dataclass with ONE hook, `score`, that rates each cached token; the base class does the top-k and
the bookkeeping, so a policy is a few lines of scoring.

Scores are f32[B, C] over cache indices (C = max_blocks_per_seq * block_size); higher is kept.
Cache order is the original order of the tokens (eviction compacts but never reorders), so
"recent" and "sink" are read off the cache index.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from kvquota.errors import InvalidArgumentError

REGISTRY: dict[str, type["EvictionPolicy"]] = {}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenView:
    """What a policy may read about the cached tokens of a batch of sequences."""

    lengths: jax.Array  # i32[B]  cached tokens per sequence
    mass: jax.Array  # f32[B, C]  accumulated attention mass per token (the state's attn_mass)
    key_norm: Optional[jax.Array]  # f32[B, C]  L2 norm of K (over layers and KV heads), or None
    last_attention: Optional[jax.Array]  # f32[B, C]  the last decode step's mass, or None

    @property
    def index(self) -> jax.Array:
        """i32[1, C] cache index of each column."""
        return jnp.arange(self.mass.shape[1], dtype=jnp.int32)[None, :]

    @property
    def valid(self) -> jax.Array:
        """bool[B, C]: columns that hold a token."""
        return self.index < self.lengths[:, None]


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """Base class: subclasses set `name` and implement `score`.

    Attributes:
      recent: the most recent tokens always kept (the full-precision window of most methods).
    """

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()  # TokenView fields that must not be None
    recent: int = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            REGISTRY[cls.name] = cls

    def __post_init__(self):
        if not isinstance(self.recent, int) or self.recent < 0:
            raise InvalidArgumentError(f"{self.name}: recent must be an integer >= 0, "
                                       f"got {self.recent!r}")

    def score(self, view: TokenView) -> jax.Array:
        """f32[B, C]: how much each token is worth keeping (higher kept first)."""
        raise NotImplementedError

    def keep_mask(self, view: TokenView, keep_tokens: jax.Array) -> jax.Array:
        """bool[B, C]: exactly min(keep_tokens, length) tokens per sequence, the top-scored ones
        (the `recent` window first; ties go to the later token)."""
        for field in self.needs:
            if getattr(view, field) is None:
                raise InvalidArgumentError(f"policy {self.name!r} needs {field}")
        s = self.score(view).astype(jnp.float32)
        recent = view.index >= (view.lengths - self.recent)[:, None]
        s = jnp.where(recent, jnp.inf, s)
        s = jnp.where(view.valid, s, -jnp.inf)
        # Rank by (score, index) descending: ties keep the more recent token.
        order = jnp.lexsort((-view.index.astype(jnp.float32) * jnp.ones_like(s), -s), axis=-1)
        rank = jnp.argsort(order, axis=-1)
        k = jnp.minimum(keep_tokens, view.lengths)
        return view.valid & (rank < k[:, None])

    def block_keep_mask(self, view: TokenView, block_size: int, keep_blocks: jax.Array):
        """bool[B, MB]: the top-scored whole blocks (a block's score: its tokens' mean)."""
        b, c = view.mass.shape
        s = jnp.where(view.valid, self.score(view).astype(jnp.float32), 0.0)
        s = s.reshape(b, c // block_size, block_size)
        n = view.valid.reshape(b, c // block_size, block_size).sum(-1)
        mean = jnp.where(n > 0, s.sum(-1) / jnp.maximum(n, 1), -jnp.inf)
        q = jnp.arange(c // block_size)[None, :]
        recent = (q + 1) * block_size > (view.lengths - self.recent)[:, None]
        mean = jnp.where(recent & (n > 0), jnp.inf, mean)
        order = jnp.lexsort((-q.astype(jnp.float32) * jnp.ones_like(mean), -mean), axis=-1)
        rank = jnp.argsort(order, axis=-1)
        return (n > 0) & (rank < keep_blocks[:, None])


def get_policy(policy, **options) -> EvictionPolicy:
    """A policy instance from a name (with options) or an instance (returned as is)."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if policy not in REGISTRY:
        raise InvalidArgumentError(f"unknown eviction policy {policy!r}; registered: "
                                   f"{', '.join(sorted(REGISTRY))}")
    try:
        return REGISTRY[policy](**options)
    except TypeError as err:
        raise InvalidArgumentError(f"policy {policy!r}: {err}") from None
