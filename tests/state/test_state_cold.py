"""Cold cached blocks (`StateConfig(keep_cold_blocks=True)`): full pool-0 blocks that lose their
last reference stay in the prefix cache, charged to no one and counted as free capacity, and are
reused least recently cold first, only when pool 0's stack is empty.

Every test runs on one config, the hand-checked TINY pool (8 pool-0 blocks of 2 tokens,
scrub_on_free) with the flag on and hash_bits=2, so equal hashes are common and the token-id and
parent checks of the lookup do the work; `check_invariants` after every transformation."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test

from kvquota import codes
from kvquota import errors as E
from kvquota.allocator import Allocator
from kvquota.sentinel import INVALID
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, seq_tokens

COLD = dataclasses.replace(TINY, keep_cold_blocks=True, hash_bits=2)
OFF = dataclasses.replace(COLD, keep_cold_blocks=False)
P = COLD.block_size


def _ints(x):
    return [int(v) for v in np.asarray(x)]


def ledger(alloc, s):
    """The ledger's counts as plain ints, for exact comparison with figures worked out by hand:
    charged blocks [T][POOLS] (pools: 0 = f32 device, 1 = int8, 2 = host), used tokens [T],
    allocatable blocks per pool [POOLS] (pool 0's cold blocks included), cold blocks."""
    led = jax.device_get(alloc.ledger(s))
    return dict(charged=led.charged_blocks.tolist(), used=led.used_tokens.tolist(),
                free=led.free_blocks.tolist(), cold=int(led.cold_blocks))


def _value(prefix) -> float:
    """The K (and V - 0.5) every test writes for the token ending `prefix`: a function of the
    whole prefix, so a block holding K/V of another context shows."""
    h = 7
    for t in prefix:
        h = (h * 131 + int(t) + 1) % (1 << 20)
    return float(h * 4 + len(prefix) % 4)


@jax.jit
def _write(pool0, blocks, slots, vals):
    """pool0 with K = vals, V = vals + 0.5 at (blocks, slots) (i32[K]; pool size = dropped)."""
    val = vals[None, None, :, None]
    return pool0.replace(k=pool0.k.at[:, :, blocks, slots, :].set(val, mode="drop"),
                         v=pool0.v.at[:, :, blocks, slots, :].set(val + 0.5, mode="drop"))


def write_kv(state, seq, start, end):
    """Write the K/V of cache slots [start, end) of `seq` (what prefill / decode would)."""
    toks = seq_tokens(state, seq, P)
    table = np.asarray(state.seqs.block_tables[seq])
    width = COLD.max_tokens_per_seq
    blocks = np.full(width, COLD.num_blocks, np.int32)  # out of range: dropped
    slots = np.zeros(width, np.int32)
    vals = np.zeros(width, np.float32)
    for i in range(start, end):
        j = i - start
        blocks[j], slots[j], vals[j] = table[i // P], i % P, _value(toks[:i + 1])
    pages = (_write(state.pages[0], blocks, slots, vals),) + tuple(state.pages[1:])
    return state.replace(pages=pages)


def page(state, block):
    """(K, V) pages of a pool-0 block, on the host."""
    return np.asarray(state.pages[0].k[:, :, block]), np.asarray(state.pages[0].v[:, :, block])


def admit(alloc, s, rows):
    s, r = alloc.admit(s, *prompts(rows))
    alloc.check(s)
    for i in np.flatnonzero(np.asarray(r.admitted)):
        s = write_kv(s, int(r.seq_id[i]), int(r.cached_tokens[i]), len(rows[i][1]))
    return s, r


def assert_hits_hold(s, prompt, hits):
    """Each hit block holds exactly the prompt's tokens and the K/V written for its prefix."""
    for k, b in enumerate(hits):
        assert _ints(s.blocks.token_ids[b]) == list(prompt[k * P:(k + 1) * P])
        kp, vp = page(s, b)
        for j in range(P):
            want = _value(prompt[:k * P + j + 1])
            assert np.all(kp[:, :, j] == want) and np.all(vp[:, :, j] == want + 0.5), (k, j)


def cold_set(s):
    return {int(b) for b in np.flatnonzero(np.asarray(s.blocks.cold_at) >= 0)}


def lru_of(s):
    """Cold blocks, least recently cold first."""
    at = np.asarray(s.blocks.cold_at)
    return [int(b) for b in sorted(np.flatnonzero(at >= 0), key=lambda b: at[b])]


# ---- the next turn hits -------------------------------------------------------------------------
def test_next_turn_hits_its_cold_blocks_with_bit_identical_pages():
    alloc, s = fresh(COLD)
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    table = _ints(s.seqs.block_tables[0])
    before = [page(s, b) for b in table[:2]]
    gen = _ints(s.blocks.generation)
    s, fr = alloc.free(s, [0])
    alloc.check(s)
    # Both full blocks went cold (tail first in LRU order), the partial one onto the stack:
    # all three are returned capacity, none is charged.
    assert lru_of(s) == [table[1], table[0]] and int(s.free.cold_count) == 2
    assert fr.pool_bytes_returned == 3 * BLOCK and int(s.free.free_count[0]) == 6
    assert _ints(alloc.allocatable_blocks(s)) == [8, 4, 4]
    assert int(alloc.ledger(s).charged_bytes[0]) == 0
    # The ledger: nothing charged to anyone, no tokens used, all 8 pool-0 blocks allocatable
    # (6 on the stack + 2 cold); the free released t0's 3 blocks of quota and 5 tokens.
    assert ledger(alloc, s) == dict(charged=[[0, 0, 0], [0, 0, 0]], used=[0, 0],
                                    free=[8, 4, 4], cold=2)
    assert fr.quota_bytes_released == 3 * BLOCK and _ints(fr.tokens_released) == [5, 0]
    assert _ints(fr.blocks_returned) == [3, 0, 0]
    assert _ints(s.blocks.generation) == [g + (b == table[2]) for b, g in enumerate(gen)]

    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5, 6, 7])])
    seq = int(r.seq_id[0])
    assert _ints(r.cached_tokens)[0] == 4 and _ints(r.new_blocks)[0] == 2
    new_table = _ints(s.seqs.block_tables[seq])
    assert new_table[:2] == table[:2]
    for b, (k, v) in zip(table[:2], before):
        assert np.array_equal(page(s, b)[0], k) and np.array_equal(page(s, b)[1], v)
    # Revived: held, charged to the admitting tenant (2 revived + 2 new), out of the LRU.
    assert cold_set(s) == set() and int(s.free.cold_count) == 0
    assert _ints(s.blocks.payer[np.array(table[:2])]) == [0, 0]
    assert _ints(s.blocks.payer_refs[np.array(table[:2])]) == [1, 1]
    assert _ints(s.tenants.charged_blocks[0]) == [4, 0, 0]
    assert seq_tokens(s, seq, P) == [1, 2, 3, 4, 5, 6, 7]
    assert ledger(alloc, s) == dict(charged=[[4, 0, 0], [0, 0, 0]], used=[7, 0],
                                    free=[4, 4, 4], cold=0)
    assert _ints(alloc.ledger(s).charged_bytes) == [4 * BLOCK, 0]


