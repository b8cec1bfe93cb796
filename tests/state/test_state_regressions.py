"""Regression tests for bugs a review planted and the default suite once missed, each worked out by
hand on the tiny pool (8 blocks of 2 tokens, 1024 B = 32 units of 32 B per block; a fresh pool
pops the lowest ids first, a freed block is pushed on top of the stack):

* the heir boundary: an heir exactly at its byte quota after inheriting is NOT over it; one byte
  unit more is (`settle`: charged > quota, not >=);
* stale parents: a block whose parent was freed and reused must never be a prefix hit after that
  parent (`lookup` compares `parent_gen` with the parent's `generation`), shown with forced hash
  collisions (hash_bits=0: every full block hashes to 0, so only the checks decide);
* the generation of a block goes up on every free, whichever path frees it;
* a block-aligned prompt sent again keeps its last block to compute (the model needs the logits of
  the last prompt token), however much of it is cached.
"""

import dataclasses

import numpy as np
import pytest

from kvquota import codes
from kvquota.allocator import Allocator
from kvquota.sentinel import INVALID
from tests.state.common import BLOCK, TINY, fresh, prompts, seq_tokens

P = TINY.block_size
UNIT = TINY.unit_bytes  # 32 B; a block is 32 units
COLLIDE = dataclasses.replace(TINY, hash_bits=0, lookup_candidates=8)


def _ints(x):
    return np.asarray(x).tolist()


# ---- (a) the heir boundary ------------------------------------------------------------------
@pytest.mark.parametrize("quota_bytes, over", [
    (3 * BLOCK, False),  # exactly at the quota after inheriting: not over
    (3 * BLOCK + UNIT - 1, False),  # rounds down to the same 96 units: still exactly at it
    (3 * BLOCK - UNIT, True),  # one unit less quota: charged 96 units > 95: over
    (3 * BLOCK + UNIT, False),  # one unit of room left
])
def test_heir_exactly_at_quota_is_not_over(quota_bytes, over):
    # t0 and t1 share group 5. t0: [1 2 | 3 4 | 5] -> blocks 0, 1, 2 (payer t0). t1:
    # [1 2 | 3 4 | 6] hits 0, 1 and pays only its new block 3. Freeing t0's sequence passes the
    # charges of 0 and 1 to t1 (its only other referencer): t1 then pays 3 blocks = 96 units.
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 5), (100, quota_bytes, 5)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    s, r = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 6])]))
    assert _ints(r.hit_blocks)[0] == 2 and _ints(s.seqs.block_tables[1]) == [0, 1, 3, INVALID]
    s, r = alloc.free(s, [0])
    alloc.check(s)
    assert _ints(s.blocks.payer[:4]) == [1, 1, INVALID, 1]
    assert int(r.transferred_blocks) == 2 and _ints(r.inherited_bytes) == [0, 2 * BLOCK]
    assert _ints(r.heir_over_quota) == [False, over]
    assert int(alloc.ledger(s).charged_bytes[1]) == 3 * BLOCK
    # The same boundary as the tenant report sees it: units over = charged - quota, or 0.
    s, rep = alloc.set_quota(s, 1, byte_quota=quota_bytes)
    assert int(rep.units_over) == max(96 - quota_bytes // UNIT, 0)
    assert (int(rep.units_over) > 0) == over


def test_heir_boundary_on_the_unpin_path():
    """The unpin path settles through the same code: t0 pinned block 0, t1 references it; t0's
    sequence goes, then the pin: block 0's charge passes to t1, which lands exactly on its
    2-block quota (not over); with 2 blocks less one unit it is over."""
    for quota_bytes, over in ((2 * BLOCK, False), (2 * BLOCK - UNIT, True)):
        alloc, s = fresh(tenants=((100, 8 * BLOCK, 5), (100, quota_bytes, 5)))
        s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))  # blocks 0, 1
        s, _ = alloc.admit(s, *prompts([(1, [1, 2, 4])]))  # hits 0; new 2
        s, _ = alloc.pin_blocks(s, [0])
        s, r = alloc.free(s, [0])  # block 0 pinned: stays t0's
        assert int(r.transferred_blocks) == 0 and int(s.blocks.payer[0]) == 0
        s, r = alloc.unpin_blocks(s, [0])
        alloc.check(s)
        assert int(r.transferred_blocks) == 1 and int(s.blocks.payer[0]) == 1
        assert _ints(r.heir_over_quota) == [False, over]


