"""Dropping references (free, release a tenant, unpin) and settling what they leave: blocks held
by nothing return to their pool (or, under keep_cold_blocks, full cached pool-0 blocks stay in
the prefix cache as cold blocks), charges whose payer let go pass to an heir."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import (INT32_MAX, SEQ_FREE, SEQ_IDLE, SEQ_PREEMPTED, SEQ_RUNNING,
                           SEQ_SUSPENDED)
from kvquota.core.cold import stamp_cold
from kvquota.core.index import forget
from kvquota.core.jit import donating_jit
from kvquota.core.pages import scrub_blocks
from kvquota.core.scatter import after, clip, device_units, materialize, oob
from kvquota.errors import DoubleFreeError, InputDtypeError, InputShapeError
from kvquota.reports import FreeReport
from kvquota.sentinel import INVALID
from kvquota.state import pool_of
from kvquota.validation import (bucket, heir_rows, heirs_of_rows, int_array, live_ids, pad,
                                tenant_id)

def heir_inputs(state, heir_rows):
    """Entries i32[S] and tenants i32[S] of the table entries that may inherit charges, from
    `heir_rows` = (rows, cols) i32[S] (INVALID = padding; `validation.heir_rows`). None when
    the caller knows there is no candidate: then no table row beyond the freed ones is read."""
    if heir_rows is None:
        return None
    rows, cols = heir_rows
    ok = rows >= 0
    hent = jnp.where(ok, state.seqs.block_tables[clip(rows), clip(cols)], INVALID)
    return materialize(hent), jnp.where(ok, state.seqs.seq_tenant[clip(rows)], INVALID)


def settle(config, state, touched, heirs, reads=()):
    """After references or pins were dropped on `touched` blocks (i32[E], repeats and INVALID
    allowed): free the blocks no longer held, and pass the charge of blocks whose payer holds no
    reference any more to the remaining referencer with the lowest tenant id among `heirs`
    (entries and tenants of the candidate rows, read before any row was cleared).

    With `keep_cold_blocks`, a freed block that is in pool 0, full and hashed goes cold instead
    of onto the stack: it keeps its cache entry (hash, salt, token ids, parent, generation and
    pages, which scrub_on_free leaves alone), loses its payer and mass, and counts as returned.

    Everything is O(E + S) gathers and scatters (S: heir entries): nothing sorts and nothing is
    NB-sized.
    Repeated ids are resolved by letting every copy write its (negative) position into the
    block's `payer`, which is overwritten anyway for freed and orphaned blocks, and keeping the
    copy that won. `reads` are the caller's earlier reads of per-block arrays (payer, fill,
    generation) that settle's writes must wait for: without that order XLA copies the whole
    array to keep the old values (the donated-core HLO tests check it does not).
    """
    nb, ntn, npools = config.total_blocks, config.num_tenants, config.num_pools
    e = touched.shape[0]
    s = state
    valid = touched >= 0
    b = clip(touched)
    ref, pin, prefs, old_payer = s.blocks.ref_count[b], s.blocks.pin_count[b], s.blocks.payer_refs[b], s.blocks.payer[b]
    pool = pool_of(config, b)
    freed_e = valid & (ref == 0) & (pin == 0)
    orphan_e = valid & (ref > 0) & (pin == 0) & (prefs == 0)
    # One winner per distinct block among repeated entries.
    tag = -2 - jnp.arange(e, dtype=jnp.int32)
    payer = s.blocks.payer.at[after(oob(b, freed_e | orphan_e, nb), old_payer, reads)].set(
        tag, mode="drop")
    won = payer[b]
    first = (freed_e | orphan_e) & (won == tag)
    freed = freed_e & first
    orphan = orphan_e & first

    # Heirs: mark orphans (payer_refs = -1, payer = T), scatter-min the tenant of every heir-row
    # entry naming a marked block into its payer, then count the heir's own references.
    oi = oob(b, orphan, nb)
    payer = payer.at[after(oi, won)].set(ntn, mode="drop")
    payer_refs = s.blocks.payer_refs
    if heirs is not None:
        hent, htc = heirs
        payer_refs = payer_refs.at[after(oi, prefs)].set(-1, mode="drop")
        marked = payer_refs[clip(hent)]
        member = (hent >= 0) & (htc >= 0) & (marked == -1)
        payer = payer.at[oob(hent, member, nb)].min(htc, mode="drop")
        payer_refs = payer_refs.at[after(oi, marked)].set(0, mode="drop")
        heir_of_entry, heir = payer[clip(hent)], payer[b]
        mine = member & (heir_of_entry == htc)
        payer_refs = payer_refs.at[oob(hent, mine, nb)].add(1, mode="drop")
        payer_reads = (heir_of_entry, heir)
    else:
        heir = payer[b]
        payer_reads = (heir,)
    moved = orphan & (heir < ntn)
    payer = payer.at[after(oob(b, orphan & ~moved, nb), payer_reads)].set(
        old_payer, mode="drop")  # no heir found
    payer = payer.at[after(oob(b, freed, nb), payer_reads)].set(INVALID, mode="drop")

    # Cold blocks stay in the cache; the others are pushed, per pool, in entry order.
    if config.keep_cold_blocks:
        cold = (freed & (pool == 0) & s.blocks.hashed[b]
                & (s.blocks.fill[b] == config.block_size))
        pushed = freed & ~cold
    else:
        cold, pushed = None, freed
    onehot = (pool[:, None] == jnp.arange(npools)[None, :]) & pushed[:, None]
    rank = (jnp.cumsum(onehot.astype(jnp.int32), axis=0) - 1)[jnp.arange(e), pool]
    starts = jnp.asarray(config.pool_starts, jnp.int32)
    push_at = oob(starts[pool] + s.free.free_count[pool] + rank, pushed, nb)
    pushed_per_pool = onehot.sum(axis=0).astype(jnp.int32)
    returned = pushed_per_pool
    if cold is not None:
        returned = returned.at[0].add(cold.sum().astype(jnp.int32))

    units = jnp.asarray(config.pool_units, jnp.int32)[pool]
    dropped = freed | moved
    charged = (
        s.tenants.charged_blocks.at[oob(old_payer, dropped, ntn), pool].add(-1, mode="drop")
        .at[oob(heir, moved, ntn), pool].add(1, mode="drop")
    )
    zeros_t = jnp.zeros((ntn,), jnp.int32)
    released = zeros_t.at[oob(old_payer, dropped, ntn)].add(units, mode="drop")
    inherited = zeros_t.at[oob(heir, moved, ntn)].add(units, mode="drop")
    over = (inherited > 0) & ((charged * device_units(config)[None, :]).sum(axis=1) > s.tenants.byte_quota)
    fi = oob(b, freed, nb)
    pi = after(oob(b, pushed, nb), reads)  # freed blocks that leave the cache (all without
    # cold cached blocks), written after the caller's reads
    updates = dict(
        payer=payer,
        payer_refs=payer_refs.at[fi].set(0, mode="drop"),
        fill=s.blocks.fill.at[pi].set(0, mode="drop"),
        block_hash=s.blocks.block_hash.at[pi].set(jnp.uint32(0), mode="drop"),
        hashed=s.blocks.hashed.at[pi].set(False, mode="drop"),
        block_salt=s.blocks.block_salt.at[pi].set(jnp.uint32(0), mode="drop"),
        parent=s.blocks.parent.at[pi].set(INVALID, mode="drop"),
        parent_gen=s.blocks.parent_gen.at[pi].set(0, mode="drop"),
        generation=s.blocks.generation.at[pi].add(1, mode="drop"),
        attn_mass=s.blocks.attn_mass.at[fi].set(0.0, mode="drop"),
        head_mass=s.blocks.head_mass.at[fi].set(0.0, mode="drop"),
        free_list=s.free.free_list.at[push_at].set(b, mode="drop"),
        free_count=s.free.free_count + pushed_per_pool,
        charged_blocks=charged,
    )
    if cold is not None:
        updates.update(stamp_cold(config, s, b, cold))
    state = forget(config, s.update(**updates), pi)  # pushed blocks leave the prefix index
    if config.scrub_on_free:
        state = state.replace(pages=scrub_blocks(config, s.pages, b, pushed))
    host_used = (config.pool_sizes[config.host_pool] - state.free.free_count[config.host_pool]
                 if config.host_pool is not None else jnp.int32(0))
    return state, dict(
        host_blocks_used=jnp.asarray(host_used, jnp.int32),
        blocks_returned=returned,
        quota_units_released=released,
        transferred_blocks=moved.sum().astype(jnp.int32),
        inherited_units=inherited,
        heir_over_quota=over,
    )


def seq_rows(state, seq_ids, cols=None):
    """(table rows i32[B, C], tenant column i32[B, C]) of `seq_ids`, INVALID for padding: the
    first C columns (None: all MB), which hold every entry of a row of ceil(len / P) <= C
    blocks (a table holds exactly its first ceil(len / P) entries: check_invariants)."""
    valid = seq_ids >= 0
    sc = clip(seq_ids)
    rows = jnp.where(valid[:, None], state.seqs.block_tables[sc, :cols], INVALID)
    ten = jnp.where(valid, state.seqs.seq_tenant[sc], INVALID)
    return rows, jnp.broadcast_to(ten[:, None], rows.shape)


def leaves_orphans(config, state, seq_ids, cols=None):
    """bool[]: would freeing `seq_ids` (i32[K], unique, INVALID = padding) leave an orphan, a
    block still referenced and unpinned whose payer then holds no reference of its own? Exactly
    `settle`'s orphan test after `drop_sequences` drops the rows' references, so when it is
    False the heir entries change nothing and the free may pass none. O(K x C log(K x C)) for
    rows of at most C (static, None: MB) blocks: each block's dropped references are counted
    by sorting the rows' entries."""
    entries, tenant = seq_rows(state, seq_ids, cols)
    live = entries >= 0
    b = clip(entries)
    own = live & (state.blocks.payer[b] == tenant)

    def dropped(mask):  # per entry: how many of the `mask` entries name its block
        keys = jnp.sort(jnp.where(mask, entries, INT32_MAX).ravel())
        e = entries.ravel()
        n = jnp.searchsorted(keys, e, side="right") - jnp.searchsorted(keys, e, side="left")
        return n.reshape(entries.shape)

    bl = state.blocks
    orphan = (live & (bl.pin_count[b] == 0) & (bl.ref_count[b] - dropped(live) > 0)
              & (bl.payer_refs[b] - dropped(own) == 0))
    return orphan.any()