def test_without_the_flag_the_next_turn_misses():
    alloc, s = fresh(OFF)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    s, _ = alloc.free(s, [0])
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5, 6, 7])])
    assert _ints(r.cached_tokens)[0] == 0 and int(s.free.cold_count) == 0


# ---- LRU reuse ---------------------------------------------------------------------------------
def test_cold_blocks_are_reused_least_recent_first_and_only_when_the_stack_is_empty():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4])])  # X0 X1
    xs = _ints(s.seqs.block_tables[0])[:2]
    s, _ = alloc.free(s, [0])
    s, _ = admit(alloc, s, [(0, [5, 6, 7, 8])])  # Y0 Y1 (from the stack, never the cold X)
    ys = _ints(s.seqs.block_tables[0])[:2]
    assert not set(ys) & set(xs)
    s, _ = alloc.free(s, [0])
    alloc.check(s)
    order = [xs[1], xs[0], ys[1], ys[0]]  # freed tables tail first, earlier frees first
    assert lru_of(s) == order
    assert ledger(alloc, s) == dict(charged=[[0, 0, 0], [0, 0, 0]], used=[0, 0],
                                    free=[8, 4, 4], cold=4)
    # Four stack blocks: an admission of four takes exactly them; the cold set is untouched.
    s, r = admit(alloc, s, [(1, [9] * 8)])
    assert int(s.free.free_count[0]) == 0 and lru_of(s) == order
    assert not set(_ints(s.seqs.block_tables[int(r.seq_id[0])])) & set(order)
    # Now the stack is empty: the oldest cold blocks go, in order, and leave the cache.
    gen = _ints(s.blocks.generation)
    s, r = admit(alloc, s, [(1, [7, 9, 9])])
    seq = int(r.seq_id[0])
    assert _ints(s.seqs.block_tables[seq])[:2] == order[:2] and lru_of(s) == order[2:]
    assert [int(s.blocks.generation[b]) - gen[b] for b in order] == [1, 1, 0, 0]
    # The two reused cold blocks are t1's now (4 + 2 charged), out of the cold count; the two
    # left cold are all pool 0 can still allocate.
    assert ledger(alloc, s) == dict(charged=[[0, 0, 0], [6, 0, 0]], used=[0, 11],
                                    free=[2, 4, 4], cold=2)
    # An append at a block boundary takes the next one; a fork's partial copy the last.
    s, ar = alloc.append(s, [seq], [4])
    alloc.check(s)
    s, ar = alloc.append(s, [seq], [4])
    alloc.check(s)
    assert bool(ar.new_block[0]) and int(ar.block[0]) == order[2]
    s, fk = alloc.fork(s, [seq])
    alloc.check(s)
    assert int(fk.copied_to[0]) == order[3] and lru_of(s) == []
    assert _ints(alloc.allocatable_blocks(s))[0] == 0
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3])]))
    assert r.reasons()[0] == "pool full"
    # The X chain is gone from the cache: freed capacity no longer finds [1, 2, 3, 4].
    s, _ = alloc.free(s, [seq])
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    assert _ints(r.cached_tokens)[0] == 0


