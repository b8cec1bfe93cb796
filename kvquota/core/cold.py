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

Every pool-0 pop goes through `take_pool0`; every room check reads `allocatable`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from kvquota.codes import INT32_MAX
from kvquota.core.pages import scrub_blocks
from kvquota.core.scatter import clip, oob
from kvquota.sentinel import INVALID
from kvquota.state import KVState, StateConfig


def allocatable(config: StateConfig, state: KVState, xp=jnp):
    """i32[POOLS]: blocks an allocation may take from each pool: its free-list stack, plus the
    cold cached blocks for pool 0. `xp=np` on a host state (the facade's room checks)."""
    free = xp.asarray(state.free.free_count)
    pool0 = xp.arange(config.num_pools) == 0
    return (free + xp.where(pool0, xp.asarray(state.free.cold_count), 0)).astype(xp.int32)


def leave_cache(config: StateConfig, state: KVState, ids) -> KVState:
    """Cold blocks `ids` (i32[K], INVALID = none) leave the prefix cache: the tombstone of a
    free block (fill 0, no hash, salt or parent, generation bumped), no LRU stamp, pages scrubbed
    under scrub_on_free. The caller counts them out of `cold_count`."""
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
    if config.scrub_on_free:
        state = state.replace(pages=scrub_blocks(config, state.pages, ids, keep))
    return state


def lru(config: StateConfig, state: KVState, k: int):
    """i32[k]: the min(k, cold_count) pool-0 blocks with the oldest cold stamps, oldest first
    (the entries after them are not cold blocks). Callers run it only when they need it.

    Stamps are distinct, so the n-th smallest one, t, is found by bisecting its value (the
    smallest t with n stamps <= t: at most 31 counting passes over pool 0, none when nothing
    is cold), the n blocks with stamps <= t by one `nonzero`, and only those n are sorted. On
    the 2-core CPU of the development machine: 0.5-0.6 ms at 2^16 blocks and 9.5-15.5 ms at
    2^20, where `lax.top_k` over pool 0 (a full sort on CPU) takes 11 ms and 314-330 ms."""
    n0 = config.num_blocks
    stamps = state.blocks.cold_at[:n0]
    key = jnp.where(stamps >= 0, stamps, INT32_MAX)
    n = jnp.minimum(k, state.free.cold_count)

    def halve(bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = (key <= mid).sum() >= n
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    top = jnp.maximum(state.free.cold_clock - 1, 0)
    t, _ = lax.while_loop(lambda b: (b[0] < b[1]) & (n > 0), halve, (jnp.int32(0), top))
    ids = jnp.nonzero((key <= t) & (n > 0), size=k, fill_value=0)[0].astype(jnp.int32)
    rank = jnp.arange(k, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(rank < n, key[ids], INT32_MAX), stable=True)
    return ids[order]


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

    def reuse(st):
        oldest = lru(config, st, k)
        j = rank - cnt
        cold_ids = jnp.where(take & (j >= 0), oldest[jnp.clip(j, 0, k - 1)], INVALID)
        st = leave_cache(config, st, cold_ids.ravel())
        return cold_ids, st.update(cold_count=st.free.cold_count - n_cold)

    def stack_only(st):
        return jnp.full(take.shape, INVALID, jnp.int32), st

    cold_ids, state = lax.cond(n_cold > 0, reuse, stack_only, state)
    return jnp.where(stacked, ids, cold_ids), n, state


def stamp_cold(config: StateConfig, state: KVState, blocks, cold):
    """Updates (a dict for `state.update`) that make the entries `cold` (bool[E]) of `blocks`
    (i32[E], distinct where cold) cold: LRU stamps from `cold_clock`, in *reverse* entry order so
    the tail of a freed table is reused before its head (vLLM frees a request's blocks in reverse
    for the same reason: a lost head makes the whole chain unreachable), and the counters."""
    ci = cold.astype(jnp.int32)
    n = ci.sum().astype(jnp.int32)
    later = n - jnp.cumsum(ci)  # cold entries after each entry
    s = state
    return dict(
        cold_at=s.blocks.cold_at.at[oob(blocks, cold, config.total_blocks)].set(
            s.free.cold_clock + later, mode="drop"),
        cold_count=s.free.cold_count + n,
        cold_clock=s.free.cold_clock + n,
    )


# ---- admission: prefix hits that revive cold blocks --------------------------------------------
def revive_inputs(state: KVState, hits):
    """(cold_hit bool[B, M], same bool[B, M, B]) of a batch's prefix hits i32[B, M]: which hits
    are cold, and for each cold hit (i, k) which rows j hit the same block. A block can only be
    hit at its chain depth (the lookup checks the parent chain from the root), so comparing
    column k with column k is exact."""
    cold_hit = (hits >= 0) & (state.blocks.cold_at[clip(hits)] >= 0)
    same = (hits[:, :, None] == hits.T[None, :, :]) & cold_hit[:, :, None]
    return cold_hit, same


def revivers(cold_hit, same, ok, tenants):
    """Who pays for each revived block: the lowest-index *accepted* row that hits it (the rule
    `_decide` counts with). Returns (rev bool[B, M]: the entry revives its block; tenant i32[B, M]
    of each cold hit's reviver)."""
    b = ok.shape[0]
    cand = same & ok[None, None, :]
    first = jnp.argmax(cand, axis=2)
    mine = cold_hit & ok[:, None] & (first == jnp.arange(b)[:, None])
    return mine, tenants[first]


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


def drop_cold(config: StateConfig, state: KVState, max_blocks, slots: int):
    """Push the `max_blocks` (i32[], <= cold_count) least recently cold blocks onto pool 0's
    stack, oldest deepest, clearing their cache entries. `slots` (static, >= max_blocks, <=
    num_blocks) sizes the selection."""
    nb = config.total_blocks
    oldest = lru(config, state, slots)
    j = jnp.arange(slots, dtype=jnp.int32)
    take = j < jnp.minimum(max_blocks, state.free.cold_count)
    ids = jnp.where(take, oldest, INVALID)
    n = take.sum().astype(jnp.int32)
    state = leave_cache(config, state, ids)
    cnt = state.free.free_count[0]
    state = state.update(
        free_list=state.free.free_list.at[oob(cnt + j, take, nb)].set(ids, mode="drop"),
        free_count=state.free.free_count.at[0].add(n),
        cold_count=state.free.cold_count - n,
    )
    return state, ColdReport(dropped_blocks=n, cold_blocks=state.free.cold_count,
                             pool_bytes=config.pool_bytes)