def drop_sequences(config, state, seq_rows, heir_rows, unpin_tenant=None, unpin_slots=0,
                   cols=None, reads=()):
    """Free the sequences `seq_rows` (i32[K], unique, INVALID = padding): one reference dropped
    per block-table entry, read from the first `cols` columns (static: at least every row's
    ceil(len / P) blocks; None: all MB), so the work follows the blocks held. `heir_rows`
    ((rows, cols) i32[S]: table entries of live sequences disjoint from `seq_rows`) are the
    entries that may inherit charges.

    With `unpin_tenant` (a traced i32 scalar) and `unpin_slots` > 0 (static: an upper bound on that
    tenant's pinned blocks), also drops every pin on blocks charged to that tenant. `reads`: the
    caller's earlier reads of per-block arrays (see `settle`).
    """
    nb, ns, ntn = config.total_blocks, config.max_seqs, config.num_tenants
    valid = seq_rows >= 0
    rc = clip(seq_rows)
    ten = jnp.where(valid, state.seqs.seq_tenant[rc], INVALID)
    entries = materialize(jnp.where(valid[:, None], state.seqs.block_tables[rc, :cols],
                                    INVALID))  # K, C
    live = entries >= 0
    lens = jnp.where(valid, state.seqs.seq_lens[rc], 0)
    heirs = heir_inputs(state, heir_rows)
    payer_read = state.blocks.payer[clip(entries)]
    own = live & (payer_read == ten[:, None])
    rows = oob(seq_rows, valid, ns)
    s = state
    state = s.update(
        ref_count=s.blocks.ref_count.at[oob(entries, live, nb)].add(-1, mode="drop"),
        payer_refs=s.blocks.payer_refs.at[oob(entries, own, nb)].add(-1, mode="drop"),
        used_tokens=s.tenants.used_tokens.at[oob(ten, valid, ntn)].add(-lens, mode="drop"),
        block_tables=s.seqs.block_tables.at[after(rows, entries, heirs)].set(INVALID, mode="drop"),
        seq_lens=s.seqs.seq_lens.at[after(rows, lens)].set(0, mode="drop"),
        positions=s.seqs.positions.at[rows].set(0, mode="drop"),
        seq_tenant=s.seqs.seq_tenant.at[after(rows, ten, heirs)].set(INVALID, mode="drop"),
        seq_status=s.seqs.seq_status.at[rows].set(jnp.int8(SEQ_FREE), mode="drop"),
    )
    tokens_released = jnp.zeros((ntn,), jnp.int32).at[oob(ten, valid, ntn)].add(lens, mode="drop")
    touched = entries.ravel()
    unpinned = jnp.int32(0)
    reads = (payer_read,) + tuple(reads)
    if unpin_tenant is not None and unpin_slots > 0:
        state, pinned, payer_mask = unpin_all(config, state, unpin_tenant, unpin_slots)
        touched = jnp.concatenate([touched, pinned])
        unpinned = (pinned >= 0).sum().astype(jnp.int32)
        reads = reads + (payer_mask,)
    state, rep = settle(config, state, touched, heirs, reads)
    report = FreeReport(
        seqs_freed=valid.sum().astype(jnp.int32),
        tokens_released=tokens_released,
        unpinned_blocks=unpinned,
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        host_blocks=config.host_blocks,
        host_watermark=config.host_watermark,
        **rep,
    )
    return state, report