def test_a_reused_cold_block_is_never_returned_by_a_later_lookup():
    # hash_bits=2: the reused block's new content often hashes like the old one, so the
    # token-id check is what rejects it.
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3])])
    x = int(s.seqs.block_tables[0, 0])
    s, _ = alloc.free(s, [0])
    s, _ = admit(alloc, s, [(1, [9] * 8), (1, [8] * 5)])  # the stack: 4 + 3 blocks
    assert int(s.free.free_count[0]) == 0 and lru_of(s) == [x]
    s, r = admit(alloc, s, [(0, [5, 6])])  # X reused at the head of another chain
    assert int(s.seqs.block_tables[int(r.seq_id[0]), 0]) == x
    s, _ = alloc.free(s, [0, 1])  # room again ([9] * 8 and [8] * 4 go cold)
    for prompt, cached in (([1, 2, 3], 0), ([5, 6, 7], 2)):
        s, r = admit(alloc, s, [(0, prompt)])
        assert _ints(r.cached_tokens)[0] == cached
        seq = int(r.seq_id[0])
        assert_hits_hold(s, prompt, _ints(s.seqs.block_tables[seq])[: int(r.hit_blocks[0])])


def test_a_cold_child_of_a_reused_parent_never_matches():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    x, y = _ints(s.seqs.block_tables[0])[:2]
    s, _ = alloc.pin_blocks(s, [y])  # so that Y goes cold after X
    s, _ = alloc.free(s, [0])
    s, _ = alloc.unpin_blocks(s, [y])
    alloc.check(s)
    assert lru_of(s) == [x, y]
    s, r = admit(alloc, s, [(1, [9] * 8), (1, [8, 8, 8])])
    assert int(s.free.free_count[0]) == 0
    # X is reused for a one-token prompt [1] and refilled with [1, 2] by an append: the same
    # tokens, hash and salt as before, but a new generation.
    s, r = admit(alloc, s, [(0, [1])])
    seq = int(r.seq_id[0])
    assert int(s.seqs.block_tables[seq, 0]) == x
    s, _ = alloc.append(s, [seq], [2])
    s = write_kv(s, seq, 1, 2)
    alloc.check(s)
    assert bool(s.blocks.hashed[x]) and y in cold_set(s)
    assert int(s.blocks.parent[y]) == x
    assert int(s.blocks.parent_gen[y]) != int(s.blocks.generation[x])
    s, _ = alloc.free(s, [1])  # room: [8, 8] goes cold, [8] onto the stack
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 6])])
    # X hits (held, its content is [1, 2]); Y's tokens, hash and salt match, but it hangs off
    # X's old life: a miss. The two new blocks: the stack's one, then Y, the oldest cold block.
    assert _ints(r.cached_tokens)[0] == 2
    seq = int(r.seq_id[0])
    table = _ints(s.seqs.block_tables[seq])
    assert table[0] == x and table[2] == y and cold_set(s) == {int(b) for b in lru_of(s)}
    assert y not in cold_set(s) and int(s.blocks.parent[y]) == table[1]
    assert_hits_hold(s, [1, 2, 3, 4, 6], [x])


def test_a_restored_evicted_sequence_offers_no_lookup_target():
    # Found by the machine's page check (with or without the flag): restore re-hashed every
    # full block it brought back, also those eviction had rewritten at shifted positions, so
    # a prompt of the surviving tokens hit K/V computed after a token it does not have.
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5, 6])])
    s, rep = alloc.evict(s, [0], policy="oldest", keep_tokens=5)  # drops token 1
    assert seq_tokens(s, 0, P) == [2, 3, 4, 5, 6] and not np.asarray(s.blocks.hashed).any()
    s, _ = alloc.offload(s, [0])
    s, _ = alloc.restore(s, [0])
    alloc.check(s)
    assert not np.asarray(s.blocks.hashed).any()
    s, _ = alloc.free(s, [0])  # nothing goes cold either
    assert int(s.free.cold_count) == 0
    s, r = admit(alloc, s, [(0, [2, 3, 4, 5, 6])])
    assert _ints(r.cached_tokens)[0] == 0


# ---- both meters count revived blocks ----------------------------------------------------------
def test_the_byte_quota_counts_revived_blocks():
    alloc, s = fresh(COLD, tenants=((100, 3 * BLOCK, None), (100, 8 * BLOCK, None)))
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    s, _ = alloc.free(s, [0])
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5, 6, 7])])  # 2 revived + 2 new > 3
    assert r.reasons()[0] == "over byte quota" and cold_set(s) and int(s.free.cold_count) == 2
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])  # 2 revived + 1 new = 3
    assert r.reasons()[0] == "ok" and _ints(r.cached_tokens)[0] == 4
    assert int(alloc.ledger(s).charged_bytes[0]) == 3 * BLOCK


def test_pool_capacity_counts_revived_blocks():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    s, _ = alloc.free(s, [0])
    s, _ = admit(alloc, s, [(1, [9] * 8), (1, [8, 8, 8])])  # the stack is empty, 2 cold
    assert _ints(alloc.allocatable_blocks(s))[0] == 2
    before = jax.device_get(s)
    s2, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # 2 revived + 1 new > 2
    assert r.reasons()[0] == "pool full" and leaves_equal(s2, before)
    s2, r = admit(alloc, s, [(0, [1, 2, 3, 4])])  # 1 revived (the last block is computed) + 1
    assert r.reasons()[0] == "ok" and _ints(r.cached_tokens)[0] == 2


