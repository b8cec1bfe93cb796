"""`check_invariants`: recompute everything from the block tables, in NumPy, and compare exactly.

This is an independent implementation (host NumPy, not the jitted core), so a bug in an operation
shows up as a difference rather than being repeated. It checks:
  * the state is one of this config (`validate_state`: StateMismatchError otherwise); tier and
    precision equal their pool's;
  * sequences: live slots belong to registered tenants, tables hold exactly ceil(len / P) valid
    entries, logical positions never behind lengths (eviction only shrinks lengths);
  * ref counts and payer-held refs equal the references in the tables;
  * every block is exactly one of: held (referenced or pinned), on its pool's free list, or
    *cold* (keep_cold_blocks only: pool 0, full, hashed, payer INVALID, no mass, a distinct LRU
    stamp in [cold_head, cold_clock) and at that stamp's place in the LRU ring; their number is
    cold_count); each pool's free list holds exactly
    its blocks held by nothing that are not cold (no duplicates, nothing both free and held;
    pinned blocks never free); free blocks carry no metadata (tombstones cleared), and with
    scrub_on_free their pages are zero in every pool (a cold block's pages are live cache);
  * a cold block is a sound lookup target: its chain hash is that of its tokens on its parent's
    hash (or its salt's root), whenever that parent is still the one it was chained on;
  * every held block is charged to one registered tenant, who still references it unless it is
    pinned; cross-tenant references only between tenants sharing a salt;
  * block fill and token ids agree with every referencing sequence; every full block of a live
    sequence carries the chained hash of its tokens and salt, with the right parent, and is a
    lookup target exactly when it sits in pool 0 (host-resident or compressed blocks never are);
  * running sequences hold no host-pool block (only suspended ones do);
  * the ledger columns (used tokens, charged and pinned blocks per pool) equal their
    recomputation, and the charges add up to each pool's held blocks (the real watermark):
    pool size - free list - cold blocks;
  * the prefix index (`kvquota.prefix_index`) holds exactly the hashed blocks, each once, with
    `slot_of` naming its slot; every entry is reachable (no EMPTY slot between its key's home,
    recomputed here, and its slot); `occupied` counts the non-EMPTY slots and stays <= 3H/4.
"""

from __future__ import annotations

import jax
import numpy as np

from kvquota.errors import InvariantError
from kvquota.sentinel import INVALID, PER_HEAD_TOKEN
from kvquota.codes import SEQ_FREE, SEQ_IDLE, SEQ_PREEMPTED, SEQ_RUNNING, SEQ_SUSPENDED
from kvquota.hashing import block_hash, salt_root
from kvquota.prefix_index import EMPTY, TOMB, home, home_count, max_occupied
from kvquota.state import KVState, StateConfig, pool_of, validate_state


def _diff(problems, name, got, want, limit=5):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        problems.append(f"{name}: shape {got.shape} != expected {want.shape}")
        return
    bad = np.argwhere(got != want)
    if len(bad):
        where = ", ".join(
            f"{tuple(int(i) for i in idx)}: {got[tuple(idx)]} != {want[tuple(idx)]}"
            for idx in bad[:limit]
        )
        problems.append(f"{name} differs at {len(bad)} place(s): {where}")


def _flag(problems, name, mask, limit=5):
    mask = np.asarray(mask)
    if mask.any():
        idx = np.argwhere(mask)[:limit]
        problems.append(f"{name} at {len(np.argwhere(mask))} place(s): {[tuple(map(int, i)) for i in idx]}")


