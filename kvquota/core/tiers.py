"""Moving a sequence's own blocks between pools, losslessly: offload to the host pool and restore.

A block is a sequence's *own* when only this sequence references it (ref_count 1), it is not
pinned and the sequence's tenant pays for it: moving it changes nothing any other sequence or
tenant sees. Shared and pinned blocks stay where they are. A move pops blocks from the target
pool, copies pages and per-block metadata, relinks the prefix chain (`parent`, `parent_gen`) of
the moved entries and of the entries that follow them, rewrites the table, then lets `settle`
free the old blocks (generation bumped, scrubbed under scrub_on_free, charge dropped).

Only exact full-precision device blocks are prefix-cache targets: a block offloaded to the host
is unhashed (its chain hash is kept, so a restore makes it a target again, with fresh parents,
unless its sequence lost tokens to eviction: then its K/V sit at shifted positions).
The host pool is read with host-placed indices and values cross memory spaces through explicit
`to_memory` transfers, so no gather or scatter mixes host and device memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import SEQ_IDLE, SEQ_RUNNING, SEQ_SUSPENDED
from kvquota.core.cold import allocatable, take_pool0
from kvquota.core.index import index_blocks
from kvquota.core.jit import donating_jit
from kvquota.core.release import seq_rows, settle
from kvquota.core.scatter import clip, oob
from kvquota.errors import PoolFullError, QuotaExceededError, TierError
from kvquota.pages import to_memory
from kvquota.reports import MoveReport
from kvquota.sentinel import INVALID
from kvquota.state import KVState, StateConfig, pool_of
from kvquota.validation import bucket, pad, seq_batch


def pop_blocks(config: StateConfig, state: KVState, take, pool: int):
    """Pop a block of `pool` (static) for every entry of `take` (bool[K]), in order: (ids i32[K],
    INVALID where not taken; how many; the state with the pool's counts lowered). Pool 0 pops
    go through `cold.take_pool0` (stack first, then least recently cold blocks); build on the
    returned state."""
    if pool == 0:
        return take_pool0(config, state, take)
    ti = take.astype(jnp.int32)
    rank = jnp.cumsum(ti) - ti
    top = config.pool_starts[pool] + state.free.free_count[pool] - 1
    ids = state.free.free_list[clip(top - rank)]
    n = ti.sum()
    state = state.update(free_count=state.free.free_count.at[pool].add(-n))
    return jnp.where(take, ids, INVALID), n, state


def _move_pages(config, pages, src_ids, dst_ids, mask, src_pool, dst_pool):
    """Copy the pages of blocks `src_ids` (in src_pool) to `dst_ids` (in dst_pool) where mask."""
    if not pages:
        return pages
    src_local = clip(jnp.where(mask, src_ids - config.pool_starts[src_pool], 0))
    dst_local = oob(dst_ids - config.pool_starts[dst_pool], mask, config.pool_sizes[dst_pool])
    src_host = src_pool == config.host_pool
    if src_host:  # gather from host memory with host-placed indices
        src_local = to_memory(src_local, host=True)
    moved = jax.tree.map(lambda a: a[:, :, src_local], pages[src_pool])
    moved = to_memory(moved, host=dst_pool == config.host_pool)
    dst = jax.tree.map(lambda a, m: a.at[:, :, dst_local].set(m, mode="drop"),
                       pages[dst_pool], moved)
    return tuple(dst if p == dst_pool else pp for p, pp in enumerate(pages))


def own_blocks(config: StateConfig, state: KVState, rows, tcol, pool: int):
    """bool[B, MB]: entries that are the sequence's own blocks (only it references them, not
    pinned, paid by its tenant) and sit in `pool`."""
    rc = clip(rows)
    blk = state.blocks
    return ((rows >= 0) & (pool_of(config, rc) == pool) & (blk.ref_count[rc] == 1)
            & (blk.pin_count[rc] == 0) & (blk.payer[rc] == tcol))


def relocate(config: StateConfig, state: KVState, seq_ids, move, src_pool: int, dst_pool: int,
             new_pages):
    """Give the entries `move` (bool[B, MB], own blocks of `seq_ids` in src_pool) new blocks
    popped from dst_pool: metadata copied, prefix chain relinked, table rewritten, charges moved,
    the old blocks freed by `settle`. `new_pages(pages, old_ids, new_ids, mask)` writes the moved
    blocks' pages into dst_pool (a copy, or a requantization). Returns (state, blocks moved per
    sequence i32[B], settle's figures)."""
    p, nb, ns, ntn = config.block_size, config.total_blocks, config.max_seqs, config.num_tenants
    b, mb = move.shape
    rows, tcol = seq_rows(state, seq_ids)
    rc = clip(rows)
    new_flat, _, state = pop_blocks(config, state, move.ravel(), dst_pool)
    blk = state.blocks
    new = jnp.where(move, new_flat.reshape(b, mb), rows)  # the table after the move
    prev_new = jnp.pad(new[:, :-1], ((0, 0), (1, 0)), constant_values=INVALID)
    prev_moved = jnp.pad(move[:, :-1], ((0, 0), (1, 0)))
    relink = oob(new, (rows >= 0) & (move | prev_moved), nb)
    dst, old = oob(new, move, nb), oob(rows, move, nb)
    per_seq = move.sum(axis=1).astype(jnp.int32)
    valid = seq_ids >= 0
    ten = tcol[:, 0]
    # Only exact full-precision device blocks of never-evicted sequences are lookup targets (an
    # evicted sequence's K/V sit at other positions than a prompt of its tokens would put them).
    sc = clip(seq_ids)
    target = (dst_pool == 0) & (state.seqs.positions[sc] == state.seqs.seq_lens[sc])[:, None]
    prev_gen = jnp.where(prev_new >= 0, blk.generation[clip(prev_new)], 0)
    s = state
    state = s.update(
        ref_count=blk.ref_count.at[dst].set(1, mode="drop").at[old].set(0, mode="drop"),
        payer_refs=blk.payer_refs.at[dst].set(1, mode="drop").at[old].set(0, mode="drop"),
        payer=blk.payer.at[dst].set(tcol, mode="drop"),
        fill=blk.fill.at[dst].set(blk.fill[rc], mode="drop"),
        token_ids=blk.token_ids.at[dst].set(blk.token_ids[rc], mode="drop"),
        attn_mass=blk.attn_mass.at[dst].set(blk.attn_mass[rc], mode="drop"),
        head_mass=blk.head_mass.at[dst].set(blk.head_mass[rc], mode="drop"),
        block_hash=blk.block_hash.at[dst].set(blk.block_hash[rc], mode="drop"),
        hashed=blk.hashed.at[dst].set((blk.fill[rc] == p) & target, mode="drop"),
        block_salt=blk.block_salt.at[dst].set(blk.block_salt[rc], mode="drop"),
        parent=blk.parent.at[relink].set(prev_new, mode="drop"),
        parent_gen=blk.parent_gen.at[relink].set(prev_gen, mode="drop"),
        block_tables=s.seqs.block_tables.at[oob(seq_ids, valid, ns)].set(new, mode="drop"),
        charged_blocks=s.tenants.charged_blocks.at[oob(ten, valid, ntn), dst_pool].add(
            per_seq, mode="drop"),
    )
    if s.pages:
        state = state.replace(pages=new_pages(s.pages, rows, new, move))
    state, rep = settle(config, state, jnp.where(move, rows, INVALID).ravel(), None,
                        reads=(prev_gen,))
    if dst_pool == 0:  # the moved blocks that are lookup targets join the prefix index
        state = index_blocks(config, state, dst.ravel())
    return state, per_seq, rep