def test_rows_of_one_batch_hitting_one_cold_block_pay_for_it_once():
    alloc, s = fresh(COLD, tenants=((100, 8 * BLOCK, 0), (100, 8 * BLOCK, 0)))  # one group
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    x, y = _ints(s.seqs.block_tables[0])[:2]
    s, _ = alloc.free(s, [0])
    # Same tenant twice: the first row revives and pays, the second shares (an own reference).
    s2, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5]), (0, [1, 2, 3, 4, 6])])
    assert _ints(r.cached_tokens) == [4, 4]
    assert _ints(s2.blocks.ref_count[np.array([x, y])]) == [2, 2]
    assert _ints(s2.blocks.payer_refs[np.array([x, y])]) == [2, 2]
    assert _ints(s2.tenants.charged_blocks[:, 0]) == [4, 0]
    # Two tenants of a group: the first row's tenant pays; the other holds a shared reference.
    s2, r = admit(alloc, s, [(1, [1, 2, 3, 4, 5]), (0, [1, 2, 3, 4, 6])])
    assert _ints(r.cached_tokens) == [4, 4]
    assert _ints(s2.blocks.payer[np.array([x, y])]) == [1, 1]
    assert _ints(s2.blocks.payer_refs[np.array([x, y])]) == [1, 1]
    assert _ints(s2.tenants.charged_blocks[:, 0]) == [1, 3]
    # The first row refused (token quota): the next accepted row revives and pays.
    s3, _ = alloc.set_quota(s, 1, token_quota=2)
    s3, r = admit(alloc, s3, [(1, [1, 2, 3, 4, 5]), (0, [1, 2, 3, 4, 6])])
    assert r.reasons() == ["over token quota", "ok"]
    assert _ints(s3.blocks.payer[np.array([x, y])]) == [0, 0]
    assert _ints(s3.tenants.charged_blocks[:, 0]) == [3, 0]


def test_four_rows_on_one_cold_prefix_revive_it_once_behind_a_refused_row():
    """Four rows of one group on the cold prefix X Y (each row's group is the lowest row hitting
    the block; the reviver is the group's lowest *accepted* row): a refused row first, then the
    payer, a row of the same tenant and one of the other tenant, which hits X only."""
    alloc, s = fresh(COLD, tenants=((100, 8 * BLOCK, 0), (4, 8 * BLOCK, 0)))
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    x, y = _ints(s.seqs.block_tables[0])[:2]
    s, _ = alloc.free(s, [0])
    rows = [(1, [1, 2, 3, 4, 5]), (0, [1, 2, 3, 4, 5]), (0, [1, 2, 3, 4, 6]), (1, [1, 2, 3, 4])]
    ten = np.asarray([t for t, _ in rows], np.int32)
    tok = np.zeros((4, COLD.max_tokens_per_seq), np.int32)
    for i, (_, ids) in enumerate(rows):
        tok[i, : len(ids)] = ids
    lens = np.asarray([len(ids) for _, ids in rows], np.int32)
    s, r = alloc.admit(s, ten, tok, lens)
    alloc.check(s)
    assert r.reasons() == ["over token quota", "ok", "ok", "ok"]
    assert _ints(r.cached_tokens) == [0, 4, 4, 2] and cold_set(s) == set()
    assert _ints(s.blocks.payer[np.array([x, y])]) == [0, 0]
    assert _ints(s.blocks.ref_count[np.array([x, y])]) == [3, 2]
    assert _ints(s.blocks.payer_refs[np.array([x, y])]) == [2, 2]
    assert _ints(s.tenants.charged_blocks[:, 0]) == [4, 1]  # X, Y and two new; one new


def test_a_pop_never_takes_a_block_another_row_of_the_batch_revives():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    x, y = _ints(s.seqs.block_tables[0])[:2]
    s, _ = alloc.free(s, [0])
    s, _ = admit(alloc, s, [(1, [9] * 8), (1, [7, 7, 7])])
    g = int(s.seqs.block_tables[1, 0])
    s, _ = alloc.free(s, [1])  # [7, 7] cold after Y, X; [7] onto the stack
    assert lru_of(s) == [y, x, g] and int(s.free.free_count[0]) == 1
    # Row 0 revives X, Y and takes the stack block; row 1's pop is the first in the LRU that
    # is not revived: G, not Y.
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5]), (1, [6])])
    assert r.reasons() == ["ok", "ok"]
    assert _ints(s.seqs.block_tables[int(r.seq_id[0])])[:2] == [x, y]
    assert int(s.seqs.block_tables[int(r.seq_id[1]), 0]) == g and lru_of(s) == []


def test_a_ring_whose_holes_would_overflow_is_compacted_in_lru_order():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5, 6, 7, 8]), (1, [9, 9, 9, 9, 9])])
    a, b = _ints(s.seqs.block_tables[0]), _ints(s.seqs.block_tables[1])[:2]
    s, _ = alloc.free(s, [0])  # A's four blocks cold: stamps 0-3, tail first
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5, 6, 7])])  # revives A0-A2: three holes
    s, _ = alloc.free(s, [int(r.seq_id[0])])  # ... cold again, stamps 4-6
    alloc.check(s)
    assert lru_of(s) == [a[3], a[2], a[1], a[0]]
    assert (int(s.free.cold_head), int(s.free.cold_clock)) == (0, 7)
    s, _ = alloc.free(s, [1])  # two more: 7 + 2 entries > 8 slots, so the ring is compacted
    alloc.check(s)
    assert lru_of(s) == [a[3], a[2], a[1], a[0], b[1], b[0]]
    assert (int(s.free.cold_head), int(s.free.cold_clock)) == (3, 9)