def unpin_all(config, state, tenant, slots):
    """Drop every pin on blocks charged to `tenant`; returns their ids (i32[slots], INVALID pad).

    Pinned blocks need not be in any block table, so they are found by one pass over the payer
    column (only when the caller asks to unpin and the tenant has pins).
    """
    nb = config.total_blocks
    mask = (state.blocks.payer == tenant) & (state.blocks.pin_count > 0)
    ids = jnp.nonzero(mask, size=slots, fill_value=INVALID)[0].astype(jnp.int32)
    keep = ids >= 0
    pool = pool_of(config, clip(ids))
    state = state.update(
        pin_count=state.blocks.pin_count.at[oob(ids, keep, nb)].set(0, mode="drop"),
        pinned_blocks=state.tenants.pinned_blocks.at[
            oob(jnp.full_like(ids, tenant), keep, config.num_tenants), pool
        ].add(-1, mode="drop"),
    )
    return state, ids, ids


drop_core = donating_jit(drop_sequences, static_argnames=("unpin_slots", "cols"))
_leaves_orphans = jax.jit(leaves_orphans, static_argnums=(0, 3))


# ---- the facade's checks ------------------------------------------------------------------------
def table_cols(config, state, ids) -> int:
    """Table columns holding every entry of sequences `ids` (a table holds exactly its first
    ceil(len / P) entries): 16 x a power of 4, at most max_blocks_per_seq, so a free reads the
    blocks its rows hold, not whole tables, in a few compiled sizes."""
    p, cols = config.block_size, 16
    held = int(np.max((np.asarray(state.seqs.seq_lens)[ids] + p - 1) // p, initial=0))
    while cols < held:
        cols *= 4
    return min(cols, config.max_blocks_per_seq)


def free(config, state, seq_ids, *, donate=False):
    """Allocator.free: each id live (not free) and given once; heirs listed only when the free
    orphans a shared block's charge (most frees do not: then no other row is read)."""
    ids = int_array("seq_ids", seq_ids, 1)
    if ids.size == 0:
        raise InputShapeError("seq_ids must have at least one row")
    real = live_ids(config, state, ids, "free", error=DoubleFreeError,
                    allowed=(SEQ_RUNNING, SEQ_SUSPENDED, SEQ_IDLE, SEQ_PREEMPTED))
    if len(np.unique(real)) != len(real):
        raise DoubleFreeError("free: a sequence appears twice in one call")
    rows, cols = pad(real, bucket(len(real))), table_cols(config, state, real)
    heirs = None
    if bool(_leaves_orphans(config, state, rows, cols)):
        heirs = heirs_of_rows(config, state, real)
    return drop_core(config, state, rows, heirs, None, 0, cols, donate=donate)


def release_inputs(config, state, tenant, unpin=False):
    """Host-side inputs of the jitted release: (tenant, its rows, heir rows, pin slots)."""
    t = tenant_id(config, state, tenant)
    rows = np.flatnonzero(np.asarray(state.seqs.seq_tenant) == t)
    heirs = heir_rows(config, state, np.asarray(state.tenants.salt)[[t]], rows)
    pinned = int(np.asarray(state.tenants.pinned_blocks)[t].sum()) if unpin else 0
    slots = bucket(pinned) if pinned else 0
    return t, pad(rows, bucket(len(rows))), heirs, slots


def release_tenant(config, state, tenant, *, unpin=False, donate=False):
    """Allocator.release_tenant: every sequence of the tenant dropped (and its pins, if asked)."""
    if not isinstance(unpin, bool):
        raise InputDtypeError(f"unpin must be a bool, got {unpin!r}")
    t, rows, heirs, slots = release_inputs(config, state, tenant, unpin)
    return drop_core(config, state, rows, heirs, np.int32(t) if slots else None, slots,
                     donate=donate)
