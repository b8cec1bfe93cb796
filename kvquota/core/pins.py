"""Pins: a pinned block stays resident and charged with no reference, and is never reclaimable."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvquota.core.jit import donating_jit
from kvquota.core.release import heir_inputs, settle
from kvquota.core.scatter import after, clip, oob
from kvquota.errors import (BlockStateError, DuplicateIdError, InputShapeError, TierError,
                            UnknownSequenceError)
from kvquota.reports import FreeReport, PinReport
from kvquota.sentinel import INVALID
from kvquota.state import KVState, StateConfig, pool_of
from kvquota.validation import heir_rows, int_array, int_scalar, live_ids

@donating_jit
def pin_core(config: StateConfig, state: KVState, block_ids):
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


@donating_jit
def unpin_core(config: StateConfig, state: KVState, block_ids, heir_rows):
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


# ---- the facade's checks ------------------------------------------------------------------------
def _blocks(config: StateConfig, block_ids, what: str):
    """(input rows i32[B], their real ids): in range, each at most once."""
    ids = int_array("block_ids", block_ids, 1)
    if ids.size == 0:
        raise InputShapeError("block_ids must have at least one row")
    real = ids[ids != INVALID]
    if ((real < 0) | (real >= config.total_blocks)).any():
        raise BlockStateError(f"{what}: block id outside [0, {config.total_blocks})")
    if len(np.unique(real)) != len(real):
        raise DuplicateIdError(f"{what}: a block appears twice in one call")
    return ids, real


def pin_blocks(config: StateConfig, state: KVState, block_ids, *, donate=False):
    """Allocator.pin_blocks: held device blocks only."""
    ids, real = _blocks(config, block_ids, "pin")
    host = config.host_pool
    if host is not None and real.size and (real >= config.pool_starts[host]).any():
        raise TierError("pin: a host-pool block cannot be pinned (restore it first); a pin "
                        "keeps a block resident on the device")
    if real.size:
        held = ((np.asarray(state.blocks.ref_count[real]) > 0)
                | (np.asarray(state.blocks.pin_count[real]) > 0))
        if not held.all():
            raise BlockStateError(f"pin: block {int(real[~held][0])} is free")
    return pin_core(config, state, ids, donate=donate)


def unpin_blocks(config: StateConfig, state: KVState, block_ids, *, donate=False):
    """Allocator.unpin_blocks: pinned blocks only; heirs of their payers' salts listed."""
    ids, real = _blocks(config, block_ids, "unpin")
    if real.size and (np.asarray(state.blocks.pin_count[real]) <= 0).any():
        bad = real[np.asarray(state.blocks.pin_count[real]) <= 0][0]
        raise BlockStateError(f"unpin: block {int(bad)} is not pinned")
    payers = np.asarray(state.blocks.payer[real]) if real.size else np.zeros(0, np.int32)
    heirs = heir_rows(config, state, np.asarray(state.tenants.salt)[payers], [])
    return unpin_core(config, state, ids, heirs, donate=donate)


def prefix_blocks(config: StateConfig, state: KVState, seq_id, num_blocks) -> np.ndarray:
    """The first `num_blocks` block ids of running sequence `seq_id` (pin_prefix's blocks)."""
    sid = int_scalar("seq_id", seq_id, UnknownSequenceError)
    if not 0 <= sid < config.max_seqs:
        raise UnknownSequenceError(f"sequence id {sid} outside [0, {config.max_seqs})")
    live_ids(config, state, np.array([sid], np.int32), "prefix")
    n = int_scalar("num_blocks", num_blocks, BlockStateError)
    have = -(-int(state.seqs.seq_lens[sid]) // config.block_size)
    if not 1 <= n <= have:
        raise BlockStateError(f"num_blocks {n} outside [1, {have}] for sequence {sid}")
    return np.asarray(state.seqs.block_tables[sid, :n])


def pin_prefix(config: StateConfig, state: KVState, seq_id, num_blocks, *, donate=False):
    """Allocator.pin_prefix: pin_blocks on the sequence's first `num_blocks` blocks."""
    blocks = prefix_blocks(config, state, seq_id, num_blocks)
    return pin_blocks(config, state, blocks, donate=donate)


def unpin_prefix(config: StateConfig, state: KVState, seq_id, num_blocks, *, donate=False):
    """Allocator.unpin_prefix: unpin_blocks on the sequence's first `num_blocks` blocks."""
    blocks = prefix_blocks(config, state, seq_id, num_blocks)
    return unpin_blocks(config, state, blocks, donate=donate)