def test_a_pop_past_a_window_of_holes_compacts_and_takes_the_oldest_live_block():
    # One token per block, so a few admissions make more holes than the window `oldest` scans
    # (4 k + 1024 ring entries) before it compacts.
    config = dataclasses.replace(COLD, num_blocks=2048, block_size=1, max_blocks_per_seq=1200,
                                 with_pages=False, compressed_pools=(), host_blocks=0,
                                 hash_bits=32)
    alloc = Allocator(config)
    s = alloc.init()
    s, _ = alloc.register_tenant(s, 0, token_quota=10**6, byte_quota=2048 * config.pool_bytes[0])
    rng = np.random.default_rng(0)

    def one(state, toks):
        width = 1100
        tok = np.zeros((1, width), np.int32)
        tok[0, :len(toks)] = toks
        state, r = alloc.admit(state, np.zeros(1, np.int32), tok, np.array([len(toks)], np.int32))
        assert r.reasons() == ["ok"]
        return state, int(r.seq_id[0])

    a_toks = np.concatenate([[1], rng.integers(0, 256, 1099)])
    s, sa = one(s, a_toks)
    s, sb = one(s, np.concatenate([[2], rng.integers(0, 256, 99)]))
    a, b = _ints(s.seqs.block_tables[sa])[:1100], _ints(s.seqs.block_tables[sb])[:100]
    s, _ = alloc.free(s, [sa])  # A cold, its tail the oldest
    s, _ = alloc.free(s, [sb])  # then B
    s, sa = one(s, a_toks)  # revives A[0..1098]: 1099 holes after A's tail in the ring
    s, sc = one(s, np.concatenate([[3], rng.integers(0, 256, 846)]))  # the stack, emptied
    alloc.check(s)
    assert int(s.free.free_count[0]) == 0 and lru_of(s)[:2] == [a[1099], b[99]]
    ring = lambda st: (int(st.free.cold_clock) - int(st.free.cold_head),  # noqa: E731
                       int(st.free.cold_count))
    assert ring(s) == (1200, 101)  # 1200 entries, 1099 of them holes
    s, r1 = alloc.append(s, [sc], [5])  # the head entry is live: taken from the window
    assert ring(s) == (1199, 100)
    s, r2 = alloc.append(s, [sc], [5])  # 1028 holes ahead: compacted, then B's tail
    alloc.check(s)
    assert [int(r1.block[0]), int(r2.block[0])] == [a[1099], b[99]]
    assert ring(s) == (99, 99) and lru_of(s) == b[98::-1]  # no hole left


# ---- scrub, drop_cold ----------------------------------------------------------------------------
def test_scrub_on_free_spares_cold_pages_and_zeroes_them_on_reuse():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3])])
    x, z = _ints(s.seqs.block_tables[0])[:2]
    s, _ = alloc.free(s, [0])
    assert np.all(page(s, x)[0] != 0) and not np.any(page(s, z)[0])  # cold kept, free zeroed
    s, _ = alloc.admit(s, *prompts([(1, [9] * 8), (1, [8] * 6)]))  # 4 + 3: the stack
    s, r = alloc.admit(s, *prompts([(1, [5])]))  # reuses X; nothing written yet
    assert int(s.seqs.block_tables[int(r.seq_id[0]), 0]) == x
    assert not np.any(page(s, x)[0]) and not np.any(page(s, x)[1])
    alloc.check(s)


def test_drop_cold_pushes_the_least_recent_onto_the_stack():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    s, _ = alloc.free(s, [0])
    s, _ = admit(alloc, s, [(1, [6, 7, 8])])
    s, _ = alloc.free(s, [0])
    order = lru_of(s)
    assert len(order) == 3
    every = dict(charged=[[0, 0, 0], [0, 0, 0]], used=[0, 0], free=[8, 4, 4])
    assert ledger(alloc, s) == dict(every, cold=3)
    gen, free0 = _ints(s.blocks.generation), int(s.free.free_count[0])
    s, rep = alloc.drop_cold(s, max_blocks=1)
    alloc.check(s)
    assert ledger(alloc, s) == dict(every, cold=2)  # capacity the same, one block less cold
    assert int(rep.dropped_blocks) == 1 and int(rep.cold_blocks) == 2
    assert rep.bytes_dropped == BLOCK and lru_of(s) == order[1:]
    assert int(s.free.free_count[0]) == free0 + 1 and int(s.free.free_list[free0]) == order[0]
    assert int(s.blocks.generation[order[0]]) == gen[order[0]] + 1
    assert _ints(alloc.allocatable_blocks(s))[0] == 8  # capacity unchanged
    s, rep = alloc.drop_cold(s)
    alloc.check(s)
    assert int(rep.dropped_blocks) == 2 and lru_of(s) == [] and int(s.free.free_count[0]) == 8
    assert ledger(alloc, s) == dict(every, cold=0)
    s, r = admit(alloc, s, [(0, [1, 2, 3, 4, 5])])
    assert _ints(r.cached_tokens)[0] == 0
    s, rep = alloc.drop_cold(s)  # nothing cold: nothing changes
    assert int(rep.dropped_blocks) == 0
    alloc.check(s)