# ---- (b), (c) stale parents and generations ------------------------------------------------
def _orphaned_child():
    """COLLIDE pool: t0's [1 2 | 3 4 | 5] = blocks 0, 1, 2; block 1 (3, 4) pinned alone, the
    sequence freed: 0 and 2 return (pushed in that order, so 2 is on top), 1 stays cached with
    parent 0 at generation 0. A 1-token prompt takes block 2; then [7 8 | 9] reuses block 0 for
    (7, 8) at position 0 (generation 1) and takes block 3 for (9)."""
    alloc = Allocator(COLLIDE)
    s = alloc.init()
    s, _ = alloc.register_tenant(s, 0, token_quota=100, byte_quota=8 * BLOCK)
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    s, _ = alloc.pin_blocks(s, [1])
    s, _ = alloc.free(s, [0])
    assert _ints(s.blocks.generation[:3]) == [1, 0, 1]
    assert int(s.blocks.parent[1]) == 0 and int(s.blocks.parent_gen[1]) == 0
    s, r = alloc.admit(s, *prompts([(0, [7])]))
    assert _ints(s.seqs.block_tables[0])[:1] == [2]
    s, r = alloc.admit(s, *prompts([(0, [7, 8, 9])]))
    assert _ints(r.cached_tokens)[0] == 0 and _ints(s.seqs.block_tables[1])[:2] == [0, 3]
    alloc.check(s)
    return alloc, s


