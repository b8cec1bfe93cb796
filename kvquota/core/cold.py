"""Cold cached blocks (`StateConfig.keep_cold_blocks`): full pool-0 blocks held by nothing that
stay in the prefix cache, charged to no one and counted as free capacity, until an allocation
reuses them least recently cold first or `drop_cold` pushes them onto the free list. vLLM v1 keeps
such blocks in its free queue and SGLang's radix cache keeps unlocked nodes until evicted (LRU);
here they are kept off the stack so a pop takes the stack first and a cold block only when the
stack is short.

A cold block (pool 0, ref 0, pin 0, fill P, hashed, payer INVALID, `cold_at` >= 0) keeps its
hash, salt, token ids, parent and generation, so a tenant's next turn still hits it and children
chained on it stay valid. When it is reused or dropped it leaves the cache: its generation is
bumped (stale children never match), its chain data cleared and, under scrub_on_free, its pages
zeroed — only then, since until then they are live cache content.

The LRU order is a ring of block ids in stamp order (`FreeLists.cold_ring`, from `cold_head`
to `cold_clock`), a FIFO like vLLM's free queue: going cold appends at the tail, a pop takes
from the head, so the steady state of a serving loop (the stack empty, every free block cold)
pops in O(batch), not O(pool). A revived block leaves a hole (its `cold_at` no longer names
that slot); pops skip holes, and a ring whose holes would overflow it is compacted (one sort).

Every pool-0 pop goes through `take_pool0`; every room check reads `allocatable`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from kvquota.codes import INT32_MAX
from kvquota.core.index import forget
from kvquota.core.jit import donating_jit
from kvquota.core.pages import scrub_blocks
from kvquota.core.scatter import clip, oob
from kvquota.errors import InvalidArgumentError
from kvquota.sentinel import INVALID
from kvquota.state import KVState, StateConfig
from kvquota.validation import bucket, int_scalar


def allocatable(config: StateConfig, state: KVState, xp=jnp):
    """i32[POOLS]: blocks an allocation may take from each pool: its free-list stack, plus the
    cold cached blocks for pool 0. `xp=np` on a host state (the facade's room checks)."""
    free = xp.asarray(state.free.free_count)
    pool0 = xp.arange(config.num_pools) == 0
    return (free + xp.where(pool0, xp.asarray(state.free.cold_count), 0)).astype(xp.int32)


def leave_cache(config: StateConfig, state: KVState, ids) -> KVState:
    """Cold blocks `ids` (i32[K], INVALID = none) leave the prefix cache: the tombstone of a
    free block (fill 0, no hash, salt or parent, generation bumped), no LRU stamp, pages scrubbed
    under scrub_on_free, no index entry. The caller counts them out of `cold_count`."""
    nb = config.total_blocks
    keep = ids >= 0
    i = oob(ids, keep, nb)
    b = state.blocks
    state = state.update(
        fill=b.fill.at[i].set(0, mode="drop"),
        block_hash=b.block_hash.at[i].set(jnp.uint32(0), mode="drop"),
        hashed=b.hashed.at[i].set(False, mode="drop"),
        block_salt=b.block_salt.at[i].set(jnp.uint32(0), mode="drop"),
        parent=b.parent.at[i].set(INVALID, mode="drop"),
        parent_gen=b.parent_gen.at[i].set(0, mode="drop"),
        generation=b.generation.at[i].add(1, mode="drop"),
        cold_at=b.cold_at.at[i].set(INVALID, mode="drop"),
    )
    state = forget(config, state, i)
    if config.scrub_on_free:
        state = state.replace(pages=scrub_blocks(config, state.pages, ids, keep))
    return state


def _compact(config: StateConfig, cold_at, ring, clock, count):
    """Re-stamp the cold blocks `clock - count .. clock - 1` in their LRU order and rewrite the
    ring without holes: (cold_at, ring, head). One sort of pool 0's stamps; run only when the
    ring would overflow or the oldest window holds too few live entries."""
    n0 = config.num_blocks
    key = jnp.where(cold_at[:n0] >= 0, cold_at[:n0], INT32_MAX)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # oldest first, the rest after
    r = jnp.arange(n0, dtype=jnp.int32)
    live = r < count
    head = clock - count
    stamp = head + r
    cold_at = cold_at.at[oob(order, live, config.total_blocks)].set(stamp, mode="drop")
    ring = ring.at[oob(stamp % n0, live, n0)].set(order, mode="drop")
    return cold_at, ring, head


def _window(config: StateConfig, k: int) -> int:
    """Ring entries `oldest` scans from the head before it compacts (static)."""
    return min(config.num_blocks, 4 * k + 1024)


def _once(when, fn, carry):
    """`fn(carry)` when `when` (bool[]), else `carry` as it is: a loop of zero or one trip, not a
    `lax.cond`: XLA:CPU copies [N_0]-sized operands that a conditional's branch passes through,
    which cost a few MB of copies on every allocation. Values of `carry` that `fn` leaves as
    they are stay loop-invariant, and XLA hoists whatever the body builds from them alone out of
    the loop, computing it on every call, trip or not: `fn` must change them (any value will
    do where nothing reads them after the trip)."""
    return lax.while_loop(lambda c: c[0] < when.astype(jnp.int32),
                          lambda c: (c[0] + 1, fn(c[1])), (jnp.int32(0), carry))[1]


def _compact_if(config: StateConfig, when, cold_at, ring, head, clock, count):
    """`_compact` when `when` (bool[]), else the arrays as they are: (cold_at, ring, head).
    `clock` and `count` ride in the loop's carry and leave it changed (`_once`): built from
    them, the stamps and masks of the trip would be hoisted out of it."""
    def compact(c):
        zero = jnp.int32(0)  # after the one trip nothing reads them: any value makes them vary
        return _compact(config, c[0], c[1], c[3], c[4]) + (zero, zero)

    return _once(when, compact, (cold_at, ring, head, clock, count))[:3]


def oldest(config: StateConfig, state: KVState, need, k: int):
    """The `need` (i32[] <= min(k, cold_count)) least recently cold blocks, oldest first:
    (ids i32[k], INVALID past `need`; the state with the ring's head moved past them).

    The ring holds cold blocks in stamp order from `cold_head` to `cold_clock`; revived blocks
    leave holes (their `cold_at` no longer matches). A window of the oldest entries is
    scanned, so a pop costs O(k) in the usual case, not O(pool); only when the window holds
    fewer than `need` live entries is the ring compacted first (one sort), after which its
    first `need` entries are live."""
    n0 = config.num_blocks
    w = _window(config, k)
    f = state.free
    t = jnp.arange(w, dtype=jnp.int32)

    def window(cold_at, ring, head):
        cand = ring[(head + t) % n0]
        return cand, (head + t < f.cold_clock) & (cand >= 0) & (cold_at[clip(cand)] == head + t)

    _, live = window(state.blocks.cold_at, f.cold_ring, f.cold_head)
    cold_at, ring, head = _compact_if(config, (need > 0) & (live.sum() < need),
                                      state.blocks.cold_at, f.cold_ring, f.cold_head,
                                      f.cold_clock, f.cold_count)
    cand, live = window(cold_at, ring, head)
    li = live.astype(jnp.int32)
    rank = jnp.cumsum(li) - li
    took = live & (rank < need)
    ids = jnp.full((k,), INVALID, jnp.int32).at[jnp.where(took, rank, k)].set(cand, mode="drop")
    last = jnp.max(jnp.where(took, t, -1))
    return ids, state.update(cold_at=cold_at, cold_ring=ring, cold_head=head + last + 1)


def take_pool0(config: StateConfig, state: KVState, take, rank=None):
    """Pop a pool-0 block for every entry of `take` (bool[...], any shape): the stack first
    (top down, in `rank` order: row-major by default), then, when the stack is short and the
    config keeps cold blocks, the least recently cold ones, which leave the cache.

    Returns (ids i32[take.shape], INVALID where not taken; blocks taken i32[]; the state with
    `free_count[0]` / `cold_count` lowered). The caller checked `allocatable` (so ranks stay
    below it) and must build on the returned state: reused blocks carry a bumped generation and
    (scrub_on_free) zeroed pages. Cold blocks a caller must keep (a batch's revived prefix hits)
    must have left `cold_at` before the call."""
    ti = take.astype(jnp.int32)
    if rank is None:
        flat = ti.ravel()
        rank = (jnp.cumsum(flat) - flat).reshape(take.shape)
    n = ti.sum().astype(jnp.int32)
    cnt = state.free.free_count[0]
    stacked = take & (rank < cnt)
    ids = jnp.where(stacked, state.free.free_list[clip(cnt - 1 - rank)], INVALID)
    n_stack = jnp.minimum(n, cnt)
    state = state.update(free_count=state.free.free_count.at[0].add(-n_stack))
    if not config.keep_cold_blocks:
        return ids, n, state
    k = min(int(np.prod(take.shape)), config.num_blocks)
    n_cold = n - n_stack
    first, state = _take_cold(config, state, n_cold, k)
    j = rank - cnt
    cold_ids = jnp.where(take & (j >= 0), first[jnp.clip(j, 0, k - 1)], INVALID)
    return jnp.where(stacked, ids, cold_ids), n, state


def _take_cold(config: StateConfig, state: KVState, need, k: int):
    """The `need` (i32[] <= k) least recently cold blocks leave the cache for a pop: (ids
    i32[k] oldest first, INVALID past `need`; the state). In a loop of zero or one trip
    (`_once`): when the stack covered the pop, as it mostly does, the window scan of `oldest`
    (~4k ring entries) and the k-entry scatters of `leave_cache` are skipped, not run on INVALID
    ids. The trip writes every pool-sized array it carries, so nothing is hoisted out of it."""
    def take(c):
        first, state = oldest(config, c[0], need, k)
        state = leave_cache(config, state, first)  # the same blocks as the entries they fill
        return state.update(cold_count=state.free.cold_count - need), first

    state, first = _once(need > 0, take, (state, jnp.full((k,), INVALID, jnp.int32)))
    return first, state


def stamp_cold(config: StateConfig, state: KVState, blocks, cold):
    """Updates (a dict for `state.update`) that make the entries `cold` (bool[E]) of `blocks`
    (i32[E], distinct where cold) cold: stamps from `cold_clock` appended to the ring, in
    *reverse* entry order so the tail of a freed table is reused before its head (vLLM frees a
    request's blocks in reverse for the same reason: a lost head makes the whole chain
    unreachable), and the counters. A ring that would overflow (its holes, left by revived
    blocks, plus the new entries exceed pool 0) is compacted first."""
    n0, nb = config.num_blocks, config.total_blocks
    f = state.free
    ci = cold.astype(jnp.int32)
    n = ci.sum().astype(jnp.int32)
    later = n - jnp.cumsum(ci)  # cold entries after each entry
    cold_at, ring, head = _compact_if(config, f.cold_clock + n - f.cold_head > n0,
                                      state.blocks.cold_at, f.cold_ring, f.cold_head,
                                      f.cold_clock, f.cold_count)
    stamp = f.cold_clock + later
    return dict(
        cold_at=cold_at.at[oob(blocks, cold, nb)].set(stamp, mode="drop"),
        cold_ring=ring.at[oob(stamp % n0, cold, n0)].set(blocks, mode="drop"),
        cold_head=head,
        cold_count=f.cold_count + n,
        cold_clock=f.cold_clock + n,
    )


# ---- admission: prefix hits that revive cold blocks --------------------------------------------
def revive_inputs(state: KVState, hits):
    """(cold_hit bool[B, M], group i32[B, M]) of a batch's prefix hits i32[B, M]: which hits
    are cold, and for each cold hit (i, k) its group: the lowest row hitting the same block. A
    block can only be hit at its chain depth (the lookup checks the parent chain from the
    root), so column k is compared with column k only: a stable sort of each column's B rows,
    O(B M log B), not a [B, M, B] comparison (4M entries for 64 prompts of 1,024 blocks). A
    batch without cold hits, the usual case, skips the sort (7 ms at that size on CPU): every
    entry then groups alone. (A `lax.cond` is cheap here: its operands are [B, M].)"""
    b, m = hits.shape
    cold_hit = (hits >= 0) & (state.blocks.cold_at[clip(hits)] >= 0)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]

    def grouped(hits, cold_hit):
        cols = jnp.arange(m, dtype=jnp.int32)[None, :]
        key = jnp.where(cold_hit, hits, -1 - rows)  # an entry that is no cold hit groups alone
        order = jnp.argsort(key, axis=0, stable=True).astype(jnp.int32)
        run = jnp.take_along_axis(key, order, axis=0)
        starts = jnp.concatenate([jnp.ones((1, m), bool), run[1:] != run[:-1]], axis=0)
        first = lax.cummax(jnp.where(starts, rows, 0), axis=0)  # sorted position of run start
        leader = jnp.take_along_axis(order, first, axis=0)  # its row: the lowest (stable sort)
        return jnp.zeros((b, m), jnp.int32).at[order, cols].set(leader)

    def alone(hits, cold_hit):
        return jnp.broadcast_to(rows, (b, m))

    return cold_hit, lax.cond(cold_hit.any(), grouped, alone, hits, cold_hit)