def recompute(config: StateConfig, st) -> dict:
    """Per-block and per-tenant figures recomputed from the tables of a host (NumPy) state."""
    nb, ntn, npools, p = config.total_blocks, config.num_tenants, config.num_pools, config.block_size
    live = st.seqs.seq_status != SEQ_FREE
    ten = np.where(live, st.seqs.seq_tenant, INVALID)
    tab = np.where(live[:, None], st.seqs.block_tables, INVALID)
    ok = (tab >= 0) & (tab < nb)
    ents = tab[ok]
    ent_ten = np.broadcast_to(ten[:, None], tab.shape)[ok]
    ref = np.bincount(ents, minlength=nb)[:nb]
    payer_refs = np.bincount(ents[st.blocks.payer[ents] == ent_ten], minlength=nb)[:nb]
    pools = pool_of(config, np.arange(nb), xp=np)
    held = (ref > 0) | (st.blocks.pin_count > 0)
    charged = np.zeros((ntn, npools), np.int64)
    pinned = np.zeros((ntn, npools), np.int64)
    payer_ok = held & (st.blocks.payer >= 0) & (st.blocks.payer < ntn)
    np.add.at(charged, (st.blocks.payer[payer_ok], pools[payer_ok]), 1)
    pin_ok = payer_ok & (st.blocks.pin_count > 0)
    np.add.at(pinned, (st.blocks.payer[pin_ok], pools[pin_ok]), 1)
    used = np.zeros(ntn, np.int64)
    np.add.at(used, ten[live & (ten >= 0) & (ten < ntn)], st.seqs.seq_lens[live & (ten >= 0) & (ten < ntn)])
    # Distinct blocks each tenant references but others pay for; reclaimable blocks.
    pairs = np.unique(np.stack([ent_ten, ents], 1), axis=0) if len(ents) else np.zeros((0, 2), int)
    shared = np.zeros((ntn, npools), np.int64)
    other = st.blocks.payer[pairs[:, 1]] != pairs[:, 0]
    np.add.at(shared, (pairs[other, 0], pools[pairs[other, 1]]), 1)
    recl = payer_ok & (st.blocks.pin_count == 0) & (ref == payer_refs)
    reclaimable = np.zeros((ntn, npools), np.int64)
    np.add.at(reclaimable, (st.blocks.payer[recl], pools[recl]), 1)
    device = np.asarray(config.device_pools)[pools]
    slack = np.where(payer_ok & device, p - st.blocks.fill, 0)
    frag = np.zeros(ntn, np.int64)
    np.add.at(frag, st.blocks.payer[payer_ok & device], slack[payer_ok & device])
    return dict(ref=ref, payer_refs=payer_refs, held=held, charged=charged, pinned=pinned,
                used=used, shared=shared, reclaimable=reclaimable, fragmentation=frag,
                pool_fragmentation=int(slack.sum()), pools=pools, live=live, tab=tab, ten=ten)