def test_stale_parent_is_never_a_prefix_hit():
    # [7 8 | 3 4 | 5]: block 0 = (7, 8) hits; for (3, 4) the only candidate (every hash is 0)
    # is block 1, whose tokens match and whose parent id is 0 -- but block 0 has been freed and
    # reused since (generation 1 != parent_gen 0): its K/V were computed after (1, 2). Miss.
    alloc, s = _orphaned_child()
    s, r = alloc.admit(s, *prompts([(0, [7, 8, 3, 4, 5])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 2 and _ints(r.hit_blocks)[0] == 1
    table = _ints(s.seqs.block_tables[2])
    assert table[0] == 0 and 1 not in table
    assert seq_tokens(s, 2, P) == [7, 8, 3, 4, 5]


def test_fresh_child_is_chosen_over_a_stale_one_with_the_same_tokens():
    # After [7 8 | 3 4 | 5] (a fresh (3, 4) block 4 with parent 0 at generation 1), the next
    # [7 8 | 3 4 | 6] has two candidates for (3, 4): stale block 1 (the lower id) and fresh 4.
    alloc, s = _orphaned_child()
    s, _ = alloc.admit(s, *prompts([(0, [7, 8, 3, 4, 5])]))
    fresh_child = _ints(s.seqs.block_tables[2])[1]
    assert fresh_child not in (0, 1)
    s, r = alloc.admit(s, *prompts([(0, [7, 8, 3, 4, 6])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 4
    assert _ints(s.seqs.block_tables[3])[:2] == [0, fresh_child]


@pytest.mark.parametrize("path", ["free", "release", "release_unpin", "unpin"])
def test_generation_goes_up_on_every_free(path):
    """Every way a block returns to the pool bumps its generation by exactly one, and a block
    that stays held keeps its generation."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))  # blocks 0, 1
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 4])]))  # hits 0; new 2
    assert _ints(s.blocks.generation[:3]) == [0, 0, 0]
    if path == "free":
        s, _ = alloc.free(s, [0])  # block 1 returns; 0 still held by seq 1
        want = [0, 1, 0]
    elif path == "release":
        s, _ = alloc.release_tenant(s, 0)
        want = [1, 1, 1]
    elif path == "release_unpin":
        s, _ = alloc.pin_blocks(s, [0])
        s, _ = alloc.release_tenant(s, 0, unpin=True)
        want = [1, 1, 1]
    else:
        s, _ = alloc.pin_blocks(s, [1])
        s, _ = alloc.free(s, [0])  # block 1 pinned: stays
        assert _ints(s.blocks.generation[:3]) == [0, 0, 0]
        s, _ = alloc.unpin_blocks(s, [1])
        want = [0, 1, 0]
    alloc.check(s)
    assert _ints(s.blocks.generation[:3]) == want
    # Whatever is left goes: each of the three blocks has been freed exactly once.
    s, _ = alloc.release_tenant(s, 0)
    assert _ints(s.blocks.generation) == [1, 1, 1] + [0] * (TINY.total_blocks - 3)
    # Two of them reused and freed again: one more each.
    s, _ = alloc.admit(s, *prompts([(0, [5, 6, 7])]))
    reused = _ints(s.seqs.block_tables[0])[:2]
    s, _ = alloc.release_tenant(s, 0)
    alloc.check(s)
    assert [int(s.blocks.generation[b]) for b in reused] == [2, 2]
    assert int(np.asarray(s.blocks.generation).sum()) == 5


def test_freed_and_reused_parent_under_real_hashes():
    """With 32-bit hashes a re-sent prompt rebuilds the same chain hashes: once block 0 = (1, 2)
    was freed and re-allocated (generation 1), the still-pinned old (3, 4) block -- same hash,
    same tokens, parent id 0, but parent generation 0 -- is not a hit after it: the parent
    check is by generation, not by id."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # 0, 1, 2
    s, _ = alloc.pin_blocks(s, [1])
    s, _ = alloc.free(s, [0])  # 0 and 2 back; stack top 2
    s, _ = alloc.admit(s, *prompts([(0, [9])]))  # takes 2
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 8])]))  # (1, 2) is not cached: reuses block 0
    assert _ints(r.cached_tokens)[0] == 0 and int(s.seqs.block_tables[1, 0]) == 0
    assert int(s.blocks.generation[0]) == 1
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 2  # (1, 2) hits block 0; old (3, 4) is stale: miss
    assert 1 not in _ints(s.seqs.block_tables[2])


# ---- (d) a block-aligned prompt sent again --------------------------------------------------
@pytest.mark.parametrize("prompt", [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_block_aligned_repeat_keeps_last_block_to_compute(prompt):
    """Every block of the repeat is cached; still only (len - 1) // P may hit: the last block
    is allocated anew so the model computes the last prompt token (and has its logits)."""
    alloc, s = fresh()
    s, r = alloc.admit(s, *prompts([(0, prompt)]))
    assert _ints(r.cached_tokens)[0] == 0
    assert all(bool(h) for h in _ints(s.blocks.hashed[: len(prompt) // P]))
    s, r = alloc.admit(s, *prompts([(0, prompt)]))
    alloc.check(s)
    n = len(prompt) // P
    assert _ints(r.admitted)[0] and _ints(r.reason)[0] == codes.OK
    assert _ints(r.cached_tokens)[0] == len(prompt) - P and _ints(r.hit_blocks)[0] == n - 1
    assert _ints(r.new_blocks)[0] == 1
    first, again = _ints(s.seqs.block_tables[0])[:n], _ints(s.seqs.block_tables[1])[:n]
    assert again[: n - 1] == first[: n - 1] and again[n - 1] not in first
    assert seq_tokens(s, 1, P) == prompt


def test_block_aligned_repeat_within_the_byte_quota():
    """The computed last block is charged: a tenant with no byte quota left cannot re-send a
    block-aligned prompt even though every block of it is cached."""
    alloc, s = fresh(tenants=((100, 2 * BLOCK, None), (100, 8 * BLOCK, None)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4])]))  # 2 blocks: the whole quota
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4]), (0, [1, 2, 3])]))
    assert _ints(r.reason) == [codes.REFUSED_BYTE_QUOTA, codes.REFUSED_BYTE_QUOTA]
    s, _ = alloc.set_quota(s, 0, byte_quota=3 * BLOCK)
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4])]))
    alloc.check(s)
    assert _ints(r.admitted)[0] and _ints(r.cached_tokens)[0] == 2
