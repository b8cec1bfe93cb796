"""Jitted, branch-free cores of the state operations: `core(config, state, ...) -> (state, report)`.

Inputs are assumed valid (the facade in `kvquota.allocator` checks them first); padding rows use
INVALID. Each core only touches the rows it is given: updates are scatters of O(batch x MB)
elements, so with the state donated XLA updates the large per-block arrays in place. Scatters
route INVALID indices to an out-of-bounds index with `mode="drop"` (JAX wraps -1 to the last
element even under "drop").

Admission and append decide sequentially over the batch (a `lax.scan` over B small counters), so
row i sees the quota and pool use of rows < i and a refusal allocates nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvquota._reports import (
    AdmitReport,
    AppendReport,
    ForkReport,
    FreeReport,
    Ledger,
    PinReport,
    TenantReport,
)
from kvquota.sentinel import INVALID
from kvquota.state import (
    OK,
    REFUSED_BYTE_QUOTA,
    REFUSED_NO_SEQ_SLOT,
    REFUSED_POOL_FULL,
    REFUSED_SEQ_FULL,
    REFUSED_TOKEN_QUOTA,
    SEQ_FREE,
    SEQ_RUNNING,
    SKIPPED_PADDING,
    KVState,
    StateConfig,
    block_hash,
    pool_of,
    salt_root,
)


def _oob(idx, keep, n):
    """`idx` where `keep`, else the out-of-bounds index n (dropped by mode="drop" scatters)."""
    return jnp.where(keep, idx, n)


def _clip(idx):
    """A safe gather index for entries that may be INVALID (results must be masked)."""
    return jnp.maximum(idx, 0)


def _device_units(config: StateConfig):
    """i32[POOLS]: units per block of each pool, 0 for pools outside the byte quota (host)."""
    return jnp.asarray(
        [u if dev else 0 for u, dev in zip(config.pool_units, config.device_pools)], jnp.int32
    )


def _charged_units(config, state):
    """i32[T]: device-resident units charged to each tenant."""
    return (state.charged_blocks * _device_units(config)[None, :]).sum(axis=1)


def _decide(config, state, tenant, valid, need_tokens, need_blocks, need_slot, seq_full):
    """Sequential admission decisions over a batch: (ok bool[B], reason i32[B]).

    Row i is checked against the ledger as left by the accepted rows before it, in this order:
    padding, table full, token quota, byte quota, pool 0 free blocks, sequence slots.
    """
    unit0 = config.pool_units[0]
    slots0 = (state.seq_status == SEQ_FREE).sum().astype(jnp.int32)

    def step(carry, row):
        free0, used, charged, slots = carry
        t, v, ntok, nblk, full = row
        tc = _clip(t)
        reason = jnp.where(
            ~v, SKIPPED_PADDING,
            jnp.where(full, REFUSED_SEQ_FULL,
            jnp.where(ntok > state.token_quota[tc] - used[tc], REFUSED_TOKEN_QUOTA,
            jnp.where(nblk * unit0 > state.byte_quota[tc] - charged[tc], REFUSED_BYTE_QUOTA,
            jnp.where(nblk > free0, REFUSED_POOL_FULL,
            jnp.where(need_slot & (slots < 1), REFUSED_NO_SEQ_SLOT, OK))))))
        ok = reason == OK
        oki = ok.astype(jnp.int32)
        carry = (
            free0 - nblk * oki,
            used.at[tc].add(ntok * oki),
            charged.at[tc].add(nblk * unit0 * oki),
            slots - (oki if need_slot else 0),
        )
        return carry, (ok, reason.astype(jnp.int32))

    init = (state.free_count[0], state.used_tokens, _charged_units(config, state), slots0)
    _, (ok, reason) = lax.scan(step, init, (tenant, valid, need_tokens, need_blocks, seq_full))
    return ok, reason


def _pop_pool0(state, take):
    """Block ids for rows with `take` (bool[B]) popped in row order from pool 0's stack."""
    take_i = take.astype(jnp.int32)
    rank = jnp.cumsum(take_i) - take_i
    ids = state.free_list[_clip(state.free_count[0] - 1 - rank)]
    return jnp.where(take, ids, INVALID), take_i.sum()


def _free_slots(state, ok):
    """Sequence slot for each accepted row: the j-th accepted row gets the j-th free slot."""
    b = ok.shape[0]
    free = jnp.nonzero(state.seq_status == SEQ_FREE, size=b, fill_value=INVALID)[0]
    oki = ok.astype(jnp.int32)
    rank = jnp.cumsum(oki) - oki
    return jnp.where(ok, free[jnp.minimum(rank, b - 1)], INVALID).astype(jnp.int32)


