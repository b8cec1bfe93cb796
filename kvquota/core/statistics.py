"""Attention statistics: the mass each cached token receives, accumulated per block slot, so
that "cold" (what compression and eviction policies take first) is measured, not guessed."""

from __future__ import annotations

import jax.numpy as jnp

from kvquota.core.scatter import clip, oob
from kvquota.state import KVState, StateConfig


def record_mass(config: StateConfig, state: KVState, seq_ids, mass):
    """Add mass f32[B, C] (column i = the token at cache index i of sequence seq_ids[b]; columns
    past the sequence's length are ignored) into `blocks.attn_mass`. seq_ids i32[B], unique,
    INVALID = padding. Returns (state, None)."""
    p, nb = config.block_size, config.total_blocks
    b, c = mass.shape
    valid = seq_ids >= 0
    sc = clip(seq_ids)
    i = jnp.arange(c, dtype=jnp.int32)[None, :]
    live = valid[:, None] & (i < state.seqs.seq_lens[sc][:, None])
    col = jnp.minimum(i // p, config.max_blocks_per_seq - 1)
    blk = jnp.take_along_axis(state.seqs.block_tables[sc], jnp.broadcast_to(col, (b, c)), axis=1)
    blk = oob(blk, live & (blk >= 0), nb)
    acc = state.blocks.attn_mass.at[blk, jnp.broadcast_to(i % p, (b, c))].add(
        jnp.where(live, mass.astype(jnp.float32), 0.0), mode="drop")
    return state.update(attn_mass=acc), None