def check_invariants(config: StateConfig, state: KVState, *, check_pages: bool = True) -> dict:
    """Raise InvariantError listing every difference; returns the recomputed figures if none."""
    problems: list[str] = []
    validate_state(config, state)  # StateMismatchError for anything not a state of config
    st = jax.device_get(state)
    nb, p, mb = config.total_blocks, config.block_size, config.max_blocks_per_seq
    ntn = config.num_tenants
    r = recompute(config, st)
    live, tab, ten, pools = r["live"], r["tab"], r["ten"], r["pools"]

    # Pools: fixed tier and precision.
    _diff(problems, "tier", st.blocks.tier, np.asarray(config.pool_tiers)[pools])
    _diff(problems, "precision", st.blocks.precision, np.asarray(config.pool_precisions)[pools])

    # Sequences.
    status = st.seqs.seq_status
    _flag(problems, "unknown sequence status",
          ~np.isin(status, [SEQ_FREE, SEQ_RUNNING, SEQ_SUSPENDED, SEQ_IDLE, SEQ_PREEMPTED]))
    _flag(problems, "live sequence of an unregistered/invalid tenant",
          live & ~((st.seqs.seq_tenant >= 0) & (st.seqs.seq_tenant < ntn)
                   & st.tenants.registered[np.clip(st.seqs.seq_tenant, 0, ntn - 1)]))
    _flag(problems, "free sequence slot with data",
          ~live & ((st.seqs.seq_tenant != INVALID) | (st.seqs.seq_lens != 0) | (st.seqs.positions != 0)
                   | (st.seqs.block_tables != INVALID).any(1)))
    holds = live & (status != SEQ_PREEMPTED)  # a preempted slot keeps only its tenant
    _flag(problems, "live sequence length outside [1, MB*P]",
          holds & ((st.seqs.seq_lens < 1) | (st.seqs.seq_lens > mb * p)))
    _flag(problems, "preempted slot with KV or a position",
          (status == SEQ_PREEMPTED) & ((st.seqs.seq_lens != 0) | (st.seqs.positions != 0)
                                       | (st.seqs.block_tables != INVALID).any(1)))
    _flag(problems, "logical position behind the cached length (only eviction separates them, "
          "and it only shrinks seq_lens)", live & (st.seqs.positions < st.seqs.seq_lens))
    tab_c = np.clip(tab, 0, nb - 1)
    host = -1 if config.host_pool is None else config.host_pool
    # (A suspended sequence may still hold pool-0 blocks: shared or pinned ones at offload, and
    # blocks that became its own later, when the other sequences sharing them were freed.)
    _flag(problems, "running or idle sequence with a block in the host pool",
          np.isin(status, [SEQ_RUNNING, SEQ_IDLE]) & ((tab >= 0) & (pools[tab_c] == host)).any(1))
    nblk = (np.clip(st.seqs.seq_lens, 0, mb * p) + p - 1) // p
    k = np.arange(mb)[None, :]
    should = live[:, None] & (k < nblk[:, None])
    _flag(problems, "table entry missing or out of range", should & ~((tab >= 0) & (tab < nb)))
    _flag(problems, "table entry past the sequence's blocks", ~should & (st.seqs.block_tables != INVALID))
    if problems:  # the rest assumes well-formed tables
        raise InvariantError(problems)

    # Reference counts.
    _diff(problems, "ref_count", st.blocks.ref_count, r["ref"])
    _diff(problems, "payer_refs", st.blocks.payer_refs, r["payer_refs"])
    _flag(problems, "negative pin_count", st.blocks.pin_count < 0)
    held = r["held"]

    cold = _check_cold(problems, config, st, held, pools)

    # Free lists: exactly the blocks held by nothing and not cold, per pool.
    for pool, (start, size) in enumerate(zip(config.pool_starts, config.pool_sizes)):
        cnt = int(st.free.free_count[pool])
        if not 0 <= cnt <= size:
            problems.append(f"free_count[{pool}] = {cnt} outside [0, {size}]")
            continue
        fl = st.free.free_list[start:start + cnt]
        if len(np.unique(fl)) != len(fl):
            problems.append(f"pool {pool} free list has duplicates")
        if ((fl < start) | (fl >= start + size)).any():
            problems.append(f"pool {pool} free list holds blocks of another pool")
        want = np.flatnonzero(~held[start:start + size] & ~cold[start:start + size]) + start
        if not np.array_equal(np.sort(fl), want):
            both = np.intersect1d(fl, np.flatnonzero(held))
            problems.append(
                f"pool {pool} free list != unheld blocks (free and held: {both[:5].tolist()}, "
                f"unheld not free: {np.setdiff1d(want, fl)[:5].tolist()})"
            )

    # Free blocks are tombstones: not hashed, no fill, no payer or chain data, so no lookup can
    # return them. (Their token ids are left stale on purpose: every allocation rewrites them.)
    free = ~held & ~cold
    _flag(problems, "free block with a payer", free & (st.blocks.payer != INVALID))
    _flag(problems, "free block with payer refs", free & (st.blocks.payer_refs != 0))
    _flag(problems, "free block with fill", free & (st.blocks.fill != 0))
    _flag(problems, "free block still hashed", free & (st.blocks.hashed | (st.blocks.block_hash != 0).any(1)))
    _flag(problems, "free block with chain data",
          free & ((st.blocks.parent != INVALID) | (st.blocks.parent_gen != 0) | (st.blocks.block_salt != 0)))
    _flag(problems, "negative generation", st.blocks.generation < 0)
    _flag(problems, "free or cold block with attention mass",
          ~held & (st.blocks.attn_mass != 0).any(1))
    _flag(problems, "attention mass past a block's fill or negative",
          ((np.arange(p)[None, :] >= st.blocks.fill[:, None]) & (st.blocks.attn_mass != 0)).any(1)
          | (st.blocks.attn_mass < 0).any(1) | ~np.isfinite(st.blocks.attn_mass).all(1))
    head_mass = st.blocks.head_mass.reshape(len(held), p, -1)  # [NB, P, L * Hkv] (or 0 wide)
    _flag(problems, "free or cold block with per-head attention mass",
          ~held & (head_mass != 0).any((1, 2)))
    _flag(problems, "per-head attention mass past a block's fill or negative",
          ((np.arange(p)[None, :] >= st.blocks.fill[:, None]) & (head_mass != 0).any(2)).any(1)
          | (head_mass < 0).any((1, 2)) | ~np.isfinite(head_mass).all((1, 2)))
    if check_pages and config.scrub_on_free:
        for pool, pages in enumerate(st.pages):
            dirty = np.zeros(config.pool_sizes[pool], bool)
            for leaf in jax.tree_util.tree_leaves(pages):  # K, V (codes, scales, zero points)
                dirty |= (np.asarray(leaf) != 0).reshape(leaf.shape[0], leaf.shape[1],
                                                         leaf.shape[2], -1).any(axis=(0, 1, 3))
            start = config.pool_starts[pool]
            _flag(problems, f"scrub_on_free: free page of pool {pool} not zero",
                  free[start: start + config.pool_sizes[pool]] & dirty)

    # Charges: one registered payer per held block, who references it unless it is pinned.
    payer_c = np.clip(st.blocks.payer, 0, ntn - 1)
    _flag(problems, "held block without a registered payer",
          held & ~((st.blocks.payer >= 0) & (st.blocks.payer < ntn) & st.tenants.registered[payer_c]))
    _flag(problems, "unpinned block whose payer holds no reference",
          held & (st.blocks.pin_count == 0) & (r["payer_refs"] == 0))
    ents_ok = tab >= 0
    ent_blk = tab[ents_ok]
    ent_ten = np.broadcast_to(ten[:, None], tab.shape)[ents_ok]
    pay = st.blocks.payer[ent_blk]
    cross = (pay != ent_ten) & (st.tenants.salt[np.clip(pay, 0, ntn - 1)] != st.tenants.salt[ent_ten])
    if cross.any():
        problems.append(
            f"{int(cross.sum())} reference(s) to blocks paid by a tenant with another salt, "
            f"e.g. tenant {int(ent_ten[cross][0])} -> block {int(ent_blk[cross][0])}"
        )

    # Fill and token ids agree with every referencing sequence.
    exp_fill = np.clip(st.seqs.seq_lens[:, None] - k * p, 0, p)
    _diff(problems, "fill of referenced blocks", st.blocks.fill[ent_blk], exp_fill[ents_ok])
    j = np.arange(p)[None, :]
    _flag(problems, "held block fill outside [1, P]", held & ((st.blocks.fill < 1) | (st.blocks.fill > p)))
    named = (st.blocks.token_ids >= 0) | (st.blocks.token_ids == PER_HEAD_TOKEN)
    _flag(problems, "token ids inconsistent with fill",
          held & ((j < st.blocks.fill[:, None]) != named).any(1))

    # Prefix-cache chain: full blocks hashed with their chain value, parents consistent.
    full = ents_ok & (exp_fill == p)
    salts = st.tenants.salt[np.clip(ten, 0, ntn - 1)]
    prev = salt_root(salts, config.hash_bits, xp=np)
    bad_hash = np.zeros(tab.shape, bool)
    evicted = st.seqs.positions != st.seqs.seq_lens
    for col in range(mb):
        rows = full[:, col]
        if not rows.any():
            break
        h = block_hash(prev, st.blocks.token_ids[np.clip(tab[:, col], 0, nb - 1)], config.hash_bits, xp=np)
        stored = st.blocks.block_hash[np.clip(tab[:, col], 0, nb - 1)]
        in_pool0 = pools[np.clip(tab[:, col], 0, nb - 1)] == 0
        hashed = st.blocks.hashed[np.clip(tab[:, col], 0, nb - 1)]
        # A never-evicted sequence's full pool-0 blocks are lookup targets; an evicted one's
        # rewritten blocks are not (its K/V sit at shifted positions); nothing else ever is.
        must = in_pool0 & ~evicted
        bad_hash[:, col] = rows & ((stored != h).any(1) | (must & ~hashed) | (~in_pool0 & hashed))
        prev = h
    _flag(problems, "full block without its chain hash, or hashed outside pool 0 (seq, pos)",
          bad_hash)
    _flag(problems, "lookup target outside the full-precision device pool",
          st.blocks.hashed & (pools != 0))
    _flag(problems, "partial block hashed", st.blocks.hashed & (st.blocks.fill < p))
    _diff(problems, "block_salt of referenced blocks", st.blocks.block_salt[ent_blk],
          np.broadcast_to(salts[:, None], tab.shape)[ents_ok])
    prev_blk = np.concatenate([np.full((tab.shape[0], 1), INVALID), tab[:, :-1]], axis=1)
    _diff(problems, "parent of referenced blocks", st.blocks.parent[ent_blk], prev_blk[ents_ok])
    exp_gen = np.where(prev_blk >= 0, st.blocks.generation[np.clip(prev_blk, 0, nb - 1)], 0)
    _diff(problems, "parent_gen of referenced blocks", st.blocks.parent_gen[ent_blk], exp_gen[ents_ok])

    # Ledger.
    _diff(problems, "used_tokens", st.tenants.used_tokens, r["used"])
    _diff(problems, "charged_blocks", st.tenants.charged_blocks, r["charged"])
    _diff(problems, "pinned_blocks", st.tenants.pinned_blocks, r["pinned"])
    held_per_pool = (np.asarray(config.pool_sizes) - st.free.free_count
                     - np.bincount(pools[cold], minlength=config.num_pools))
    _diff(problems, "sum of charges vs held blocks per pool", st.tenants.charged_blocks.sum(0), held_per_pool)
    _flag(problems, "negative quota", (st.tenants.token_quota < 0) | (st.tenants.byte_quota < 0))
    _flag(problems, "unregistered tenant with a ledger",
          ~st.tenants.registered & ((st.tenants.used_tokens != 0) | (st.tenants.charged_blocks != 0).any(1)))
    _check_index(problems, config, st)
    if problems:
        raise InvariantError(problems)
    return r