def move_sequences(config: StateConfig, state: KVState, seq_ids, src_pool: int, dst_pool: int,
                   status: int):
    """Move the own blocks of `seq_ids` (i32[B], unique, INVALID = padding) that sit in
    `src_pool` to `dst_pool`, bit-exact, and set the sequences' status. The facade checked
    room and quota."""
    rows, tcol = seq_rows(state, seq_ids)
    move = own_blocks(config, state, rows, tcol, src_pool)
    copy = lambda pages, old, new, mask: _move_pages(  # noqa: E731
        config, pages, old, new, mask, src_pool, dst_pool)
    state, per_seq, rep = relocate(config, state, seq_ids, move, src_pool, dst_pool, copy)
    valid = seq_ids >= 0
    state = state.update(seq_status=state.seqs.seq_status.at[
        oob(seq_ids, valid, config.max_seqs)].set(jnp.int8(status), mode="drop"))
    report = MoveReport(
        moved_blocks=per_seq,
        blocks_returned=rep["blocks_returned"],
        quota_units_released=rep["quota_units_released"],
        host_blocks_used=rep["host_blocks_used"],
        src_pool=src_pool,
        dst_pool=dst_pool,
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        host_blocks=config.host_blocks,
        host_watermark=config.host_watermark,
        host_bandwidth=config.host_bandwidth,
    )
    return state, report


