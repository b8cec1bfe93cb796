"""Pins: a pinned block stays resident and charged with no reference, and is never reclaimable."""

from __future__ import annotations

import jax.numpy as jnp

from kvquota.core.release import heir_inputs, settle
from kvquota.core.scatter import after, clip, oob
from kvquota.reports import FreeReport, PinReport
from kvquota.sentinel import INVALID
from kvquota.state import KVState, StateConfig, pool_of

def pin(config: StateConfig, state: KVState, block_ids):
    """Pin held blocks (i32[B], unique, INVALID = padding): pin_count + 1."""
    nb = config.total_blocks
    keep = block_ids >= 0
    bc = clip(block_ids)
    old_pin = state.blocks.pin_count[bc]
    first_pin = keep & (old_pin == 0)
    payer = state.blocks.payer[bc]
    pool = pool_of(config, bc)
    s = state
    state = s.update(
        pin_count=s.blocks.pin_count.at[after(oob(block_ids, keep, nb), old_pin)].add(1, mode="drop"),
        pinned_blocks=s.tenants.pinned_blocks.at[oob(payer, first_pin, config.num_tenants), pool].add(
            1, mode="drop"),
    )
    report = PinReport(
        pin_count=jnp.where(keep, state.blocks.pin_count[bc], 0),
        blocks_returned=jnp.zeros((config.num_pools,), jnp.int32),
        pool_bytes=config.pool_bytes,
    )
    return state, report


def unpin(config: StateConfig, state: KVState, block_ids, heir_rows):
    """Unpin pinned blocks (i32[B], unique, INVALID = padding): pin_count - 1; a block held by
    nothing any more returns to its pool, and an unpinned block its payer no longer references
    passes its charge on (see `_settle`)."""
    nb = config.total_blocks
    keep = block_ids >= 0
    bc = clip(block_ids)
    old_pin = state.blocks.pin_count[bc]
    last_pin = keep & (old_pin == 1)
    payer = state.blocks.payer[bc]
    pool = pool_of(config, bc)
    s = state
    state = s.update(
        pin_count=s.blocks.pin_count.at[after(oob(block_ids, keep, nb), old_pin)].add(-1, mode="drop"),
        pinned_blocks=s.tenants.pinned_blocks.at[oob(payer, last_pin, config.num_tenants), pool].add(
            -1, mode="drop"),
    )
    heirs = heir_inputs(s, heir_rows)
    state, rep = settle(config, state, jnp.where(keep, block_ids, INVALID), heirs, (payer,))
    report = FreeReport(
        seqs_freed=jnp.int32(0),
        tokens_released=jnp.zeros((config.num_tenants,), jnp.int32),
        unpinned_blocks=keep.sum().astype(jnp.int32),
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        host_blocks=config.host_blocks,
        host_watermark=config.host_watermark,
        **rep,
    )
    return state, report
