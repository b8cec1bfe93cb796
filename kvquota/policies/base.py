"""The shape every eviction policy has (as kvpress's scorer presses): a small registered
dataclass with ONE hook, `score`, that rates each cached token; the base class does the top-k and
the bookkeeping, so a policy is a few lines of scoring.

Scores are f32[B, L, Hkv, C] (kvpress's `score` contract, batched): per layer and KV head over
cache indices (C = max_blocks_per_seq * block_size); higher is kept, and each (layer, head) keeps
its own top tokens, the same number in each. A view of the whole model (`aggregate="global"`:
the summed mass, one kept set for every layer and head, as block-mode eviction and metadata-only
states need) has L = Hkv = 1. Cache order is the original order of the tokens (eviction compacts
but never reorders), so "recent" and "sink" are read off the cache index.
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
    """What a policy may read about the cached tokens of a batch of sequences, per layer and
    KV head ([B, L, Hkv, C]; L = Hkv = 1 for a view of the whole model)."""

    lengths: jax.Array  # i32[B]  cached tokens per sequence
    mass: jax.Array  # f32[B, L, Hkv, C]  accumulated attention mass per token (the state's
    #                  head_mass; attn_mass, summed over layers and heads, when L = Hkv = 1)
    key_norm: Optional[jax.Array]  # f32[B, L, Hkv, C]  L2 norm of K over its channels (and,
    #                                when L = Hkv = 1, over layers and heads), or None
    last_attention: Optional[jax.Array]  # f32[B, L, Hkv, C]  the last decode step's mass, or None

    @property
    def index(self) -> jax.Array:
        """i32[1, 1, 1, C] cache index of each column."""
        return jnp.arange(self.mass.shape[-1], dtype=jnp.int32)[None, None, None, :]

    @property
    def valid(self) -> jax.Array:
        """bool[B, 1, 1, C]: columns that hold a token."""
        return self.index < self.lengths[:, None, None, None]

    @property
    def per_head(self) -> bool:
        """Whether the view scores each (layer, KV head) on its own."""
        return self.mass.shape[1:3] != (1, 1)


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """Base class: subclasses set `name` and implement `score`.

    Attributes:
      recent: the most recent tokens always kept (the full-precision window of most methods).
      recent_share: the share of the kept tokens that are the most recent ones (H2O's split of
        its budget): the recent window of a sequence keeping k tokens is
        max(recent, floor(recent_share * k)) tokens; the rest are the top-scored older tokens.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()  # TokenView fields that must not be None
    reads_mass: ClassVar[bool] = False  # scores the recorded attention mass
    recent: int = 0
    recent_share: float = 0.0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            REGISTRY[cls.name] = cls

    def __post_init__(self):
        if not isinstance(self.recent, int) or self.recent < 0:
            raise InvalidArgumentError(f"{self.name}: recent must be an integer >= 0, "
                                       f"got {self.recent!r}")
        share = self.recent_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise InvalidArgumentError(f"{self.name}: recent_share must be a number in [0, 1], "
                                       f"got {share!r}")

    def recent_tokens(self, kept: jax.Array) -> jax.Array:
        """i32[B]: the size of the recent window when keeping `kept` (i32[B]) tokens:
        max(recent, floor(recent_share * kept)), so an odd budget's extra token is a scored one
        (f32 arithmetic: exact for shares of a power of two such as H2O's 1/2)."""
        share = jnp.floor(jnp.float32(self.recent_share) * kept.astype(jnp.float32))
        return jnp.maximum(self.recent, share.astype(jnp.int32))

    def score(self, view: TokenView) -> jax.Array:
        """f32[B, L, Hkv, C] (or broadcastable to it): how much each token is worth keeping
        (higher kept first)."""
        raise NotImplementedError

    def _scores(self, view: TokenView) -> jax.Array:
        for field in self.needs:
            if getattr(view, field) is None:
                raise InvalidArgumentError(f"policy {self.name!r} needs {field}")
        return jnp.broadcast_to(self.score(view).astype(jnp.float32), view.mass.shape)

    def keep_mask(self, view: TokenView, keep_tokens: jax.Array) -> jax.Array:
        """bool[B, L, Hkv, C]: exactly k = min(keep_tokens, length) tokens per sequence in each
        (layer, head): the recent window (`recent_tokens(k)`), then the top-scored older tokens
        (ties go to the later token)."""
        s = self._scores(view)
        k = jnp.minimum(keep_tokens, view.lengths)
        recent = view.index >= (view.lengths - self.recent_tokens(k))[:, None, None, None]
        s = jnp.where(recent, jnp.inf, s)
        s = jnp.where(view.valid, s, -jnp.inf)
        # Rank by (score, index) descending: ties keep the more recent token.
        order = jnp.lexsort((-view.index.astype(jnp.float32) * jnp.ones_like(s), -s), axis=-1)
        return view.valid & _first(order, k)

    def block_keep_mask(self, view: TokenView, block_size: int, keep_blocks: jax.Array):
        """bool[B, MB]: the top-scored whole blocks (a block's score: its tokens' mean), one
        set for the whole model (a view with L = Hkv = 1); the blocks holding the recent window
        (`recent_tokens` of the kept blocks' tokens) first."""
        if view.per_head:
            raise InvalidArgumentError("whole-block eviction keeps one set of blocks for every "
                                       "layer and head: it needs a global view")
        b, c = view.mass.shape[0], view.mass.shape[-1]
        valid = view.valid[:, 0, 0]
        s = jnp.where(valid, self._scores(view)[:, 0, 0], 0.0)
        s = s.reshape(b, c // block_size, block_size)
        n = valid.reshape(b, c // block_size, block_size).sum(-1)
        mean = jnp.where(n > 0, s.sum(-1) / jnp.maximum(n, 1), -jnp.inf)
        q = jnp.arange(c // block_size)[None, :]
        window = self.recent_tokens(keep_blocks * block_size)
        recent = (q + 1) * block_size > (view.lengths - window)[:, None]
        mean = jnp.where(recent & (n > 0), jnp.inf, mean)
        order = jnp.lexsort((-q.astype(jnp.float32) * jnp.ones_like(mean), -mean), axis=-1)
        rank = jnp.argsort(order, axis=-1)
        return (n > 0) & (rank < keep_blocks[:, None])


def _first(order, k):
    """bool[..., C]: the columns among the first k[b] of each row's `order` (a permutation of
    the last axis; k i32[B] on the leading axis), marked by a scatter instead of a second sort
    (the inverse permutation's)."""
    ones = (1,) * (order.ndim - 1)
    first = jnp.arange(order.shape[-1]).reshape(ones + (-1,)) < k.reshape((-1,) + ones)
    lead = jnp.indices(order.shape, sparse=True)[:-1]
    return jnp.zeros(order.shape, bool).at[(*lead, order)].set(
        jnp.broadcast_to(first, order.shape))


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