def revivers(cold_hit, group, ok, tenants):
    """Who pays for each revived block: the lowest-index *accepted* row that hits it (the rule
    `_decide` counts with). Returns (rev bool[B, M]: the entry revives its block; tenant i32[B, M]
    of each cold hit's reviver)."""
    b, m = cold_hit.shape
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    cols = jnp.arange(m, dtype=jnp.int32)[None, :]
    paying = jnp.full((b, m), b, jnp.int32).at[group, cols].min(
        jnp.where(cold_hit & ok[:, None], rows, b))
    first = paying[group, cols]  # the group's lowest accepted row (b: none)
    mine = cold_hit & ok[:, None] & (first == rows)
    return mine, tenants[jnp.where(first < b, first, 0)]


# ---- drop_cold ----------------------------------------------------------------------------------
@struct.dataclass
class ColdReport:
    """What `drop_cold` did. Pool 0's allocatable blocks are unchanged: cold blocks already
    counted as free capacity; they only left the prefix cache for the free list."""

    dropped_blocks: jax.Array  # i32[]  cold blocks pushed onto pool 0's free list
    cold_blocks: jax.Array  # i32[]  cold blocks left in the cache
    pool_bytes: tuple = struct.field(pytree_node=False, default=())

    @property
    def bytes_dropped(self) -> int:
        """Bytes of cache content given up (already free capacity before)."""
        return int(self.dropped_blocks) * self.pool_bytes[0]