def test_drop_cold_rejects_bad_max_blocks_before_any_work():
    alloc, s = fresh(COLD)
    s, _ = admit(alloc, s, [(0, [1, 2, 3])])
    s, _ = alloc.free(s, [0])
    before = jax.device_get(s)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(E.InvalidArgumentError):
            alloc.drop_cold(s, max_blocks=bad)
    assert leaves_equal(s, before)
    alloc_off, s_off = fresh(OFF)
    s_off, rep = alloc_off.drop_cold(s_off)
    assert int(rep.dropped_blocks) == 0


def test_donated_ops_give_the_arrays_of_plain_ones():
    """Going cold, LRU reuse (the lax.cond path) and drop_cold with the state donated."""

    def run(donate):
        alloc, s = fresh(COLD)
        s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [6] * 8)]))
        s, _ = alloc.free(s, [0], donate=donate)  # two blocks go cold
        s, _ = alloc.admit(s, *prompts([(1, [7] * 6)]), donate=donate)  # the stack, then LRU
        s, _ = alloc.append(s, [0], [8], donate=donate)  # the last cold block
        s, _ = alloc.free(s, [1], donate=donate)
        s, _ = alloc.drop_cold(s, 1, donate=donate)
        alloc.check(s)
        return jax.device_get(s)

    plain, donated = run(False), run(True)
    assert int(plain.free.cold_count) == 3 and int(plain.free.cold_clock) == 6
    assert leaves_equal(plain, donated)


# ---- with no full block ever freed, the flag changes nothing -----------------------------------
def _program(config):
    """A fixed program of every op that frees no full pool-0 block; the state after each op."""
    alloc, s = fresh(config)
    out = []

    def step(pair):
        nonlocal s
        s = pair[0]
        alloc.check(s)
        out.append(jax.device_get(s))

    step(alloc.admit(s, *prompts([(0, [1]), (1, [2, 3, 4])])))
    step(alloc.append(s, [0, INVALID], [5, 0]))  # [1, 5] full
    step(alloc.fork(s, [1]))  # shares [2, 3], copies the partial [4]
    step(alloc.admit(s, *prompts([(0, [1, 5, 9])])))  # hits [1, 5] (held)
    step(alloc.pin_blocks(s, [int(s.seqs.block_tables[1, 0])]))
    step(alloc.free(s, [2]))  # [2, 3] stays shared; only the partial copy is freed
    step(alloc.unpin_blocks(s, [int(s.seqs.block_tables[1, 0])]))  # still referenced
    step(alloc.offload(s, [3]))  # [9]: own, partial -> host; [1, 5] shared stays
    step(alloc.restore(s, [3]))  # the host block is freed (nothing is cold outside pool 0)
    step(alloc.drop_cold(s))
    step(alloc.append(s, [3, 1], [4, 8]))  # [9, 4] and [4, 8] full
    step(alloc.offload(s, [3]))  # [9, 4] -> host: a full pool-0 block is freed
    return out


def test_every_op_gives_the_same_arrays_with_and_without_the_flag_while_nothing_full_is_freed():
    on, off = _program(COLD), _program(OFF)
    assert len(on) == len(off)
    for i, (a, b) in enumerate(zip(on[:-1], off[:-1])):
        assert leaves_equal(a, b), f"step {i}"
    # ... and the last step did free a full block: there the two differ, by exactly the cold
    # block (its cache entry kept instead of pushed).
    assert int(on[-1].free.cold_count) == 1 and int(off[-1].free.cold_count) == 0


# ---- a state machine over every op with the flag on -----------------------------------------
STATS = collections.Counter()