# ---- prefix lookup ----------------------------------------------------------------------------
def _candidates(config, state, hashes, salts, tokens):
    """Up to C blocks per query whose hash, salt and token ids all match: i32[Q, C].

    hashes u32[Q, 2], salts u32[Q], tokens i32[Q, P]. Cost O(Q * NB): a brute-force join that is
    exact and simple; sizes here are serving-step sizes (Q = batch x prompt blocks).
    """
    eq = (
        (state.block_hash[None, :, 0] == hashes[:, 0:1])
        & (state.block_hash[None, :, 1] == hashes[:, 1:2])
        & (state.block_salt[None, :] == salts[:, None])
        & state.hashed[None, :]
    )
    nb = state.ref_count.shape[0]
    cols = jnp.arange(nb, dtype=jnp.int32)[None, :]
    found = []
    for _ in range(config.lookup_candidates):
        idx = jnp.argmax(eq, axis=1).astype(jnp.int32)
        hit = jnp.take_along_axis(eq, idx[:, None], axis=1)[:, 0]
        same = (state.token_ids[idx] == tokens).all(axis=1)
        found.append(jnp.where(hit & same, idx, INVALID))
        eq = eq & (cols != idx[:, None])
    return jnp.stack(found, axis=1)


def _lookup(config, state, salts, hashes, tokens, usable):
    """Leading prefix-cache hits of each prompt: i32[B, M] (INVALID after the first miss).

    A candidate for block k is accepted only if its parent is the hit for block k - 1 (and that
    parent has not been freed and reused since: `parent_gen`), so the whole prefix is checked
    token by token, not just the last block, and a hash collision never yields a wrong block.
    """
    b, m = usable.shape
    cands = _candidates(
        config, state, hashes.reshape(b * m, 2), jnp.repeat(salts, m),
        tokens.reshape(b * m, -1),
    ).reshape(b, m, -1)

    def step(carry, xs):
        prev, alive = carry
        cand, use = xs  # i32[B, C], bool[B]
        cc = _clip(cand)
        prev_c = _clip(prev)
        parent_ok = jnp.where(
            prev[:, None] < 0,
            state.parent[cc] == INVALID,
            (state.parent[cc] == prev[:, None])
            & (state.parent_gen[cc] == state.generation[prev_c][:, None]),
        )
        good = (cand >= 0) & parent_ok
        first = jnp.argmax(good, axis=1)
        chosen = jnp.take_along_axis(cand, first[:, None], axis=1)[:, 0]
        alive = alive & good.any(axis=1) & use
        hit = jnp.where(alive, chosen, INVALID)
        return (hit, alive), hit

    init = (jnp.full((b,), INVALID, jnp.int32), jnp.ones((b,), bool))
    _, hits = lax.scan(step, init, (jnp.swapaxes(cands, 0, 1), usable.T))
    return hits.T


def _chain_hashes(config, salts, blocks):
    """u32[B, M, 2] chained hashes of every block of a batch (blocks i32[B, M, P])."""
    root = salt_root(salts, config.hash_bits)

    def step(prev, blk):
        h = block_hash(prev, blk, config.hash_bits)
        return h, h

    _, hs = lax.scan(step, root, jnp.swapaxes(blocks, 0, 1))
    return jnp.swapaxes(hs, 0, 1)