def _check_cold(problems, config: StateConfig, st, held, pools) -> np.ndarray:
    """bool[NB]: the cold blocks, recomputed from ref/pin/pool/fill/hash/payer and the free lists
    (not from `cold_at`), after checking them against `cold_at`, the counters and their chain."""
    nb, p = config.total_blocks, config.block_size
    b = st.blocks
    on_list = np.zeros(nb, bool)
    for pool, (start, size) in enumerate(zip(config.pool_starts, config.pool_sizes)):
        cnt = int(np.clip(st.free.free_count[pool], 0, size))
        on_list[np.clip(st.free.free_list[start:start + cnt], 0, nb - 1)] = True
    cold = (~held & (pools == 0) & (b.fill == p) & b.hashed & (b.payer == INVALID) & ~on_list)
    if not config.keep_cold_blocks:
        _flag(problems, "cold block (an unheld cached block) without keep_cold_blocks", cold)
        cold = np.zeros(nb, bool)
        if (st.free.cold_ring != INVALID).any() or int(st.free.cold_head) != 0:
            problems.append("cold ring used without keep_cold_blocks")
    stamped = b.cold_at != INVALID
    _flag(problems, "cold_at stamp on a block that is not cold, or a cold block without one",
          stamped != cold)
    n = int(cold.sum())
    if int(st.free.cold_count) != n:
        problems.append(f"cold_count = {int(st.free.cold_count)}, {n} cold blocks")
    clock, head, n0 = int(st.free.cold_clock), int(st.free.cold_head), config.num_blocks
    if not 0 <= head <= clock <= head + n0:
        problems.append(f"cold ring: head {head}, clock {clock} (need 0 <= head <= clock <= "
                        f"head + {n0})")
    ids = np.flatnonzero(cold)
    stamps = b.cold_at[ids]
    if (stamps < head).any() or (stamps >= clock).any() or len(np.unique(stamps)) != len(stamps):
        problems.append(f"cold stamps must be distinct, in [cold_head = {head}, cold_clock = "
                        f"{clock}): {np.sort(stamps)[:8].tolist()}")
    else:
        lost = st.free.cold_ring[stamps % n0] != ids
        if lost.any():
            problems.append(f"cold blocks missing from the LRU ring: {ids[lost][:5].tolist()}")
    _flag(problems, "cold block with payer refs or pins", cold & ((b.payer_refs != 0)
                                                                 | (b.pin_count != 0)))
    _flag(problems, "cold block with invalid token ids", cold & (b.token_ids < 0).any(1))
    # The chain: a cold block whose parent is still the block it was chained on (same
    # generation, still a lookup target) carries the hash of its tokens on the parent's hash;
    # one without a parent the hash on its salt's root. (A stale parent makes it unreachable.)
    par = np.clip(b.parent[ids], 0, nb - 1)
    orphan = b.parent[ids] == INVALID
    live_parent = ~orphan & (b.parent_gen[ids] == b.generation[par]) & b.hashed[par]
    root = salt_root(b.block_salt[ids], config.hash_bits, xp=np)
    prev = np.where(orphan[:, None], root, b.block_hash[par])
    want = block_hash(prev, b.token_ids[ids], config.hash_bits, xp=np)
    bad = (orphan | live_parent) & (b.block_hash[ids] != want).any(1)
    if bad.any():
        problems.append(f"cold blocks whose hash is not the chain hash of their tokens and "
                        f"parent: {ids[bad][:5].tolist()}")
    bad = live_parent & (b.block_salt[ids] != b.block_salt[par])
    if bad.any():
        problems.append(f"cold blocks of another salt than their parent: {ids[bad][:5].tolist()}")
    return cold



