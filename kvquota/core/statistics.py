"""Attention statistics: the mass each cached token receives, accumulated per block slot, so
that "cold" (what compression and eviction policies take first) is measured, not guessed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvquota.core.jit import donating_jit
from kvquota.core.scatter import clip, oob
from kvquota.errors import DuplicateIdError, InputDtypeError, InputShapeError
from kvquota.state import KVState, StateConfig
from kvquota.validation import int_array, live_ids


@donating_jit
def record_mass_core(config: StateConfig, state: KVState, seq_ids, mass):
    """Add mass into the blocks' slots: f32[B, C] (column i = the token at cache index i of
    sequence seq_ids[b]; columns past the sequence's length are ignored) into `blocks.attn_mass`,
    or f32[B, L, Hkv, C] per layer and KV head into `blocks.head_mass` (when the state keeps it)
    and its sum into `attn_mass`. seq_ids i32[B], unique, INVALID = padding. Returns (state,
    None)."""
    p, nb = config.block_size, config.total_blocks
    b, c = mass.shape[0], mass.shape[-1]
    valid = seq_ids >= 0
    sc = clip(seq_ids)
    i = jnp.arange(c, dtype=jnp.int32)[None, :]
    live = valid[:, None] & (i < state.seqs.seq_lens[sc][:, None])
    col = jnp.minimum(i // p, config.max_blocks_per_seq - 1)
    blk = jnp.take_along_axis(state.seqs.block_tables[sc], jnp.broadcast_to(col, (b, c)), axis=1)
    at = (oob(blk, live & (blk >= 0), nb), jnp.broadcast_to(i % p, (b, c)))
    per_head = mass.ndim == 4
    total = mass.sum(axis=(1, 2)) if per_head else mass
    updates = dict(attn_mass=state.blocks.attn_mass.at[at].add(
        jnp.where(live, total.astype(jnp.float32), 0.0), mode="drop"))
    if per_head and state.blocks.head_mass.size:
        heads = jnp.moveaxis(mass.astype(jnp.float32), -1, 1)  # [B, C, L, Hkv]
        updates["head_mass"] = state.blocks.head_mass.at[at].add(
            jnp.where(live[..., None, None], heads, 0.0), mode="drop")
    return state.update(**updates), None


def record_attention(config: StateConfig, state: KVState, seq_ids, mass, *, donate=False):
    """Allocator.record_attention: mass f32[B, C <= max tokens] or f32[B, L, Hkv, C] (per layer
    and KV head), finite, >= 0; ids running, once."""
    ids = int_array("seq_ids", seq_ids, 1)
    m = np.asarray(mass)
    layers, heads = config.model.num_layers, config.model.num_kv_heads
    if m.ndim not in (2, 4) or m.shape[0] != ids.shape[0] or m.shape[-1] > \
            config.max_tokens_per_seq or (m.ndim == 4 and m.shape[1:3] != (layers, heads)):
        raise InputShapeError(f"mass must be [B={ids.shape[0]}, C <= "
                              f"{config.max_tokens_per_seq}] or [B, L={layers}, Hkv={heads}, C], "
                              f"got {m.shape}")
    if not np.issubdtype(m.dtype, np.floating) or not (np.isfinite(m) & (m >= 0)).all():
        raise InputDtypeError("mass must be finite, non-negative floats")
    real = live_ids(config, state, ids, "record_attention")
    if len(np.unique(real)) != len(real):
        raise DuplicateIdError("record_attention: a sequence appears twice in one call")
    return record_mass_core(config, state, ids, m.astype(np.float32), donate=donate)