# ---- admit ------------------------------------------------------------------------------------
def admit(config: StateConfig, state: KVState, tenants, tokens, lengths):
    """Admit prompts: tenants i32[B] (INVALID = padding), tokens i32[B, Tmax], lengths i32[B]."""
    p, mb, nb = config.block_size, config.max_blocks_per_seq, config.total_blocks
    b, tmax = tokens.shape
    m = -(-tmax // p)
    valid = tenants >= 0
    tc = _clip(tenants)
    lengths = jnp.where(valid, lengths, 0)
    pos = jnp.arange(m * p, dtype=jnp.int32)
    padded = jnp.pad(tokens, ((0, 0), (0, m * p - tmax)))
    padded = jnp.where(pos[None, :] < lengths[:, None], padded, INVALID)
    blocks = padded.reshape(b, m, p)
    salts = state.salt[tc]
    hashes = _chain_hashes(config, salts, blocks)

    k = jnp.arange(m, dtype=jnp.int32)[None, :]
    # Hit at most (length - 1) // P full blocks: the last prompt token is always computed so the
    # model has logits to sample from.
    usable = (k < ((lengths - 1) // p)[:, None]) & valid[:, None]
    hits = _lookup(config, state, salts, hashes, blocks, usable)
    nhit = (hits >= 0).sum(axis=1).astype(jnp.int32)
    nblk = (lengths + p - 1) // p
    nnew = nblk - nhit

    ok, reason = _decide(config, state, tenants, valid, lengths, nnew, True,
                         jnp.zeros((b,), bool))
    slot = _free_slots(state, ok)
    oki = ok.astype(jnp.int32)
    new_rank = jnp.cumsum(nnew * oki) - nnew * oki
    free0 = state.free_count[0]

    # Table rows [B, MB]: hits, then popped blocks, then INVALID.
    kk = jnp.arange(mb, dtype=jnp.int32)[None, :]
    hits_mb = jnp.pad(hits, ((0, 0), (0, mb - m)), constant_values=INVALID)
    is_hit = kk < nhit[:, None]
    is_new = (kk >= nhit[:, None]) & (kk < nblk[:, None]) & ok[:, None]
    pop_idx = free0 - 1 - (new_rank[:, None] + kk - nhit[:, None])
    popped = state.free_list[jnp.clip(pop_idx, 0, nb - 1)]
    rows = jnp.where(is_hit, hits_mb, jnp.where(is_new, popped, INVALID))
    rows = jnp.where(ok[:, None], rows, INVALID)

    # Per-entry data of the new blocks (entries k < m only; k >= m is never new since nblk <= m).
    tcol = jnp.broadcast_to(tc[:, None], (b, mb))
    entry = _oob(rows, rows >= 0, nb)
    new_ids = _oob(rows, is_new, nb)
    hit_own = state.payer[_clip(rows)] == tcol
    prev = jnp.pad(rows[:, :-1], ((0, 0), (1, 0)), constant_values=INVALID)
    fill = jnp.clip(lengths[:, None] - kk * p, 0, p)
    full = fill == p
    blocks_mb = jnp.pad(blocks, ((0, 0), (0, mb - m), (0, 0)), constant_values=INVALID)
    hashes_mb = jnp.pad(hashes, ((0, 0), (0, mb - m), (0, 0)))
    n_new_total = (nnew * oki).sum()

    s = state
    state = s.replace(
        ref_count=s.ref_count.at[entry].add(1, mode="drop"),
        payer_refs=s.payer_refs.at[new_ids].set(1, mode="drop")
        .at[_oob(rows, is_hit & ok[:, None] & hit_own, nb)].add(1, mode="drop"),
        payer=s.payer.at[_after(new_ids, hit_own)].set(tcol, mode="drop"),
        fill=s.fill.at[new_ids].set(fill, mode="drop"),
        token_ids=s.token_ids.at[new_ids].set(blocks_mb, mode="drop"),
        block_hash=s.block_hash.at[new_ids].set(
            jnp.where(full[..., None], hashes_mb, jnp.uint32(0)), mode="drop"),
        hashed=s.hashed.at[new_ids].set(full, mode="drop"),
        block_salt=s.block_salt.at[new_ids].set(
            jnp.broadcast_to(salts[:, None], (b, mb)), mode="drop"),
        parent=s.parent.at[new_ids].set(prev, mode="drop"),
        parent_gen=s.parent_gen.at[new_ids].set(
            jnp.where(prev >= 0, s.generation[_clip(prev)], 0), mode="drop"),
        free_count=s.free_count.at[0].add(-n_new_total),
        block_tables=s.block_tables.at[_oob(slot, ok, config.max_seqs)].set(rows, mode="drop"),
        seq_lens=s.seq_lens.at[_oob(slot, ok, config.max_seqs)].set(lengths, mode="drop"),
        positions=s.positions.at[_oob(slot, ok, config.max_seqs)].set(lengths, mode="drop"),
        seq_tenant=s.seq_tenant.at[_oob(slot, ok, config.max_seqs)].set(tenants, mode="drop"),
        seq_status=s.seq_status.at[_oob(slot, ok, config.max_seqs)].set(
            jnp.int8(SEQ_RUNNING), mode="drop"),
        used_tokens=s.used_tokens.at[_oob(tc, ok, config.num_tenants)].add(lengths, mode="drop"),
        charged_blocks=s.charged_blocks.at[_oob(tc, ok, config.num_tenants), 0].add(
            nnew, mode="drop"),
    )
    report = AdmitReport(
        admitted=ok,
        reason=reason,
        seq_id=slot,
        cached_tokens=jnp.where(ok, nhit * p, 0),
        hit_blocks=jnp.where(ok, nhit, 0),
        new_blocks=jnp.where(ok, nnew, 0),
    )
    return state, report


# ---- append -----------------------------------------------------------------------------------
def append(config: StateConfig, state: KVState, seq_ids, tokens):
    """Append one decoded token to each sequence: seq_ids i32[B] (unique; INVALID = padding)."""
    p, mb, nb, ns = config.block_size, config.max_blocks_per_seq, config.total_blocks, config.max_seqs
    valid = seq_ids >= 0
    sc = _clip(seq_ids)
    t = jnp.where(valid, state.seq_tenant[sc], INVALID)
    tc = _clip(t)
    length = state.seq_lens[sc]
    k = length // p
    off = length % p
    need_new = (off == 0) & valid
    seq_full = valid & (k >= mb)
    ok, reason = _decide(config, state, t, valid, jnp.ones_like(seq_ids), need_new.astype(jnp.int32),
                         False, seq_full)
    alloc = ok & need_new
    newb, n_alloc = _pop_pool0(state, alloc)
    kc = jnp.minimum(k, mb - 1)
    prev = jnp.where(k > 0, state.block_tables[sc, jnp.maximum(kc - 1, 0)], INVALID)
    blk = jnp.where(need_new, newb, state.block_tables[sc, kc])
    blk = jnp.where(ok, blk, INVALID)
    bi = _oob(blk, ok, nb)
    ai = _oob(newb, alloc, nb)

    s = state
    # A freed block keeps stale token ids (unreachable: fill 0, not hashed); a new one starts
    # from an empty row.
    token_ids = s.token_ids.at[ai].set(INVALID, mode="drop").at[bi, off].set(tokens, mode="drop")
    # A block that becomes full joins the prefix cache, chained on its predecessor's hash.
    becomes_full = ok & (off == p - 1)
    salts = s.salt[tc]
    prev_hash = jnp.where((k > 0)[:, None], s.block_hash[_clip(prev)],
                          salt_root(salts, config.hash_bits))
    h = block_hash(prev_hash, token_ids[_clip(blk)], config.hash_bits)
    fi = _oob(blk, becomes_full, nb)
    rows = _oob(sc, ok, ns)
    state = s.replace(
        token_ids=token_ids,
        fill=s.fill.at[bi].add(1, mode="drop"),
        block_hash=s.block_hash.at[_after(fi, prev_hash)].set(h, mode="drop"),
        hashed=s.hashed.at[fi].set(True, mode="drop"),
        ref_count=s.ref_count.at[ai].set(1, mode="drop"),
        payer=s.payer.at[ai].set(t, mode="drop"),
        payer_refs=s.payer_refs.at[ai].set(1, mode="drop"),
        block_salt=s.block_salt.at[ai].set(salts, mode="drop"),
        parent=s.parent.at[ai].set(prev, mode="drop"),
        parent_gen=s.parent_gen.at[ai].set(
            jnp.where(prev >= 0, s.generation[_clip(prev)], 0), mode="drop"),
        free_count=s.free_count.at[0].add(-n_alloc),
        block_tables=s.block_tables.at[_after(_oob(sc, alloc, ns), prev, blk), kc].set(
            newb, mode="drop"),
        seq_lens=s.seq_lens.at[_after(rows, length)].add(1, mode="drop"),
        positions=s.positions.at[rows].add(1, mode="drop"),
        used_tokens=s.used_tokens.at[_oob(tc, ok, config.num_tenants)].add(1, mode="drop"),
        charged_blocks=s.charged_blocks.at[_oob(tc, alloc, config.num_tenants), 0].add(
            1, mode="drop"),
    )
    report = AppendReport(
        appended=ok, reason=reason, block=blk, offset=jnp.where(ok, off, INVALID), new_block=alloc
    )
    return state, report


# ---- fork -------------------------------------------------------------------------------------
def fork(config: StateConfig, state: KVState, seq_ids):
    """Fork each source sequence (i32[B], INVALID = padding) into a new slot of the same tenant.

    Full blocks are shared by reference; the partly filled last block is copied (token ids and,
    when pages exist, its K/V pages) so the child can append without touching the parent.
    """
    p, mb, nb, ns = config.block_size, config.max_blocks_per_seq, config.total_blocks, config.max_seqs
    b = seq_ids.shape[0]
    valid = seq_ids >= 0
    sc = _clip(seq_ids)
    t = jnp.where(valid, state.seq_tenant[sc], INVALID)
    tc = _clip(t)
    length = jnp.where(valid, state.seq_lens[sc], 0)
    nblk = (length + p - 1) // p
    partial = valid & (length % p != 0)
    ok, reason = _decide(config, state, t, valid, length, partial.astype(jnp.int32), True,
                         jnp.zeros((b,), bool))
    slot = _free_slots(state, ok)
    alloc = ok & partial
    newb, n_alloc = _pop_pool0(state, alloc)
    src_rows = state.block_tables[sc]
    last = nblk - 1
    oldb = jnp.where(alloc, src_rows[jnp.arange(b), jnp.maximum(last, 0)], INVALID)
    kk = jnp.arange(mb, dtype=jnp.int32)[None, :]
    is_copy = alloc[:, None] & (kk == last[:, None])
    rows = jnp.where(is_copy, newb[:, None], src_rows)
    rows = jnp.where(ok[:, None], rows, INVALID)
    shared = ok[:, None] & (rows >= 0) & ~is_copy
    own = state.payer[_clip(rows)] == tc[:, None]
    ai = _oob(newb, alloc, nb)
    oc = _clip(oldb)

    s = state
    updates = dict(
        ref_count=s.ref_count.at[_oob(rows, shared, nb)].add(1, mode="drop")
        .at[ai].set(1, mode="drop"),
        payer_refs=s.payer_refs.at[_oob(rows, shared & own, nb)].add(1, mode="drop")
        .at[ai].set(1, mode="drop"),
        payer=s.payer.at[_after(ai, own)].set(t, mode="drop"),
        fill=s.fill.at[ai].set(s.fill[oc], mode="drop"),
        token_ids=s.token_ids.at[ai].set(s.token_ids[oc], mode="drop"),
        block_salt=s.block_salt.at[ai].set(s.block_salt[oc], mode="drop"),
        parent=s.parent.at[ai].set(s.parent[oc], mode="drop"),
        parent_gen=s.parent_gen.at[ai].set(s.parent_gen[oc], mode="drop"),
        free_count=s.free_count.at[0].add(-n_alloc),
        block_tables=s.block_tables.at[_after(_oob(slot, ok, ns), src_rows, rows, oldb, own)].set(
            rows, mode="drop"),
        seq_lens=s.seq_lens.at[_after(_oob(slot, ok, ns), length)].set(length, mode="drop"),
        positions=s.positions.at[_oob(slot, ok, ns)].set(s.positions[sc], mode="drop"),
        seq_tenant=s.seq_tenant.at[_oob(slot, ok, ns)].set(t, mode="drop"),
        seq_status=s.seq_status.at[_oob(slot, ok, ns)].set(jnp.int8(SEQ_RUNNING), mode="drop"),
        used_tokens=s.used_tokens.at[_oob(tc, ok, config.num_tenants)].add(length, mode="drop"),
        charged_blocks=s.charged_blocks.at[_oob(tc, alloc, config.num_tenants), 0].add(
            1, mode="drop"),
    )
    if s.k_pages is not None:
        updates["k_pages"] = s.k_pages.at[:, :, ai].set(s.k_pages[:, :, oc], mode="drop")
        updates["v_pages"] = s.v_pages.at[:, :, ai].set(s.v_pages[:, :, oc], mode="drop")
    state = s.replace(**updates)
    report = ForkReport(forked=ok, reason=reason, seq_id=slot, copied_from=oldb, copied_to=newb)
    return state, report


# ---- dropping references: free, release, unpin ------------------------------------------------
def _after(index, *reads):
    """`index`, made data-dependent on `reads` (earlier reads of the array it will scatter into).

    An in-place scatter must run after every read of the array's old value. Unless the scatter's
    indices depend on those reads, XLA cannot order them and its copy insertion protects the
    reads by copying the whole (NB-sized) array, which defeats donation. The dependency is the
    condition min(x) <= max(x): true for any integer or bool array, but not foldable by XLA.
    (`lax.optimization_barrier` does not help: XLA:CPU expands it before copy insertion.)
    """
    ok = jnp.bool_(True)
    for x in jax.tree_util.tree_leaves(reads):
        if x.size:
            ok = ok & (jnp.min(x) <= jnp.max(x))
    return jnp.where(ok, index, jnp.iinfo(jnp.int32).max)


def _heir_inputs(state, heir_rows):
    """Entries i32[R, MB] and tenants i32[R, MB] of the rows that may inherit charges (None when
    the caller knows there is no candidate: then no table row beyond the freed ones is read)."""
    if heir_rows is None:
        return None
    hr = _clip(heir_rows)
    hten = jnp.where(heir_rows >= 0, state.seq_tenant[hr], INVALID)
    hent = state.block_tables[hr]
    return hent, jnp.broadcast_to(hten[:, None], hent.shape)


def _settle(config, state, touched, heirs, reads=()):
    """After references or pins were dropped on `touched` blocks (i32[E], repeats and INVALID
    allowed): free the blocks no longer held, and pass the charge of blocks whose payer holds no
    reference any more to the remaining referencer with the lowest tenant id among `heirs`
    (entries and tenants of the candidate rows, read before any row was cleared).

    Everything is O(E + R x MB) gathers and scatters: nothing sorts and nothing is NB-sized.
    Repeated ids are resolved by letting every copy write its (negative) position into the
    block's `payer`, which is overwritten anyway for freed and orphaned blocks, and keeping the
    copy that won. `reads` are earlier reads of `payer` the first write must wait for.
    """
    nb, ntn, npools = config.total_blocks, config.num_tenants, config.num_pools
    e = touched.shape[0]
    s = state
    valid = touched >= 0
    b = _clip(touched)
    ref, pin, prefs, old_payer = s.ref_count[b], s.pin_count[b], s.payer_refs[b], s.payer[b]
    pool = pool_of(config, b)
    freed_e = valid & (ref == 0) & (pin == 0)
    orphan_e = valid & (ref > 0) & (pin == 0) & (prefs == 0)
    # One winner per distinct block among repeated entries.
    tag = -2 - jnp.arange(e, dtype=jnp.int32)
    payer = s.payer.at[_after(_oob(b, freed_e | orphan_e, nb), old_payer, reads)].set(
        tag, mode="drop")
    won = payer[b]
    first = (freed_e | orphan_e) & (won == tag)
    freed = freed_e & first
    orphan = orphan_e & first

    # Heirs: mark orphans (payer_refs = -1, payer = T), scatter-min the tenant of every heir-row
    # entry naming a marked block into its payer, then count the heir's own references.
    oi = _oob(b, orphan, nb)
    payer = payer.at[_after(oi, won)].set(ntn, mode="drop")
    payer_refs = s.payer_refs
    if heirs is not None:
        hent, htc = heirs
        payer_refs = payer_refs.at[_after(oi, prefs)].set(-1, mode="drop")
        marked = payer_refs[_clip(hent)]
        member = (hent >= 0) & (htc >= 0) & (marked == -1)
        payer = payer.at[_oob(hent, member, nb)].min(htc, mode="drop")
        payer_refs = payer_refs.at[_after(oi, marked)].set(0, mode="drop")
        heir_of_entry, heir = payer[_clip(hent)], payer[b]
        mine = member & (heir_of_entry == htc)
        payer_refs = payer_refs.at[_oob(hent, mine, nb)].add(1, mode="drop")
        payer_reads = (heir_of_entry, heir)
    else:
        heir = payer[b]
        payer_reads = (heir,)
    moved = orphan & (heir < ntn)
    payer = payer.at[_after(_oob(b, orphan & ~moved, nb), payer_reads)].set(
        old_payer, mode="drop")  # no heir found
    payer = payer.at[_after(_oob(b, freed, nb), payer_reads)].set(INVALID, mode="drop")

    # Free-list push, per pool, in entry order.
    onehot = (pool[:, None] == jnp.arange(npools)[None, :]) & freed[:, None]
    rank = (jnp.cumsum(onehot.astype(jnp.int32), axis=0) - 1)[jnp.arange(e), pool]
    starts = jnp.asarray(config.pool_starts, jnp.int32)
    push_at = _oob(starts[pool] + s.free_count[pool] + rank, freed, nb)
    returned = onehot.sum(axis=0).astype(jnp.int32)

    units = jnp.asarray(config.pool_units, jnp.int32)[pool]
    dropped = freed | moved
    charged = (
        s.charged_blocks.at[_oob(old_payer, dropped, ntn), pool].add(-1, mode="drop")
        .at[_oob(heir, moved, ntn), pool].add(1, mode="drop")
    )
    zeros_t = jnp.zeros((ntn,), jnp.int32)
    released = zeros_t.at[_oob(old_payer, dropped, ntn)].add(units, mode="drop")
    inherited = zeros_t.at[_oob(heir, moved, ntn)].add(units, mode="drop")
    over = (inherited > 0) & ((charged * _device_units(config)[None, :]).sum(axis=1) > s.byte_quota)
    fi = _oob(b, freed, nb)
    updates = dict(
        payer=payer,
        payer_refs=payer_refs.at[fi].set(0, mode="drop"),
        fill=s.fill.at[fi].set(0, mode="drop"),
        block_hash=s.block_hash.at[fi].set(jnp.uint32(0), mode="drop"),
        hashed=s.hashed.at[fi].set(False, mode="drop"),
        block_salt=s.block_salt.at[fi].set(jnp.uint32(0), mode="drop"),
        parent=s.parent.at[fi].set(INVALID, mode="drop"),
        parent_gen=s.parent_gen.at[fi].set(0, mode="drop"),
        generation=s.generation.at[fi].add(1, mode="drop"),
        free_list=s.free_list.at[push_at].set(b, mode="drop"),
        free_count=s.free_count + returned,
        charged_blocks=charged,
    )
    if config.scrub_on_free and s.k_pages is not None:
        pi = _oob(b, freed & (pool == 0), nb)
        updates["k_pages"] = s.k_pages.at[:, :, pi].set(0, mode="drop")
        updates["v_pages"] = s.v_pages.at[:, :, pi].set(0, mode="drop")
    state = s.replace(**updates)
    return state, dict(
        blocks_returned=returned,
        quota_units_released=released,
        transferred_blocks=moved.sum().astype(jnp.int32),
        inherited_units=inherited,
        heir_over_quota=over,
    )


def drop_sequences(config, state, seq_rows, heir_rows, unpin_tenant=None, unpin_slots=0):
    """Free the sequences `seq_rows` (i32[K], unique, INVALID = padding): one reference dropped
    per block-table entry. `heir_rows` (i32[R], disjoint from `seq_rows`) are the live sequences
    that may inherit charges.

    With `unpin_tenant` (a traced i32 scalar) and `unpin_slots` > 0 (static: an upper bound on that
    tenant's pinned blocks), also drops every pin on blocks charged to that tenant.
    """
    nb, ns, ntn = config.total_blocks, config.max_seqs, config.num_tenants
    valid = seq_rows >= 0
    rc = _clip(seq_rows)
    ten = jnp.where(valid, state.seq_tenant[rc], INVALID)
    entries = jnp.where(valid[:, None], state.block_tables[rc], INVALID)  # [K, MB]
    live = entries >= 0
    lens = jnp.where(valid, state.seq_lens[rc], 0)
    heirs = _heir_inputs(state, heir_rows)
    payer_read = state.payer[_clip(entries)]
    own = live & (payer_read == ten[:, None])
    rows = _oob(seq_rows, valid, ns)
    s = state
    state = s.replace(
        ref_count=s.ref_count.at[_oob(entries, live, nb)].add(-1, mode="drop"),
        payer_refs=s.payer_refs.at[_oob(entries, own, nb)].add(-1, mode="drop"),
        used_tokens=s.used_tokens.at[_oob(ten, valid, ntn)].add(-lens, mode="drop"),
        block_tables=s.block_tables.at[_after(rows, entries, heirs)].set(INVALID, mode="drop"),
        seq_lens=s.seq_lens.at[_after(rows, lens)].set(0, mode="drop"),
        positions=s.positions.at[rows].set(0, mode="drop"),
        seq_tenant=s.seq_tenant.at[_after(rows, ten, heirs)].set(INVALID, mode="drop"),
        seq_status=s.seq_status.at[rows].set(jnp.int8(SEQ_FREE), mode="drop"),
    )
    tokens_released = jnp.zeros((ntn,), jnp.int32).at[_oob(ten, valid, ntn)].add(lens, mode="drop")
    touched = entries.ravel()
    unpinned = jnp.int32(0)
    reads = (payer_read,)
    if unpin_tenant is not None and unpin_slots > 0:
        state, pinned, payer_mask = _unpin_all(config, state, unpin_tenant, unpin_slots)
        touched = jnp.concatenate([touched, pinned])
        unpinned = (pinned >= 0).sum().astype(jnp.int32)
        reads = reads + (payer_mask,)
    state, rep = _settle(config, state, touched, heirs, reads)
    report = FreeReport(
        seqs_freed=valid.sum().astype(jnp.int32),
        tokens_released=tokens_released,
        unpinned_blocks=unpinned,
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        **rep,
    )
    return state, report


def _unpin_all(config, state, tenant, slots):
    """Drop every pin on blocks charged to `tenant`; returns their ids (i32[slots], INVALID pad).

    Pinned blocks need not be in any block table, so they are found by one pass over the payer
    column (only when the caller asks to unpin and the tenant has pins).
    """
    nb = config.total_blocks
    mask = (state.payer == tenant) & (state.pin_count > 0)
    ids = jnp.nonzero(mask, size=slots, fill_value=INVALID)[0].astype(jnp.int32)
    keep = ids >= 0
    pool = pool_of(config, _clip(ids))
    state = state.replace(
        pin_count=state.pin_count.at[_oob(ids, keep, nb)].set(0, mode="drop"),
        pinned_blocks=state.pinned_blocks.at[
            _oob(jnp.full_like(ids, tenant), keep, config.num_tenants), pool
        ].add(-1, mode="drop"),
    )
    return state, ids, ids


def pin(config: StateConfig, state: KVState, block_ids):
    """Pin held blocks (i32[B], unique, INVALID = padding): pin_count + 1."""
    nb = config.total_blocks
    keep = block_ids >= 0
    bc = _clip(block_ids)
    old_pin = state.pin_count[bc]
    first_pin = keep & (old_pin == 0)
    payer = state.payer[bc]
    pool = pool_of(config, bc)
    s = state
    state = s.replace(
        pin_count=s.pin_count.at[_after(_oob(block_ids, keep, nb), old_pin)].add(1, mode="drop"),
        pinned_blocks=s.pinned_blocks.at[_oob(payer, first_pin, config.num_tenants), pool].add(
            1, mode="drop"),
    )
    report = PinReport(
        pin_count=jnp.where(keep, state.pin_count[bc], 0),
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
    bc = _clip(block_ids)
    old_pin = state.pin_count[bc]
    last_pin = keep & (old_pin == 1)
    payer = state.payer[bc]
    pool = pool_of(config, bc)
    s = state
    state = s.replace(
        pin_count=s.pin_count.at[_after(_oob(block_ids, keep, nb), old_pin)].add(-1, mode="drop"),
        pinned_blocks=s.pinned_blocks.at[_oob(payer, last_pin, config.num_tenants), pool].add(
            -1, mode="drop"),
    )
    heirs = _heir_inputs(s, heir_rows)
    state, rep = _settle(config, state, jnp.where(keep, block_ids, INVALID), heirs, (payer,))
    report = FreeReport(
        seqs_freed=jnp.int32(0),
        tokens_released=jnp.zeros((config.num_tenants,), jnp.int32),
        unpinned_blocks=keep.sum().astype(jnp.int32),
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        **rep,
    )
    return state, report


# ---- tenants ----------------------------------------------------------------------------------
def set_tenant(config: StateConfig, state: KVState, tenant, token_quota, byte_quota_units,
               lease_expiry, salt):
    """Write one tenant's ledger row (register, quota change, lease change)."""
    t = tenant
    s = state
    state = s.replace(
        registered=s.registered.at[t].set(True),
        token_quota=s.token_quota.at[t].set(token_quota),
        byte_quota=s.byte_quota.at[t].set(byte_quota_units),
        lease_expiry=s.lease_expiry.at[t].set(lease_expiry),
        salt=s.salt.at[t].set(salt),
    )
    report = TenantReport(
        tokens_over=jnp.maximum(state.used_tokens[t] - token_quota, 0),
        units_over=jnp.maximum(_charged_units(config, state)[t] - byte_quota_units, 0),
        unit_bytes=config.unit_bytes,
    )
    return state, report


# ---- ledger view ------------------------------------------------------------------------------
def ledger(config: StateConfig, state: KVState) -> Ledger:
    """The per-tenant ledger, including the columns recomputed on demand from the tables:
    distinct blocks referenced but paid by others, reclaimable blocks, fragmentation."""
    nb, ntn, npools, p = config.total_blocks, config.num_tenants, config.num_pools, config.block_size
    s = state
    # Distinct (tenant, block) references: sort-merge over all table entries.
    ten = jnp.broadcast_to(s.seq_tenant[:, None], s.block_tables.shape).ravel()
    blk = s.block_tables.ravel()
    live = (blk >= 0) & (ten >= 0)
    ten = jnp.where(live, ten, ntn)
    blk = jnp.where(live, blk, nb)
    ten_s, blk_s = lax.sort((ten, blk), num_keys=2)
    first = (ten_s < ntn) & (
        (ten_s != jnp.pad(ten_s[:-1], (1, 0), constant_values=-1))
        | (blk_s != jnp.pad(blk_s[:-1], (1, 0), constant_values=-1))
    )
    bc = jnp.minimum(blk_s, nb - 1)
    others = first & (s.payer[bc] != ten_s)
    seg = jnp.where(others, ten_s * npools + pool_of(config, bc), ntn * npools)
    shared = jax.ops.segment_sum(others.astype(jnp.int32), seg, num_segments=ntn * npools + 1)
    shared = shared[:-1].reshape(ntn, npools)

    pools = pool_of(config, jnp.arange(nb))
    charged = s.payer >= 0
    recl = charged & (s.pin_count == 0) & (s.ref_count == s.payer_refs)
    seg = jnp.where(recl, s.payer * npools + pools, ntn * npools)
    reclaim = jax.ops.segment_sum(recl.astype(jnp.int32), seg, num_segments=ntn * npools + 1)
    reclaim = reclaim[:-1].reshape(ntn, npools)

    device = jnp.asarray(config.device_pools)[pools]
    slack = jnp.where(charged & device, p - s.fill, 0)
    frag = jax.ops.segment_sum(slack, jnp.where(charged & device, s.payer, ntn),
                               num_segments=ntn + 1)[:-1]
    return Ledger(
        used_tokens=s.used_tokens,
        token_quota=s.token_quota,
        byte_quota_units=s.byte_quota,
        charged_blocks=s.charged_blocks,
        pinned_blocks=s.pinned_blocks,
        shared_blocks=shared,
        reclaimable_blocks=reclaim,
        fragmentation=frag,
        free_blocks=s.free_count,
        pool_fragmentation=slack.sum().astype(jnp.int32),
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
    )


# ---- jitted entry points: undonated (default) and donating `state` ----------------------------
def _jit_pair(fn, static=(0,), extra_static=()):
    statics = tuple(static) + tuple(extra_static)
    plain = jax.jit(fn, static_argnums=statics)
    donated = jax.jit(fn, static_argnums=statics, donate_argnums=(1,))
    functools.update_wrapper(donated, fn)
    return plain, donated


admit_jit, admit_donated_jit = _jit_pair(admit)
append_jit, append_donated_jit = _jit_pair(append)
fork_jit, fork_donated_jit = _jit_pair(fork)
pin_jit, pin_donated_jit = _jit_pair(pin)
unpin_jit, unpin_donated_jit = _jit_pair(unpin)
drop_jit, drop_donated_jit = _jit_pair(drop_sequences, extra_static=(5,))
set_tenant_jit, set_tenant_donated_jit = _jit_pair(set_tenant)
ledger_jit = jax.jit(ledger, static_argnums=(0,))