class ColdMachine(RuleBasedStateMachine):
    """Random programs of admit / append / fork / free / pin / unpin / offload / restore /
    compress / evict / drop_cold on the cold config, two tenants of one share group and a
    two-token alphabet (many hits, many equal hashes). The test writes every slot's K/V as a
    function of its prefix, so a hit on a wrong block shows in its pages; after each step the
    invariants are recomputed, and each pop is checked against the LRU order seen before it."""

    def __init__(self):
        super().__init__()
        self.alloc = Allocator(COLD)
        s = self.alloc.init()
        for t in range(COLD.num_tenants):
            s, _ = self.alloc.register_tenant(s, t, token_quota=64, byte_quota=6 * BLOCK,
                                              share_group=0)
        self.s = s

    def _seqs(self, *status):
        st_ = np.asarray(self.s.seqs.seq_status)
        return [int(i) for i in np.flatnonzero(np.isin(st_, status))]

    def _pick(self, data, *status):
        return data.draw(st.sampled_from(self._seqs(*status)))

    def _pops_follow_the_lru(self, lru_before, stack_before, new_blocks, kept=()):
        """The pool-0 blocks an op took: the stack first, then the oldest cold ones (except
        `kept`, the batch's revived hits), in LRU order."""
        candidates = [b for b in lru_before if b not in set(kept)]
        reused = [b for b in new_blocks if b in set(lru_before)]
        assert len(reused) == max(0, len(new_blocks) - stack_before), (new_blocks, stack_before)
        assert reused == candidates[:len(reused)], (reused, candidates)
        STATS["cold reused"] += len(reused)

    @rule(t=st.integers(0, COLD.num_tenants - 1),
          toks=st.lists(st.integers(1, 2), min_size=1, max_size=COLD.max_tokens_per_seq))
    def admit(self, t, toks):
        self._admit(t, toks)

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), more=st.lists(st.integers(1, 2), max_size=3), other=st.booleans())
    def next_turn(self, data, more, other):
        """A session's turn ends (its sequence freed) and its next turn is admitted: the same
        tokens and a few more, by its tenant or by the other one of the group."""
        seq = self._pick(data, codes.SEQ_RUNNING)
        t, toks = int(self.s.seqs.seq_tenant[seq]), seq_tokens(self.s, seq, P)
        self._free(seq)
        self._admit((t + other) % COLD.num_tenants, (toks + more)[:COLD.max_tokens_per_seq])
        STATS["turns"] += 1

    def _admit(self, t, toks):
        lru_before, stack = lru_of(self.s), int(self.s.free.free_count[0])
        self.s, r = self.alloc.admit(self.s, *prompts([(t, toks)]))
        self.alloc.check(self.s)
        if not bool(r.admitted[0]):
            STATS["admit: " + r.reasons()[0]] += 1
            return
        seq, nhit = int(r.seq_id[0]), int(r.hit_blocks[0])
        self.s = write_kv(self.s, seq, int(r.cached_tokens[0]), len(toks))
        table = _ints(self.s.seqs.block_tables[seq])
        hits, new = table[:nhit], table[nhit:-(-len(toks) // P)]
        assert_hits_hold(self.s, toks, hits)
        self._pops_follow_the_lru(lru_before, stack, new, kept=hits)
        STATS["admits"] += 1
        STATS["hit blocks"] += nhit
        STATS["revived"] += len(set(hits) & set(lru_before))

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), tok=st.integers(1, 2))
    def append(self, data, tok):
        seq = self._pick(data, codes.SEQ_RUNNING)
        n = int(self.s.seqs.seq_lens[seq])
        if n >= COLD.max_tokens_per_seq:
            return
        lru_before, stack = lru_of(self.s), int(self.s.free.free_count[0])
        self.s, r = self.alloc.append(self.s, [seq], [tok])
        self.alloc.check(self.s)
        if bool(r.appended[0]):
            self.s = write_kv(self.s, seq, n, n + 1)
            self._pops_follow_the_lru(lru_before, stack, [int(r.block[0])] if bool(
                r.new_block[0]) else [])
            STATS["appends"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data())
    def fork(self, data):
        seq = self._pick(data, codes.SEQ_RUNNING)
        lru_before, stack = lru_of(self.s), int(self.s.free.free_count[0])
        self.s, r = self.alloc.fork(self.s, [seq])
        self.alloc.check(self.s)
        if bool(r.forked[0]):
            copied = int(r.copied_to[0])
            self._pops_follow_the_lru(lru_before, stack, [copied] if copied >= 0 else [])
            STATS["forks"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING, codes.SEQ_SUSPENDED))
    @rule(data=st.data())
    def free(self, data):
        self._free(self._pick(data, codes.SEQ_RUNNING, codes.SEQ_SUSPENDED))

    def _free(self, seq):
        room = int(self.alloc.allocatable_blocks(self.s)[0])
        self.s, rep = self.alloc.free(self.s, [seq])
        self.alloc.check(self.s)
        assert int(self.alloc.allocatable_blocks(self.s)[0]) == room + int(rep.blocks_returned[0])
        STATS["frees"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING)
                  and int(np.asarray(self.s.blocks.pin_count).sum()) < 2)
    @rule(data=st.data())
    def pin(self, data):
        seq = self._pick(data, codes.SEQ_RUNNING)
        self.s, _ = self.alloc.pin_prefix(self.s, seq, 1)
        self.alloc.check(self.s)
        STATS["pins"] += 1

    @precondition(lambda self: (np.asarray(self.s.blocks.pin_count) > 0).any())
    @rule(data=st.data())
    def unpin(self, data):
        pinned = [int(b) for b in np.flatnonzero(np.asarray(self.s.blocks.pin_count) > 0)]
        self.s, _ = self.alloc.unpin_blocks(self.s, [data.draw(st.sampled_from(pinned))])
        self.alloc.check(self.s)
        STATS["unpins"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data())
    def offload(self, data):
        seq = self._pick(data, codes.SEQ_RUNNING)
        before = seq_tokens(self.s, seq, P)
        try:
            self.s, _ = self.alloc.offload(self.s, [seq])
        except E.PoolFullError:
            return
        self.alloc.check(self.s)
        assert seq_tokens(self.s, seq, P) == before
        STATS["offloads"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_SUSPENDED))
    @rule(data=st.data())
    def restore(self, data):
        seq = self._pick(data, codes.SEQ_SUSPENDED)
        lru_before, stack = lru_of(self.s), int(self.s.free.free_count[0])
        old = _ints(self.s.seqs.block_tables[seq])
        try:
            self.s, _ = self.alloc.restore(self.s, [seq])
        except (E.PoolFullError, E.QuotaExceededError):
            STATS["restore refused"] += 1
            return
        self.alloc.check(self.s)
        new = [b for b, o in zip(_ints(self.s.seqs.block_tables[seq]), old) if b != o]
        self._pops_follow_the_lru(lru_before, stack, new)
        STATS["restores"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), keep=st.integers(0, 4))
    def compress(self, data, keep):
        seq = self._pick(data, codes.SEQ_RUNNING)
        room = int(self.alloc.allocatable_blocks(self.s)[0])
        try:
            self.s, rep = self.alloc.compress(self.s, [seq], kv_format="int8", keep_recent=keep)
        except E.PoolFullError:
            return
        self.alloc.check(self.s)
        assert rep.pool0_bytes_freed == (int(self.alloc.allocatable_blocks(self.s)[0]) - room
                                         ) * BLOCK
        STATS["blocks compressed"] += rep.blocks_compressed

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), policy=st.sampled_from(["h2o", "streamingllm"]),
          keep=st.integers(1, 6), mode=st.sampled_from(["token", "block"]))
    def evict(self, data, policy, keep, mode):
        seq = self._pick(data, codes.SEQ_RUNNING)
        lru_before, stack = lru_of(self.s), int(self.s.free.free_count[0])
        old = set(_ints(self.s.seqs.block_tables[seq]))
        try:
            self.s, rep = self.alloc.evict(self.s, [seq], policy=policy, keep_tokens=keep,
                                           mode=mode)
        except (E.TierError, E.PoolFullError):
            return
        self.alloc.check(self.s)
        table = _ints(self.s.seqs.block_tables[seq])
        self._pops_follow_the_lru(lru_before, stack, [b for b in table if b >= 0 and b not in old])
        STATS[f"evicted ({mode})"] += int(rep.evicted_tokens[0])

    @precondition(lambda self: int(self.s.free.cold_count) > 1)  # rarer: keep cold blocks
    @rule(max_blocks=st.sampled_from([None, 0, 1, 2]))
    def drop_cold(self, max_blocks):
        lru_before, free0 = lru_of(self.s), int(self.s.free.free_count[0])
        self.s, rep = self.alloc.drop_cold(self.s, max_blocks)
        self.alloc.check(self.s)
        n = len(lru_before) if max_blocks is None else min(max_blocks, len(lru_before))
        assert int(rep.dropped_blocks) == n and lru_of(self.s) == lru_before[n:]
        assert _ints(self.s.free.free_list[free0:free0 + n]) == lru_before[:n]
        STATS["dropped"] += n

    @invariant()
    def stack_and_cold_blocks_are_pool0s_free_capacity(self):
        held = (np.asarray(self.s.blocks.ref_count[:COLD.num_blocks]) > 0) | (
            np.asarray(self.s.blocks.pin_count[:COLD.num_blocks]) > 0)
        assert int(self.alloc.allocatable_blocks(self.s)[0]) == int((~held).sum())