def _check_index(problems, config: StateConfig, st) -> None:
    """The prefix index against the hashed blocks, recomputed from the slots alone."""
    n0, hh = config.num_blocks, home_count(config)
    slots, slot_of = st.index.slots, st.index.slot_of
    entry = (slots >= 0) & (slots < n0)
    _flag(problems, "index slot holding neither a pool-0 block nor EMPTY / TOMB",
          ~entry & (slots != EMPTY) & (slots != TOMB))
    at = np.flatnonzero(entry)
    ids = slots[at]
    count = np.bincount(ids, minlength=n0)[:n0]
    hashed = st.blocks.hashed[:n0]
    _flag(problems, "hashed block not in the prefix index", hashed & (count == 0))
    _flag(problems, "block in the prefix index more than once", count > 1)
    _flag(problems, "unhashed block in the prefix index", ~hashed & (count > 0))
    want = np.full(n0, INVALID, np.int64)
    want[ids] = at
    _diff(problems, "index slot_of", slot_of, np.where(count == 1, want, INVALID))
    # Reachable: no EMPTY in [home, slot] (a probe from the home stops at the first EMPTY).
    h = home(st.blocks.block_hash[ids], st.blocks.block_salt[ids], hh, xp=np)
    empties = np.concatenate([[0], np.cumsum(slots == EMPTY)])
    unreachable = (h > at) | (empties[at + 1] - empties[np.minimum(h, at)] > 0)
    if unreachable.any():
        problems.append(f"index entries unreachable from their home slot (an EMPTY slot before "
                        f"them): blocks {ids[unreachable][:5].tolist()}")
    occupied = int((slots != EMPTY).sum())
    if int(st.index.occupied) != occupied:
        problems.append(f"index occupied = {int(st.index.occupied)}, {occupied} slots not EMPTY")
    if occupied > max_occupied(config):
        problems.append(f"index has {occupied} slots not EMPTY, over its load bound "
                        f"{max_occupied(config)} (probes might run off its end)")
