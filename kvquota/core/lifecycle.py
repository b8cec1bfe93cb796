"""Session lifecycle: idle <-> running, preemption (KV dropped, tokens archived, slot held),
slot recycling, and the grow-no-admit flag; each core beside the facade check of its inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvquota.codes import SEQ_FREE, SEQ_IDLE, SEQ_PREEMPTED, SEQ_RUNNING
from kvquota.core.cold import drop_cold
from kvquota.core.jit import donating_jit
from kvquota.core.release import drop_sequences
from kvquota.core.scatter import clip, materialize, oob
from kvquota.errors import InvalidArgumentError
from kvquota.reports import PreemptReport
from kvquota.sentinel import INVALID
from kvquota.validation import bucket, heirs_of_rows, int_scalar, pad, seq_batch


@donating_jit
def set_status_core(config, state, seq_ids, status):
    """Set the status (traced i8 scalar) of `seq_ids` (i32[B], INVALID = padding)."""
    rows = oob(seq_ids, seq_ids >= 0, config.max_seqs)
    return state.update(seq_status=state.seqs.seq_status.at[rows].set(
        status.astype(jnp.int8), mode="drop")), None


@donating_jit
def preempt_core(config, state, seq_rows, heir_rows):
    """Preempt `seq_rows` (i32[K], unique, INVALID = padding): archive each one's cached token
    ids (cache order) and logical position, drop its references like `free`, and keep the slot
    as PREEMPTED with its tenant (counted in the tenant's `preemptions`) until recycled."""
    p, mb, ns, ntn = config.block_size, config.max_blocks_per_seq, config.max_seqs, config.num_tenants
    valid = seq_rows >= 0
    rc = clip(seq_rows)
    ten = jnp.where(valid, state.seqs.seq_tenant[rc], INVALID)
    table = materialize(jnp.where(valid[:, None], state.seqs.block_tables[rc], INVALID))
    lens = jnp.where(valid, state.seqs.seq_lens[rc], 0)
    k = seq_rows.shape[0]
    ids = state.blocks.token_ids[clip(table)].reshape(k, mb * p)
    fill = jnp.where(table >= 0, state.blocks.fill[clip(table)], 0)
    # Cache order: block by block, each block's first `fill` slots (a token-evicted sequence
    # is packed, so this is its cache index order too): slot j goes to the number of filled
    # slots before it, the first `lens` of them kept.
    slot = (jnp.arange(p)[None, None, :] < fill[:, :, None]).reshape(k, mb * p)
    dest = jnp.cumsum(slot, axis=1, dtype=jnp.int32) - 1
    keep = slot & (dest < lens[:, None])
    archived = jnp.full((k, mb * p), INVALID, jnp.int32).at[
        jnp.arange(k)[:, None], jnp.where(keep, dest, mb * p)].set(ids, mode="drop")
    position = jnp.where(valid, state.seqs.positions[rc], 0)
    state, free = drop_sequences(config, state, seq_rows, heir_rows, reads=(fill,))
    rows = oob(seq_rows, valid, ns)
    state = state.update(
        seq_status=state.seqs.seq_status.at[rows].set(jnp.int8(SEQ_PREEMPTED), mode="drop"),
        seq_tenant=state.seqs.seq_tenant.at[rows].set(ten, mode="drop"),
        preemptions=state.tenants.preemptions.at[oob(ten, valid, ntn)].add(1, mode="drop"),
    )
    return state, PreemptReport(seq_ids=seq_rows, tenants=ten, lengths=lens, positions=position,
                                token_ids=archived, free=free)


@donating_jit
def recycle_core(config, state, seq_ids):
    """Return PREEMPTED slots `seq_ids` (i32[B], INVALID = padding) to the free slots."""
    rows = oob(seq_ids, seq_ids >= 0, config.max_seqs)
    return state.update(
        seq_status=state.seqs.seq_status.at[rows].set(jnp.int8(SEQ_FREE), mode="drop"),
        seq_tenant=state.seqs.seq_tenant.at[rows].set(INVALID, mode="drop"),
    ), None


@donating_jit
def set_growing_core(config, state, tenant, growing):
    """Set tenant's grow-no-admit flag (traced scalars)."""
    return state.update(growing=state.tenants.growing.at[tenant].set(growing)), None



# ---- the facade's checks ------------------------------------------------------------------------
def set_idle(config, state, seq_ids, *, donate=False):
    """Allocator.set_idle: RUNNING -> IDLE."""
    ids, _ = seq_batch(config, state, seq_ids, "set_idle", (SEQ_RUNNING,))
    return set_status_core(config, state, ids, np.int8(SEQ_IDLE), donate=donate)


def resume(config, state, seq_ids, *, donate=False):
    """Allocator.resume: IDLE -> RUNNING."""
    ids, _ = seq_batch(config, state, seq_ids, "resume", (SEQ_IDLE,))
    return set_status_core(config, state, ids, np.int8(SEQ_RUNNING), donate=donate)


def preempt(config, state, seq_ids, *, donate=False):
    """Allocator.preempt: running or idle sequences, each once."""
    _, real = seq_batch(config, state, seq_ids, "preempt", (SEQ_RUNNING, SEQ_IDLE))
    return preempt_core(config, state, pad(real, bucket(len(real))),
                        heirs_of_rows(config, state, real), donate=donate)


def rebalance(config, state, *, seq_ids=None, cold_blocks: int = 0, donate=False):
    """Allocator.rebalance: recycle PREEMPTED slots (`seq_ids`, default all), then drop up to
    `cold_blocks` cold cached blocks. Returns (state, what it moved)."""
    cold = int_scalar("cold_blocks", cold_blocks, InvalidArgumentError)
    if cold < 0:
        raise InvalidArgumentError(f"cold_blocks must be >= 0, got {cold}")
    if seq_ids is None:
        rows = np.flatnonzero(np.asarray(state.seqs.seq_status) == SEQ_PREEMPTED).astype(np.int32)
    else:
        rows, _ = seq_batch(config, state, seq_ids, "rebalance", (SEQ_PREEMPTED,))
        rows = rows[rows != INVALID]
    moved = dict(recycled_slots=int(len(rows)), cold_blocks_dropped=0)
    if len(rows):
        state, _ = recycle_core(config, state, pad(rows, bucket(len(rows))), donate=donate)
        donate = True
    if cold:
        state, rep = drop_cold(config, state, cold, donate=donate)
        moved["cold_blocks_dropped"] = int(rep.dropped_blocks)
    return state, moved