_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FAST = settings(max_examples=12, stateful_step_count=25, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)
SLOW = settings(max_examples=300, stateful_step_count=50, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)
# Floors on what this machine is for (the reclaim means are floored in the tier machine).
FLOORS = {"admits": 30, "turns": 10, "revived": 10, "cold reused": 10, "dropped": 3, "frees": 10}


def _run(how, capsys):
    STATS.clear()
    run_state_machine_as_test(ColdMachine, settings=how)
    with capsys.disabled():
        print("\ncold machine exploration: " + ", ".join(f"{k}={v}" for k, v in
                                                         sorted(STATS.items())))
    return dict(STATS)


def test_cold_state_machine(capsys):
    stats = _run(FAST, capsys)
    low = {k: (stats.get(k, 0), f) for k, f in FLOORS.items() if stats.get(k, 0) < f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"


@pytest.mark.slow
def test_cold_state_machine_long(capsys):
    stats = _run(SLOW, capsys)
    low = {k: (stats.get(k, 0), 10 * f) for k, f in FLOORS.items() if stats.get(k, 0) < 10 * f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"


def test_revive_groups_equal_their_definition_with_and_without_cold_hits():
    """`cold.revive_inputs` (a per-column sort, skipped by a cond when no hit is cold) against
    its definition: a cold hit's group is the lowest row hitting the same block, any other
    entry groups alone. Block x sits at column x % M (a block has one chain depth)."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from kvquota.core.cold import revive_inputs

    fn = jax.jit(lambda cold_at, hits: revive_inputs(  # all it reads: state.blocks.cold_at
        SimpleNamespace(blocks=SimpleNamespace(cold_at=cold_at)), hits))
    rng = np.random.default_rng(1)
    for trial in range(24):
        b, m, nb = int(rng.choice([4, 8, 64])), int(rng.choice([1, 5, 64])), 50
        cold_at = np.where(rng.random(nb) < (0.5 if trial % 3 else 0.0), 3, INVALID)
        col = np.arange(nb) % m
        hits = np.full((b, m), INVALID, np.int64)
        for i, k in zip(*np.nonzero(rng.random((b, m)) < 0.6)):
            if (col == k).any():
                hits[i, k] = rng.choice(np.flatnonzero(col == k))
        cold, group = fn(jnp.asarray(cold_at, jnp.int32), jnp.asarray(hits, jnp.int32))
        want_cold = (hits >= 0) & (cold_at[np.maximum(hits, 0)] >= 0)
        want = np.array([[min((j for j in range(b) if want_cold[j, k] and hits[j, k] == hits[i, k]),
                              default=i) if want_cold[i, k] else i for k in range(m)]
                         for i in range(b)])
        np.testing.assert_array_equal(np.asarray(cold), want_cold)
        np.testing.assert_array_equal(np.asarray(group), want)
