"""Admission, append and fork: the cores that give sequences blocks, under both meters, each
beside the facade check of its inputs.

Admission and append decide sequentially over the batch (a `lax.scan` over B small counters), so
row i sees the quota and pool use of rows < i and a refusal allocates nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from kvquota.codes import (
    OK,
    REFUSED_BYTE_QUOTA,
    REFUSED_GROWING,
    REFUSED_NO_SEQ_SLOT,
    REFUSED_POOL_FULL,
    REFUSED_SEQ_FULL,
    REFUSED_TOKEN_QUOTA,
    SEQ_FREE,
    SEQ_RUNNING,
    SKIPPED_PADDING,
)
from kvquota.core.cold import allocatable, revive_inputs, revivers, take_pool0
from kvquota.core.index import index_blocks
from kvquota.core.jit import donating_jit
from kvquota.core.pages import copy_blocks
from kvquota.core.prefix import chain_hashes, lookup
from kvquota.core.scatter import after, charged_units, clip, oob
from kvquota.hashing import block_hash, salt_root
from kvquota.reports import AdmitReport, AppendReport, ForkReport
from kvquota.sentinel import INVALID
from kvquota.errors import (DuplicateIdError, InputShapeError, SequenceTooLongError,
                            TokenIdError, UnknownTenantError)
from kvquota.state import KVState, StateConfig
from kvquota.validation import int_array, live_ids, tenant_id

def _decide(config, state, tenant, valid, need_tokens, need_blocks, need_slot, seq_full,
            revive=None):
    """Sequential admission decisions over a batch: (ok bool[B], reason i32[B]).

    Row i is checked against the ledger as left by the accepted rows before it, in this order:
    padding, table full, token quota, byte quota, pool 0 allocatable blocks (stack + cold),
    sequence slots. A tenant flagged `growing` (grow-no-admit) appends past its byte quota; its
    admissions and forks that would go over are refused as REFUSED_GROWING.

    `revive` = (cold_hit bool[B, M], group i32[B, M]) from `cold.revive_inputs`: a row's
    prefix hits on cold blocks that no accepted earlier row revived (none of its group) are
    charged to it and taken from pool 0's capacity, like new blocks (they were free capacity).
    """
    unit0 = config.pool_units[0]
    slots0 = (state.seqs.seq_status == SEQ_FREE).sum().astype(jnp.int32)

    def step(carry, row):
        free0, used, charged, slots = carry[:4]
        t, v, ntok, nblk, full = row[:5]
        if revive is not None:  # cold hits not revived by an accepted earlier row
            cold_i, group_i = row[5:]
            cols = jnp.arange(group_i.shape[0], dtype=jnp.int32)
            revived = carry[4][group_i, cols]  # by an accepted row of the entry's group
            nblk = nblk + (cold_i & ~revived).sum(dtype=jnp.int32)
        tc = clip(t)
        growing = state.tenants.growing[tc]
        over_bytes = nblk * unit0 > state.tenants.byte_quota[tc] - charged[tc]
        if not need_slot:  # appends of a growing tenant's survivors go past its byte quota
            over_bytes = over_bytes & ~growing
        reason = jnp.where(
            ~v, SKIPPED_PADDING,
            jnp.where(full, REFUSED_SEQ_FULL,
            jnp.where(ntok > state.tenants.token_quota[tc] - used[tc], REFUSED_TOKEN_QUOTA,
            jnp.where(over_bytes & growing, REFUSED_GROWING,
            jnp.where(over_bytes, REFUSED_BYTE_QUOTA,
            jnp.where(nblk > free0, REFUSED_POOL_FULL,
            jnp.where(need_slot & (slots < 1), REFUSED_NO_SEQ_SLOT, OK)))))))
        ok = reason == OK
        oki = ok.astype(jnp.int32)
        new_carry = (
            free0 - nblk * oki,
            used.at[tc].add(ntok * oki),
            charged.at[tc].add(nblk * unit0 * oki),
            slots - (oki if need_slot else 0),
        )
        if revive is not None:
            new_carry = new_carry + (carry[4].at[group_i, cols].set(revived | (cold_i & ok)),)
        return new_carry, (ok, reason.astype(jnp.int32))

    init = (allocatable(config, state)[0], state.tenants.used_tokens,
            charged_units(config, state), slots0)
    xs = (tenant, valid, need_tokens, need_blocks, seq_full)
    if revive is not None:
        init = init + (jnp.zeros(revive[0].shape, bool),)  # [group leader, column] revived
        xs = xs + revive
    _, (ok, reason) = lax.scan(step, init, xs)
    return ok, reason


def _free_slots(state, ok):
    """Sequence slot for each accepted row: the j-th accepted row gets the j-th free slot."""
    b = ok.shape[0]
    free = jnp.nonzero(state.seqs.seq_status == SEQ_FREE, size=b, fill_value=INVALID)[0]
    oki = ok.astype(jnp.int32)
    rank = jnp.cumsum(oki) - oki
    return jnp.where(ok, free[jnp.minimum(rank, b - 1)], INVALID).astype(jnp.int32)


@donating_jit
def admit_core(config: StateConfig, state: KVState, tenants, tokens, lengths):
    """Admit prompts: tenants i32[B] (INVALID = padding), tokens i32[B, Tmax], lengths i32[B]."""
    p, mb, nb = config.block_size, config.max_blocks_per_seq, config.total_blocks
    b, tmax = tokens.shape
    m = -(-tmax // p)
    valid = tenants >= 0
    tc = clip(tenants)
    lengths = jnp.where(valid, lengths, 0)
    pos = jnp.arange(m * p, dtype=jnp.int32)
    padded = jnp.pad(tokens, ((0, 0), (0, m * p - tmax)))
    padded = jnp.where(pos[None, :] < lengths[:, None], padded, INVALID)
    blocks = padded.reshape(b, m, p)
    salts = state.tenants.salt[tc]
    hashes = chain_hashes(config, salts, blocks)

    k = jnp.arange(m, dtype=jnp.int32)[None, :]
    # Hit at most (length - 1) // P full blocks: the last prompt token is always computed so the
    # model has logits to sample from.
    usable = (k < ((lengths - 1) // p)[:, None]) & valid[:, None]
    hits = lookup(config, state, salts, hashes, blocks, usable)
    nhit = (hits >= 0).sum(axis=1).astype(jnp.int32)
    nblk = (lengths + p - 1) // p
    nnew = nblk - nhit

    revive = revive_inputs(state, hits) if config.keep_cold_blocks else None
    ok, reason = _decide(config, state, tenants, valid, lengths, nnew, True,
                         jnp.zeros((b,), bool), revive)
    slot = _free_slots(state, ok)
    # Every per-entry update works on the prompt's m block columns (columns >= m are never hit
    # nor new since nblk <= m); only the table rows are padded to MB, so the cost follows the
    # prompt, not max_blocks_per_seq.
    tcol = jnp.broadcast_to(tc[:, None], (b, m))
    if revive is not None:
        # Cold hits of accepted rows are revived, each paid by the lowest accepted row hitting
        # it; they leave the LRU before any block is popped, so no pop can take them.
        rev, rev_tenant = revivers(*revive, ok, tenants)
        nrev = rev.sum(axis=1).astype(jnp.int32)
        state = state.update(
            cold_at=state.blocks.cold_at.at[oob(hits, rev, nb)].set(INVALID, mode="drop"),
            cold_count=state.free.cold_count - nrev.sum())
        hit_payer = jnp.where(revive[0], rev_tenant, state.blocks.payer[clip(hits)])
    else:
        rev, nrev = jnp.zeros((b, m), bool), jnp.zeros((b,), jnp.int32)
        hit_payer = state.blocks.payer[clip(hits)]

    # Table rows [B, m]: hits, then popped blocks, then INVALID.
    is_hit = k < nhit[:, None]
    is_new = (k >= nhit[:, None]) & (k < nblk[:, None]) & ok[:, None]
    popped, _, state = take_pool0(config, state, is_new)
    rows = jnp.where(is_hit, hits, jnp.where(is_new, popped, INVALID))
    rows = jnp.where(ok[:, None], rows, INVALID)

    entry = oob(rows, rows >= 0, nb)
    new_ids = oob(rows, is_new, nb)
    hit_own = hit_payer == tcol  # (read only where is_hit)
    prev = jnp.pad(rows[:, :-1], ((0, 0), (1, 0)), constant_values=INVALID)
    fill = jnp.clip(lengths[:, None] - k * p, 0, p)
    full = fill == p

    s = state
    state = s.update(
        ref_count=s.blocks.ref_count.at[entry].add(1, mode="drop"),
        payer_refs=s.blocks.payer_refs.at[new_ids].set(1, mode="drop")
        .at[oob(rows, is_hit & ok[:, None] & hit_own, nb)].add(1, mode="drop"),
        payer=s.blocks.payer.at[after(new_ids, hit_own)].set(tcol, mode="drop")
        .at[oob(rows, rev, nb)].set(tcol, mode="drop"),
        fill=s.blocks.fill.at[new_ids].set(fill, mode="drop"),
        token_ids=s.blocks.token_ids.at[new_ids].set(blocks, mode="drop"),
        attn_mass=s.blocks.attn_mass.at[new_ids].set(0.0, mode="drop"),
        head_mass=s.blocks.head_mass.at[new_ids].set(0.0, mode="drop"),
        block_hash=s.blocks.block_hash.at[new_ids].set(
            jnp.where(full[..., None], hashes, jnp.uint32(0)), mode="drop"),
        hashed=s.blocks.hashed.at[new_ids].set(full, mode="drop"),
        block_salt=s.blocks.block_salt.at[new_ids].set(
            jnp.broadcast_to(salts[:, None], (b, m)), mode="drop"),
        parent=s.blocks.parent.at[new_ids].set(prev, mode="drop"),
        parent_gen=s.blocks.parent_gen.at[new_ids].set(
            jnp.where(prev >= 0, s.blocks.generation[clip(prev)], 0), mode="drop"),
        block_tables=s.seqs.block_tables.at[oob(slot, ok, config.max_seqs)].set(
            jnp.pad(rows, ((0, 0), (0, mb - m)), constant_values=INVALID), mode="drop"),
        seq_lens=s.seqs.seq_lens.at[oob(slot, ok, config.max_seqs)].set(lengths, mode="drop"),
        positions=s.seqs.positions.at[oob(slot, ok, config.max_seqs)].set(lengths, mode="drop"),
        seq_tenant=s.seqs.seq_tenant.at[oob(slot, ok, config.max_seqs)].set(tenants, mode="drop"),
        seq_status=s.seqs.seq_status.at[oob(slot, ok, config.max_seqs)].set(
            jnp.int8(SEQ_RUNNING), mode="drop"),
        birth=s.seqs.birth.at[oob(slot, ok, config.max_seqs)].set(
            s.seqs.births + jnp.cumsum(ok.astype(jnp.int32)) - 1, mode="drop"),
        births=s.seqs.births + ok.sum().astype(jnp.int32),
        used_tokens=s.tenants.used_tokens.at[oob(tc, ok, config.num_tenants)].add(lengths, mode="drop"),
        charged_blocks=s.tenants.charged_blocks.at[oob(tc, ok, config.num_tenants), 0].add(
            nnew + nrev, mode="drop"),
    )
    report = AdmitReport(
        admitted=ok,
        reason=reason,
        seq_id=slot,
        cached_tokens=jnp.where(ok, nhit * p, 0),
        hit_blocks=jnp.where(ok, nhit, 0),
        new_blocks=jnp.where(ok, nnew, 0),
        missing_blocks=nnew,
    )
    return index_blocks(config, state, new_ids.ravel()), report  # the new full blocks


# ---- append -----------------------------------------------------------------------------------
@donating_jit
def append_core(config: StateConfig, state: KVState, seq_ids, tokens):
    """Append one decoded token to each sequence: seq_ids i32[B] (unique; INVALID = padding)."""
    p, mb, nb, ns = config.block_size, config.max_blocks_per_seq, config.total_blocks, config.max_seqs
    valid = seq_ids >= 0
    sc = clip(seq_ids)
    t = jnp.where(valid, state.seqs.seq_tenant[sc], INVALID)
    tc = clip(t)
    length = state.seqs.seq_lens[sc]
    k = length // p
    off = length % p
    need_new = (off == 0) & valid
    seq_full = valid & (k >= mb)
    ok, reason = _decide(config, state, t, valid, jnp.ones_like(seq_ids), need_new.astype(jnp.int32),
                         False, seq_full)
    alloc = ok & need_new
    newb, _, state = take_pool0(config, state, alloc)
    kc = jnp.minimum(k, mb - 1)
    prev = jnp.where(k > 0, state.seqs.block_tables[sc, jnp.maximum(kc - 1, 0)], INVALID)
    blk = jnp.where(need_new, newb, state.seqs.block_tables[sc, kc])
    blk = jnp.where(ok, blk, INVALID)
    bi = oob(blk, ok, nb)
    ai = oob(newb, alloc, nb)

    s = state
    # A freed block keeps stale token ids (unreachable: fill 0, not hashed); a new one starts
    # from an empty row.
    token_ids = s.blocks.token_ids.at[ai].set(INVALID, mode="drop").at[bi, off].set(tokens, mode="drop")
    # A block that becomes full joins the prefix cache, chained on its predecessor's hash.
    becomes_full = ok & (off == p - 1)
    never_evicted = s.seqs.positions[sc] == length
    salts = s.tenants.salt[tc]
    prev_hash = jnp.where((k > 0)[:, None], s.blocks.block_hash[clip(prev)],
                          salt_root(salts, config.hash_bits))
    h = block_hash(prev_hash, token_ids[clip(blk)], config.hash_bits)
    fi = oob(blk, becomes_full, nb)
    rows = oob(sc, ok, ns)
    state = s.update(
        token_ids=token_ids,
        attn_mass=s.blocks.attn_mass.at[ai].set(0.0, mode="drop"),
        head_mass=s.blocks.head_mass.at[ai].set(0.0, mode="drop"),
        fill=s.blocks.fill.at[bi].add(1, mode="drop"),
        block_hash=s.blocks.block_hash.at[after(fi, prev_hash)].set(h, mode="drop"),
        # ... unless the sequence lost tokens to eviction: its K/V sit at other positions than
        # a prompt of the same tokens would put them, so it is no lookup target.
        hashed=s.blocks.hashed.at[oob(blk, becomes_full & never_evicted, nb)].set(True, mode="drop"),
        ref_count=s.blocks.ref_count.at[ai].set(1, mode="drop"),
        payer=s.blocks.payer.at[ai].set(t, mode="drop"),
        payer_refs=s.blocks.payer_refs.at[ai].set(1, mode="drop"),
        block_salt=s.blocks.block_salt.at[ai].set(salts, mode="drop"),
        parent=s.blocks.parent.at[ai].set(prev, mode="drop"),
        parent_gen=s.blocks.parent_gen.at[ai].set(
            jnp.where(prev >= 0, s.blocks.generation[clip(prev)], 0), mode="drop"),
        block_tables=s.seqs.block_tables.at[after(oob(sc, alloc, ns), prev, blk), kc].set(
            newb, mode="drop"),
        seq_lens=s.seqs.seq_lens.at[after(rows, length)].add(1, mode="drop"),
        positions=s.seqs.positions.at[rows].add(1, mode="drop"),
        used_tokens=s.tenants.used_tokens.at[oob(tc, ok, config.num_tenants)].add(1, mode="drop"),
        charged_blocks=s.tenants.charged_blocks.at[oob(tc, alloc, config.num_tenants), 0].add(
            1, mode="drop"),
    )
    report = AppendReport(
        appended=ok, reason=reason, block=blk, offset=jnp.where(ok, off, INVALID), new_block=alloc
    )
    return index_blocks(config, state, fi), report  # the blocks that became full


# ---- fork -------------------------------------------------------------------------------------
@donating_jit
def fork_core(config: StateConfig, state: KVState, seq_ids):
    """Fork each source sequence (i32[B], INVALID = padding) into a new slot of the same tenant.

    Full blocks are shared by reference; the partly filled last block is copied (token ids and,
    when pages exist, its K/V pages) so the child can append without touching the parent.
    """
    p, mb, nb, ns = config.block_size, config.max_blocks_per_seq, config.total_blocks, config.max_seqs
    b = seq_ids.shape[0]
    valid = seq_ids >= 0
    sc = clip(seq_ids)
    t = jnp.where(valid, state.seqs.seq_tenant[sc], INVALID)
    tc = clip(t)
    length = jnp.where(valid, state.seqs.seq_lens[sc], 0)
    nblk = (length + p - 1) // p
    partial = valid & (length % p != 0)
    ok, reason = _decide(config, state, t, valid, length, partial.astype(jnp.int32), True,
                         jnp.zeros((b,), bool))
    slot = _free_slots(state, ok)
    alloc = ok & partial
    newb, _, state = take_pool0(config, state, alloc)
    src_rows = state.seqs.block_tables[sc]
    last = nblk - 1
    oldb = jnp.where(alloc, src_rows[jnp.arange(b), jnp.maximum(last, 0)], INVALID)
    kk = jnp.arange(mb, dtype=jnp.int32)[None, :]
    is_copy = alloc[:, None] & (kk == last[:, None])
    rows = jnp.where(is_copy, newb[:, None], src_rows)
    rows = jnp.where(ok[:, None], rows, INVALID)
    shared = ok[:, None] & (rows >= 0) & ~is_copy
    own = state.blocks.payer[clip(rows)] == tc[:, None]
    ai = oob(newb, alloc, nb)
    oc = clip(oldb)

    s = state
    updates = dict(
        ref_count=s.blocks.ref_count.at[oob(rows, shared, nb)].add(1, mode="drop")
        .at[ai].set(1, mode="drop"),
        payer_refs=s.blocks.payer_refs.at[oob(rows, shared & own, nb)].add(1, mode="drop")
        .at[ai].set(1, mode="drop"),
        payer=s.blocks.payer.at[after(ai, own)].set(t, mode="drop"),
        fill=s.blocks.fill.at[ai].set(s.blocks.fill[oc], mode="drop"),
        token_ids=s.blocks.token_ids.at[ai].set(s.blocks.token_ids[oc], mode="drop"),
        attn_mass=s.blocks.attn_mass.at[ai].set(s.blocks.attn_mass[oc], mode="drop"),
        head_mass=s.blocks.head_mass.at[ai].set(s.blocks.head_mass[oc], mode="drop"),
        block_salt=s.blocks.block_salt.at[ai].set(s.blocks.block_salt[oc], mode="drop"),
        parent=s.blocks.parent.at[ai].set(s.blocks.parent[oc], mode="drop"),
        parent_gen=s.blocks.parent_gen.at[ai].set(s.blocks.parent_gen[oc], mode="drop"),
        block_tables=s.seqs.block_tables.at[after(oob(slot, ok, ns), src_rows, rows, oldb, own)].set(
            rows, mode="drop"),
        seq_lens=s.seqs.seq_lens.at[after(oob(slot, ok, ns), length)].set(length, mode="drop"),
        positions=s.seqs.positions.at[oob(slot, ok, ns)].set(s.seqs.positions[sc], mode="drop"),
        seq_tenant=s.seqs.seq_tenant.at[oob(slot, ok, ns)].set(t, mode="drop"),
        seq_status=s.seqs.seq_status.at[oob(slot, ok, ns)].set(jnp.int8(SEQ_RUNNING), mode="drop"),
        birth=s.seqs.birth.at[oob(slot, ok, config.max_seqs)].set(
            s.seqs.births + jnp.cumsum(ok.astype(jnp.int32)) - 1, mode="drop"),
        births=s.seqs.births + ok.sum().astype(jnp.int32),
        used_tokens=s.tenants.used_tokens.at[oob(tc, ok, config.num_tenants)].add(length, mode="drop"),
        charged_blocks=s.tenants.charged_blocks.at[oob(tc, alloc, config.num_tenants), 0].add(
            1, mode="drop"),
    )
    state = s.update(**updates).replace(pages=copy_blocks(config, s.pages, oldb, newb, alloc))
    report = ForkReport(forked=ok, reason=reason, seq_id=slot, copied_from=oldb, copied_to=newb)
    return state, report


# ---- the facade's checks ------------------------------------------------------------------------
def admit(config: StateConfig, state: KVState, tenants, tokens, lengths, *, donate=False):
    """Allocator.admit: shapes, tenants, lengths and prompt token ids checked, then admit_core."""
    c = config
    ten = int_array("tenants", tenants, 1)
    tok = int_array("tokens", tokens, 2)
    lens = int_array("lengths", lengths, 1)
    b = ten.shape[0]
    if b == 0 or tok.shape[0] != b or lens.shape[0] != b:
        raise InputShapeError(
            f"tenants {ten.shape}, tokens {tok.shape}, lengths {lens.shape}: need B >= 1 rows each")
    if tok.shape[1] == 0:
        raise InputShapeError("tokens has no columns: a prompt has at least one token")
    if tok.shape[1] > c.max_tokens_per_seq:
        raise SequenceTooLongError(
            f"tokens has {tok.shape[1]} columns; a sequence holds at most "
            f"{c.max_tokens_per_seq} = {c.max_blocks_per_seq} blocks x {c.block_size}")
    real = ten != INVALID
    bad = np.flatnonzero(real & ((ten < 0) | (ten >= c.num_tenants)))
    if bad.size:
        raise UnknownTenantError(f"tenants[{bad[0]}] = {ten[bad[0]]}: a tenant id is in "
                                 f"[0, {c.num_tenants}), or {INVALID} for a padding row")
    for t in np.unique(ten[real]):
        tenant_id(c, state, t)
    if (real & ((lens < 1) | (lens > tok.shape[1]))).any():
        i = int(np.flatnonzero(real & ((lens < 1) | (lens > tok.shape[1])))[0])
        raise TokenIdError(f"lengths[{i}] = {lens[i]} outside [1, {tok.shape[1]}]")
    vocab = c.model.vocab_size
    if not 0 <= tok.min() <= tok.max() < vocab:  # some id out of range: in a prompt?
        in_prompt = real[:, None] & (np.arange(tok.shape[1])[None, :] < lens[:, None])
        bad = np.argwhere(((tok < 0) | (tok >= vocab)) & in_prompt)
        if len(bad):
            i, j = (int(x) for x in bad[0])
            raise TokenIdError(f"tokens[{i}, {j}] = {tok[i, j]}: prompt token ids must be "
                               f"in [0, {vocab})")
    return admit_core(c, state, ten, tok, np.where(real, lens, 0).astype(np.int32),
                      donate=donate)


def append(config: StateConfig, state: KVState, seq_ids, tokens, *, donate=False):
    """Allocator.append: unique running ids, token ids in the vocabulary, tables not full."""
    c = config
    ids = int_array("seq_ids", seq_ids, 1)
    tok = int_array("tokens", tokens, 1)
    if ids.shape != tok.shape or ids.size == 0:
        raise InputShapeError(f"seq_ids {ids.shape} and tokens {tok.shape} must be [B], B >= 1")
    real_ids = live_ids(c, state, ids, "append")
    if len(np.unique(real_ids)) != len(real_ids):
        raise DuplicateIdError("append: a sequence appears twice in one call")
    real = ids != INVALID
    bad = np.flatnonzero(((tok < 0) | (tok >= c.model.vocab_size)) & real)
    if bad.size:
        raise TokenIdError(f"tokens[{bad[0]}] = {tok[bad[0]]}: token ids must be in "
                           f"[0, {c.model.vocab_size})")
    if real_ids.size and (np.asarray(state.seqs.seq_lens)[real_ids]
                          >= c.max_tokens_per_seq).any():
        raise SequenceTooLongError(
            f"append: a sequence already holds {c.max_tokens_per_seq} tokens (table full)")
    return append_core(c, state, ids, tok, donate=donate)


def fork(config: StateConfig, state: KVState, seq_ids, *, donate=False):
    """Allocator.fork: running ids (INVALID = padding)."""
    ids = int_array("seq_ids", seq_ids, 1)
    if ids.size == 0:
        raise InputShapeError("seq_ids must have at least one row")
    live_ids(config, state, ids, "fork")
    return fork_core(config, state, ids, donate=donate)
