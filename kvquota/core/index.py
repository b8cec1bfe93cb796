"""Maintenance and lookup of the prefix cache's hash index (`kvquota.prefix_index`), jitted.

Two rules keep the index equal to "the hashed pool-0 blocks", each entry reachable from its
key's home:

* whatever unhashes a block (a free, a cold block reused or dropped, an eviction rewriting it)
  calls `forget` on it: a tombstone scatter, O(k), reading only the index;
* whatever hashes a block, or may change a hashed block's key, calls `index_blocks` on it after
  the core's last write to the per-block arrays: a block already indexed is removed first, then
  the hashed ones are inserted (vectorised linear probing), or the index is rebuilt when
  tombstones would fill it past 3H/4.

`index_blocks` reads the per-block arrays (k gathers, or all of them in a rebuild): it runs after
the core's last scatter into them, so a donated core still updates them in place (an earlier
read would make XLA copy the whole array to protect it).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kvquota.codes import INT32_MAX
from kvquota.core.scatter import clip, oob
from kvquota.prefix_index import EMPTY, TOMB, home, home_count, max_occupied, rebuild
from kvquota.sentinel import INVALID


def forget(config, state, ids):
    """Remove the index entries of blocks `ids` (i32[k]; INVALID, out-of-pool-0 ids and blocks
    not indexed are ignored; repeats allowed): each becomes a tombstone. O(k)."""
    n0, slots_len = config.num_blocks, 2 * home_count(config)
    ix = state.index
    ok = (ids >= 0) & (ids < n0)
    at = ix.slot_of[clip(jnp.minimum(ids, n0 - 1))]
    gone = ok & (at >= 0)
    return state.update(
        slots=ix.slots.at[oob(at, gone, slots_len)].set(TOMB, mode="drop"),
        slot_of=ix.slot_of.at[oob(ids, gone, n0)].set(INVALID, mode="drop"))


def _unique(ids, n0):
    """ids i32[k] with repeats, INVALID and ids outside pool 0 turned into INVALID (sorted)."""
    key = jnp.sort(jnp.where((ids >= 0) & (ids < n0), ids, INT32_MAX))
    first = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]]) & (key < INT32_MAX)
    return jnp.where(first, key, INVALID).astype(jnp.int32)


def _rounds(body, shared, entries, pending, floor: int = 128, shrink: int = 8):
    """Run `body(shared, entries, pending) -> (shared, entries, pending)` round by round until
    no entry is pending; returns (shared, entries) with every entry's last values.

    A probe loop runs as many rounds as the batch's longest probe sequence, but most entries
    finish in a few: so the entries still pending are moved into a buffer `shrink` times
    smaller whenever they fit in it (down to `floor`), and the later rounds cost the
    stragglers, not the batch (an admission of 64 long prompts looks up ~65K blocks of which
    often only a tenth are real). Every round still sees every pending entry, in the same
    state, so the outcome is exactly that of one loop over the whole batch. entries: per-entry
    arrays [n, ...]; `body` must leave entries that are not pending (padding) as they are."""
    n = pending.shape[0]
    sizes = [n]
    while sizes[-1] // shrink >= floor:
        sizes.append(sizes[-1] // shrink)
    out, at = entries, jnp.arange(n, dtype=jnp.int32)  # buffer row -> entry (n: padding)
    for s, size in enumerate(sizes):
        nxt = sizes[s + 1] if s + 1 < len(sizes) else 0
        shared, entries, pending = lax.while_loop(lambda c, nxt=nxt: c[2].sum() > nxt,
                                                  lambda c: body(*c), (shared, entries, pending))
        out = entries if s == 0 else tuple(o.at[at].set(x, mode="drop")
                                           for o, x in zip(out, entries))
        if nxt:  # keep the pending rows, in order, in a buffer of `nxt` rows
            sel = jnp.nonzero(pending, size=nxt, fill_value=size)[0]
            real, sel = sel < size, jnp.minimum(sel, size - 1)
            entries = tuple(x[sel] for x in entries)
            pending, at = real & pending[sel], jnp.where(real, at[sel], n)
    return shared, out


def _insert(config, slots, slot_of, occupied, ids, words, salts, want):
    """Linear-probing insert of the entries `want` (bool[k]; ids unique, not indexed) with keys
    (words u32[k, 2], salts u32[k]). Round by round every pending entry looks at its slot: a
    free one (EMPTY or TOMB) is claimed by the smallest id proposing it (a scatter-min; ids are
    below both markers), the rest move one slot on. Each entry ends at the first slot after its
    home that was free when it got there, with only occupied slots passed: reachable."""
    n0, slots_len = config.num_blocks, 2 * home_count(config)

    def body(shared, entries, pending):
        slots, slot_of, occupied = shared
        pos, ids = entries
        cur = slots[pos]
        free = pending & (cur >= TOMB)
        slots = slots.at[oob(pos, free, slots_len)].min(ids, mode="drop")
        won = free & (slots[pos] == ids)
        occupied = occupied + (won & (cur == EMPTY)).sum(dtype=jnp.int32)
        slot_of = slot_of.at[oob(ids, won, n0)].set(pos, mode="drop")
        pending = pending & ~won & (pos < slots_len - 1)  # (the end is never reached: <= 3H/4 used)
        pos = jnp.where(pending, pos + 1, pos)
        return (slots, slot_of, occupied), (pos, ids), pending

    pos = home(words, salts, home_count(config))
    (slots, slot_of, occupied), _ = _rounds(body, (slots, slot_of, occupied), (pos, ids), want)
    return slots, slot_of, occupied


def index_blocks(config, state, ids):
    """Bring the index up to date for blocks `ids` (i32[k]; INVALID and ids outside pool 0 are
    padding; repeats allowed): an indexed one is removed, then the hashed ones are inserted
    under their current key, or, when the tombstones left would push the index past 3H/4, the
    index is rebuilt from every hashed block. Call it after the core's last write to the
    per-block arrays."""
    n0 = config.num_blocks
    ids = _unique(ids, n0)
    state = forget(config, state, ids)
    ix, b = state.index, state.blocks
    ic = clip(ids)
    want = (ids >= 0) & b.hashed[ic]
    n_new = want.sum(dtype=jnp.int32)

    def insert(ix):
        return _insert(config, ix.slots, ix.slot_of, ix.occupied, ids, b.block_hash[ic],
                       b.block_salt[ic], want)

    def rebuilt(ix):
        r = rebuild(config, b.hashed, b.block_hash, b.block_salt)
        return r["slots"], r["slot_of"], r["occupied"]

    full = ix.occupied + n_new > max_occupied(config)
    slots, slot_of, occupied = lax.cond(full, rebuilt, insert, ix)
    return state.update(slots=slots, slot_of=slot_of, occupied=occupied)


def candidates(config, state, hashes, salts, tokens, active=None):
    """Up to C blocks per query whose hash, salt and token ids all match, through the index:
    i32[Q, C], the same as `prefix.brute_force_candidates` (the C lowest ids with the key, each
    kept only if its token ids equal the query's). hashes u32[Q, 2], salts u32[Q], tokens
    i32[Q, P]; `active` bool[Q] (None: all) marks the queries to answer (the rest: INVALID).

    All queries probe together, one slot per round, each until it meets EMPTY: the rounds are
    the longest probe sequence of the batch, and a round costs the queries still probing (at
    most 8x more: `_rounds`), not Q."""
    c, slots_len = config.lookup_candidates, 2 * home_count(config)
    q = hashes.shape[0]
    ix, b = state.index, state.blocks
    pos = home(hashes, salts, home_count(config))
    pending = jnp.ones((q,), bool) if active is None else active
    best = tuple(jnp.full((q,), INT32_MAX, jnp.int32) for _ in range(c))

    def body(shared, entries, pending):
        pos, words, salt, *best = entries
        e = ix.slots[pos]
        ec = jnp.clip(e, 0, b.hashed.shape[0] - 1)
        match = (pending & (e < TOMB) & b.hashed[ec] & (b.block_hash[ec, 0] == words[:, 0])
                 & (b.block_hash[ec, 1] == words[:, 1]) & (b.block_salt[ec] == salt))
        x = jnp.where(match, e, INT32_MAX)
        kept = []
        for col in best:  # insert x into the sorted C smallest (a bubble pass)
            kept.append(jnp.minimum(col, x))
            x = jnp.maximum(col, x)
        pending = pending & (e != EMPTY) & (pos < slots_len - 1)
        return shared, (jnp.where(pending, pos + 1, pos), words, salt, *kept), pending

    _, entries = _rounds(body, (), (pos, hashes, salts, *best), pending)
    best = entries[3:]
    cand = jnp.stack(best, axis=1)
    same = (b.token_ids[clip(jnp.minimum(cand, b.hashed.shape[0] - 1))] == tokens[:, None, :]
            ).all(axis=2)
    return jnp.where((cand < INT32_MAX) & same, cand, INVALID)