@donating_jit
def offload_core(config: StateConfig, state: KVState, seq_ids):
    """Offload the own device blocks of running sequences to the host pool (SUSPENDED)."""
    return move_sequences(config, state, seq_ids, 0, config.host_pool, SEQ_SUSPENDED)


@donating_jit
def restore_core(config: StateConfig, state: KVState, seq_ids):
    """Bring suspended sequences' host blocks back into pool 0, bit-exact (RUNNING)."""
    return move_sequences(config, state, seq_ids, config.host_pool, 0, SEQ_RUNNING)


@functools.partial(jax.jit, static_argnums=(0, 3))
def own_count(config: StateConfig, state: KVState, seq_ids, pool: int):
    """i32[B]: own blocks of each sequence in `pool`, by the rule the move cores apply (seq_ids
    padded with INVALID to a power of two by the callers: one compile per size bucket)."""
    return own_blocks(config, state, *seq_rows(state, seq_ids), pool).sum(axis=1)


# ---- the facade's checks ------------------------------------------------------------------------
def _moves(config: StateConfig, state: KVState, seq_ids, what: str, allowed):
    """`seq_batch` for a move to or from the host pool, which must exist."""
    if config.host_pool is None:
        raise TierError(f"{what}: this config has no host pool (host_blocks=0)")
    return seq_batch(config, state, seq_ids, what, allowed)


def _move(core, config: StateConfig, state: KVState, rows, donate):
    """A move core on `rows` padded with INVALID to a power of two (a reclaim suspends a
    different number of sequences each time: one compile per size bucket, not per count); the
    report's rows are the input's."""
    state, report = core(config, state, pad(rows, bucket(len(rows))), donate=donate)
    # Cut on the host: slicing the device array would compile a program per row count.
    return state, report.replace(moved_blocks=np.asarray(report.moved_blocks)[:len(rows)])


def offload(config: StateConfig, state: KVState, seq_ids, *, donate=False):
    """Allocator.offload: running or idle sequences; room in the host pool for their own blocks."""
    rows, real = _moves(config, state, seq_ids, "offload", (SEQ_RUNNING, SEQ_IDLE))
    need = int(np.asarray(own_count(config, state, pad(real, bucket(len(real))), 0)).sum())
    room = int(allocatable(config, state, xp=np)[config.host_pool])
    if need > room:
        raise PoolFullError(f"offload: {need} blocks to move, the host pool has {room} free")
    return _move(offload_core, config, state, rows, donate)


def restore(config: StateConfig, state: KVState, seq_ids, *, donate=False):
    """Allocator.restore: suspended sequences; room in pool 0 and under each tenant's byte quota
    (every device pool's charges count, as at admission; the blocks land in pool 0)."""
    c = config
    rows, real = _moves(c, state, seq_ids, "restore", (SEQ_SUSPENDED,))
    per_row = np.asarray(own_count(c, state, pad(real, bucket(len(real))), c.host_pool))
    per_row = per_row[:len(real)]  # padding rows own nothing
    ten = np.asarray(state.seqs.seq_tenant)[real]
    room = int(allocatable(c, state, xp=np)[0])
    if int(per_row.sum()) > room:
        raise PoolFullError(f"restore: {int(per_row.sum())} blocks to bring back, pool 0 has "
                            f"{room} free")
    charged = np.asarray(state.tenants.charged_blocks).astype(np.int64)
    units = (charged * np.asarray(c.pool_units) * np.asarray(c.device_pools)).sum(axis=1)
    quota = np.asarray(state.tenants.byte_quota).astype(np.int64)
    for t in np.unique(ten):
        after = units[t] + int(per_row[ten == t].sum()) * c.pool_units[0]
        if after > quota[t]:
            raise QuotaExceededError(
                f"restore: tenant {int(t)} would hold {after * c.unit_bytes} B of device "
                f"blocks, over its byte quota of {int(quota[t]) * c.unit_bytes} B")
    return _move(restore_core, c, state, rows, donate)