@donating_jit(static_argnames=("slots",))
def drop_cold_core(config: StateConfig, state: KVState, max_blocks, slots: int):
    """Push the `max_blocks` (i32[], <= cold_count) least recently cold blocks onto pool 0's
    stack, oldest deepest, clearing their cache entries. `slots` (static, >= max_blocks, <=
    num_blocks) sizes the selection."""
    nb = config.total_blocks
    n = jnp.minimum(max_blocks, state.free.cold_count).astype(jnp.int32)
    ids, state = oldest(config, state, n, slots)
    j = jnp.arange(slots, dtype=jnp.int32)
    take = ids >= 0
    state = leave_cache(config, state, ids)
    cnt = state.free.free_count[0]
    state = state.update(
        free_list=state.free.free_list.at[oob(cnt + j, take, nb)].set(ids, mode="drop"),
        free_count=state.free.free_count.at[0].add(n),
        cold_count=state.free.cold_count - n,
    )
    return state, ColdReport(dropped_blocks=n, cold_blocks=state.free.cold_count,
                             pool_bytes=config.pool_bytes)


def drop_cold(config: StateConfig, state: KVState, max_blocks=None, *, donate=False):
    """Allocator.drop_cold: up to `max_blocks` (None: all) of the cold blocks."""
    cold = int(np.asarray(state.free.cold_count))
    n = cold
    if max_blocks is not None:
        m = int_scalar("max_blocks", max_blocks, InvalidArgumentError)
        if m < 0:
            raise InvalidArgumentError(f"max_blocks must be >= 0, got {m}")
        n = min(m, cold)
    slots = min(bucket(n), config.num_blocks)
    return drop_cold_core(config, state, np.int32(n), slots, donate=donate)
