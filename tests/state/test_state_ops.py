"""Hand-checked cases on the tiny pool (8 blocks of 2 tokens, 2 tenants, 1024 B per block).

Block ids are popped lowest first from a fresh pool, and a freed block is pushed on top of the
stack, so every id below is worked out by hand in the comments. check_invariants runs after
every transformation.
"""

import dataclasses

import jax
import numpy as np
import pytest

from kvquota import codes as st
from kvquota.allocator import Allocator
from kvquota.invariants import recompute
from kvquota.sentinel import INVALID
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, seq_tokens, snapshot

P = TINY.block_size


def _ints(x):
    return np.asarray(x).tolist()


def test_admit_prefix_hits_free_and_reuse():
    alloc, s = fresh()
    # t0: [10 11 | 12 13 | 14 _] -> blocks 0, 1, 2 (lowest ids first); 2 full blocks hashed.
    s, r = alloc.admit(s, *prompts([(0, [10, 11, 12, 13, 14])]))
    alloc.check(s)
    assert _ints(r.admitted) == [True, False]
    assert _ints(r.reason) == [st.OK, st.SKIPPED_PADDING]
    assert _ints(r.seq_id) == [0, INVALID]
    assert _ints(r.cached_tokens) == [0, 0] and _ints(r.new_blocks) == [3, 0]
    assert _ints(s.seqs.block_tables[0]) == [0, 1, 2, INVALID]
    assert _ints(s.blocks.fill[:3]) == [2, 2, 1] and _ints(s.blocks.hashed[:3]) == [True, True, False]
    led = alloc.ledger(s)
    assert int(led.used_tokens[0]) == 5 and int(led.charged_bytes[0]) == 3 * BLOCK
    assert _ints(led.free_blocks) == [5, 4, 4]
    assert int(led.fragmentation[0]) == 3 * 2 - 5  # 6 slots, 5 tokens

    # t0: [10 11 | 12 13 | 20 21]: at most (6 - 1) // 2 = 2 full blocks may hit -> blocks 0, 1
    # (cached 4 tokens), one new block: 3.
    s, r = alloc.admit(s, *prompts([(0, [10, 11, 12, 13, 20, 21])]))
    alloc.check(s)
    assert _ints(r.seq_id)[0] == 1 and _ints(r.cached_tokens)[0] == 4
    assert _ints(r.hit_blocks)[0] == 2 and _ints(r.new_blocks)[0] == 1
    assert _ints(s.seqs.block_tables[1]) == [0, 1, 3, INVALID]
    assert _ints(s.blocks.ref_count[:4]) == [2, 2, 1, 1] and _ints(s.blocks.payer_refs[:4]) == [2, 2, 1, 1]
    led = alloc.ledger(s)
    assert int(led.used_tokens[0]) == 11  # 5 + 6: shared tokens count for every sequence
    assert int(led.charged_bytes[0]) == 4 * BLOCK  # resident blocks: each charged once
    assert int(led.reclaimable_bytes[0]) == 4 * BLOCK

    # t1 sends the same prompt: its private salt gives other hashes -> no hit; blocks 4, 5, 6.
    s, r = alloc.admit(s, *prompts([(1, [10, 11, 12, 13, 14])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 0 and _ints(s.seqs.block_tables[2]) == [4, 5, 6, INVALID]
    assert int(alloc.ledger(s).shared_bytes[1]) == 0

    # Free t0's first sequence: refs 0: 2->1, 1: 2->1, 2: 1->0 -> only block 2 returns.
    s, r = alloc.free(s, [0])
    alloc.check(s)
    assert r.pool_bytes_returned == BLOCK and r.quota_bytes_released == BLOCK
    assert _ints(r.blocks_returned) == [1, 0, 0] and _ints(r.tokens_released) == [5, 0]
    assert _ints(s.blocks.ref_count[:3]) == [1, 1, 0] and int(s.free.free_count[0]) == 2
    # Tombstone before any reuse: no hash entry, no fill, no payer (so no lookup can hit it).
    assert not bool(s.blocks.hashed[2]) and _ints(s.blocks.block_hash[2]) == [0, 0]
    assert int(s.blocks.fill[2]) == 0 and int(s.blocks.payer[2]) == INVALID

    # Same prompt again: hits 0, 1; the partial block is the top of the stack [7, 2] -> 2.
    s, r = alloc.admit(s, *prompts([(0, [10, 11, 12, 13, 14])]))
    alloc.check(s)
    assert _ints(r.seq_id)[0] == 0 and _ints(r.cached_tokens)[0] == 4
    assert _ints(s.seqs.block_tables[0]) == [0, 1, 2, INVALID]
    assert seq_tokens(s, 0, P) == [10, 11, 12, 13, 14]


def test_refusals_allocate_nothing():
    # t0: 6 tokens of quota; t1: 2 blocks (2048 B) of byte quota.
    alloc, s = fresh(tenants=((6, 8 * BLOCK, None), (100, 2 * BLOCK, None)))
    # Row 0 uses 4 tokens; row 1 would bring t0 to 8 > 6 tokens.
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4]), (0, [5, 6, 7, 8])]))
    alloc.check(s)
    assert _ints(r.admitted) == [True, False]
    assert _ints(r.reason) == [st.OK, st.REFUSED_TOKEN_QUOTA]
    assert _ints(r.new_blocks) == [2, 0] and int(s.free.free_count[0]) == 6

    # t1: 5 tokens need 3 blocks > 2 allowed; 4 tokens need 2 -> fits.
    before = snapshot(s)
    s2, r = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 5])]))
    assert _ints(r.reason)[0] == st.REFUSED_BYTE_QUOTA
    assert leaves_equal(before, s2)  # a refused admission changes nothing at all
    s, r = alloc.admit(s, *prompts([(1, [1, 2, 3, 4])]))
    alloc.check(s)
    assert _ints(r.reason)[0] == st.OK and int(s.free.free_count[0]) == 4

    # Pool full: t0 unbounded now; 4 free blocks. Row 0 takes all 4, row 1 finds none.
    s, _ = alloc.set_quota(s, 0, token_quota=100, byte_quota=100 * BLOCK)
    s, r = alloc.admit(s, *prompts([(0, [9] * 8), (0, [8] * 2)]))
    alloc.check(s)
    assert _ints(r.reason) == [st.OK, st.REFUSED_POOL_FULL] and int(s.free.free_count[0]) == 0

    # No sequence slot: slots 0, 1, 2 are used. Free slot 2 (4 blocks back), fill slots 2 and 3
    # with 1-token prompts; a fifth sequence finds no slot although the pool has room.
    s, _ = alloc.free(s, [2])
    s, r = alloc.admit(s, *prompts([(0, [1]), (0, [2])]))
    alloc.check(s)
    assert _ints(r.seq_id) == [2, 3]
    s, r = alloc.admit(s, *prompts([(0, [3])]))
    alloc.check(s)
    assert _ints(r.reason)[0] == st.REFUSED_NO_SEQ_SLOT


def test_append_crosses_block_and_completed_block_is_shared():
    alloc, s = fresh()
    s, r = alloc.admit(s, *prompts([(0, [1, 2])]))  # block 0 = (1, 2), full and hashed
    alloc.check(s)
    # Token 3 crosses the boundary: new block 1 at offset 0. Row 1 is padding.
    s, r = alloc.append(s, [0, INVALID], [3, 0])
    alloc.check(s)
    assert _ints(r.appended) == [True, False] and _ints(r.reason)[1] == st.SKIPPED_PADDING
    assert _ints(r.block)[0] == 1 and _ints(r.offset)[0] == 0 and _ints(r.new_block)[0]
    assert not bool(s.blocks.hashed[1])
    # Token 4 fills block 1 (offset 1): it joins the prefix cache.
    s, r = alloc.append(s, [0, INVALID], [4, 0])
    alloc.check(s)
    assert _ints(r.block)[0] == 1 and _ints(r.offset)[0] == 1 and not _ints(r.new_block)[0]
    assert bool(s.blocks.hashed[1]) and int(s.seqs.seq_lens[0]) == 4 and int(s.seqs.positions[0]) == 4
    # A follow-up turn [1 2 3 4 5] hits both blocks (multi-turn reuse of decoded tokens).
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 4 and _ints(s.seqs.block_tables[1])[:2] == [0, 1]


def test_append_refused_over_token_quota():
    alloc, s = fresh(tenants=((3, 8 * BLOCK, None), (100, 8 * BLOCK, None)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))
    before = snapshot(s)
    s2, r = alloc.append(s, [0, INVALID], [4, 0])  # 4 tokens > quota 3
    assert _ints(r.reason)[0] == st.REFUSED_TOKEN_QUOTA and int(r.block[0]) == INVALID
    assert leaves_equal(before, s2)


def test_fork_copies_partial_last_block_with_pages():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))  # blocks 0 = (1, 2), 1 = (3, _)
    # The model would have written K/V of block 1; stand in with constants.
    pool0 = s.pages[0]
    s = s.replace(pages=(pool0.replace(k=pool0.k.at[:, :, 1].set(7.0), v=pool0.v.at[:, :, 1].set(8.0)),) + s.pages[1:])
    s, r = alloc.fork(s, [0])
    alloc.check(s)
    # Child (slot 1) shares block 0 and gets its own copy of block 1: block 2.
    assert _ints(r.seq_id) == [1] and _ints(r.copied_from) == [1] and _ints(r.copied_to) == [2]
    assert _ints(s.seqs.block_tables[1]) == [0, 2, INVALID, INVALID]
    assert _ints(s.blocks.ref_count[:3]) == [2, 1, 1]
    assert _ints(s.blocks.token_ids[2]) == [3, INVALID]
    assert np.all(np.asarray(s.pages[0].k[:, :, 2]) == 7.0) and np.all(np.asarray(s.pages[0].v[:, :, 2]) == 8.0)
    led = alloc.ledger(s)
    assert int(led.used_tokens[0]) == 6 and int(led.charged_bytes[0]) == 3 * BLOCK
    # Appending to the child writes its copy; the parent's block is untouched.
    s, r = alloc.append(s, [1, INVALID], [9, 0])
    alloc.check(s)
    assert _ints(r.block)[0] == 2 and _ints(s.blocks.token_ids[1]) == [3, INVALID]
    assert _ints(s.blocks.token_ids[2]) == [3, 9]
    # Forking a sequence whose last block is full copies nothing.
    s, r = alloc.fork(s, [1])
    alloc.check(s)
    assert _ints(r.copied_from) == [INVALID] and _ints(s.blocks.ref_count[:3]) == [3, 1, 2]


def test_pins_keep_blocks_resident_and_charged():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # blocks 0, 1, 2
    s, r = alloc.pin_prefix(s, 0, 2)  # pin blocks 0, 1
    alloc.check(s)
    assert _ints(r.pin_count) == [1, 1] and int(alloc.ledger(s).pinned_bytes[0]) == 2 * BLOCK
    assert int(alloc.ledger(s).reclaimable_bytes[0]) == BLOCK  # pinned blocks are not reclaimable
    s, r = alloc.free(s, [0])
    alloc.check(s)
    # Only block 2 returns; 0 and 1 stay resident with no references, still charged to t0.
    assert r.pool_bytes_returned == BLOCK and int(s.free.free_count[0]) == 6
    assert _ints(s.blocks.ref_count[:2]) == [0, 0] and int(alloc.ledger(s).charged_bytes[0]) == 2 * BLOCK
    # A lookup may hit a pinned, unreferenced block.
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 9])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 4 and _ints(s.seqs.block_tables[0])[:2] == [0, 1]
    s, _ = alloc.free(s, [0])
    s, r = alloc.unpin_blocks(s, [0, 1])
    alloc.check(s)
    assert r.pool_bytes_returned == 2 * BLOCK and int(s.free.free_count[0]) == 8
    assert int(alloc.ledger(s).charged_bytes[0]) == 0


def test_release_tenant_walks_tables_and_keeps_pins_unless_asked():
    alloc, s = fresh()
    # t0: two sequences sharing block 0 = (1, 2); t1: one sequence. (Prompts of one admit
    # batch do not hit each other's new blocks, whose K/V are not written yet: two calls.)
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))  # blocks 0, 1
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 4])]))  # hits 0; new 2
    s, _ = alloc.admit(s, *prompts([(1, [5, 6, 7])]))  # blocks 3, 4
    s, _ = alloc.pin_prefix(s, 0, 1)  # pin block 0
    alloc.check(s)
    before = alloc.ledger(s)
    s1, r = alloc.release_tenant(s, 0)
    alloc.check(s1)
    # Entries walked: 0, 1, 0, 2 -> block 0 refs 2 -> 0 but pinned; 1 and 2 return.
    assert _ints(r.seqs_freed) == 2 and _ints(r.tokens_released) == [6, 0]
    assert r.pool_bytes_returned == 2 * BLOCK and r.quota_bytes_released == 2 * BLOCK
    assert int(s1.blocks.pin_count[0]) == 1 and int(alloc.ledger(s1).charged_bytes[0]) == BLOCK
    assert _ints(alloc.ledger(s1).charged_blocks[1]) == _ints(before.charged_blocks[1])
    s2, r = alloc.release_tenant(s, 0, unpin=True)
    alloc.check(s2)
    assert r.pool_bytes_returned == 3 * BLOCK and int(r.unpinned_blocks) == 1
    assert int(alloc.ledger(s2).charged_bytes[0]) == 0 and int(s2.free.free_count[0]) == 6


def test_charge_passes_to_lowest_tenant_and_heir_over_quota_is_reported():
    cfg = dataclasses.replace(TINY, num_tenants=3)
    alloc = Allocator(cfg)
    s = alloc.init()
    # All three share group 7; t0 may hold only 1 block.
    for t, bq in ((0, BLOCK), (1, 8 * BLOCK), (2, 8 * BLOCK)):
        s, _ = alloc.register_tenant(s, t, token_quota=100, byte_quota=bq, share_group=7)
    s, _ = alloc.admit(s, *prompts([(2, [1, 2, 3, 4, 5])]))  # t2 creates 0, 1, 2
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 6])]))  # t1 hits 0, 1; new 3
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 7])]))  # t0 hits 0 ((3-1)//2 = 1); new 4
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 2 and int(alloc.ledger(s).charged_bytes[0]) == BLOCK
    assert int(alloc.ledger(s).shared_bytes[0]) == BLOCK  # block 0, paid by t2
    s, r = alloc.free(s, [0])  # t2's sequence
    alloc.check(s)
    # Block 0 (held by t1, t0) -> heir t0, the lowest id; block 1 (held by t1) -> t1;
    # block 2 (only t2) returns to the pool.
    assert _ints(s.blocks.payer[:3]) == [0, 1, INVALID] and _ints(s.blocks.payer_refs[:2]) == [1, 1]
    assert int(r.transferred_blocks) == 2
    assert r.pool_bytes_returned == BLOCK  # only block 2 went back
    assert r.quota_bytes_released == 3 * BLOCK  # t2 stopped paying for 3 blocks
    assert _ints(r.inherited_bytes) == [BLOCK, BLOCK, 0]
    assert _ints(r.heir_over_quota) == [True, False, False]  # t0 now pays 2 blocks > 1


def test_scrub_on_free_zeroes_returned_pages():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))  # blocks 0, 1
    pool0 = s.pages[0]
    s = s.replace(pages=(pool0.replace(k=pool0.k.at[:, :, :2].set(1.0), v=pool0.v.at[:, :, :2].set(2.0)),) + s.pages[1:])
    s, _ = alloc.free(s, [0])
    alloc.check(s)  # includes "free pages are zero" under scrub_on_free
    assert not np.asarray(s.pages[0].k).any() and not np.asarray(s.pages[0].v).any()


def test_donated_variants_match_and_consume_state():
    alloc, s = fresh()
    args = prompts([(0, [1, 2, 3]), (1, [4, 5])])
    want_s, want_r = alloc.admit(s, *args)
    copy = jax.tree_util.tree_map(lambda x: x.copy(), s)
    got_s, got_r = alloc.admit(copy, *args, donate=True)
    alloc.check(got_s)
    assert leaves_equal(want_s, got_s) and leaves_equal(want_r, got_r)
    w, wr = alloc.append(want_s, [0, 1], [7, 8])
    g, gr = alloc.append(got_s, [0, 1], [7, 8], donate=True)
    assert leaves_equal(w, g) and leaves_equal(wr, gr)
    w, wr = alloc.release_tenant(w, 0)
    g, gr = alloc.release_tenant(g, 0, donate=True)
    assert leaves_equal(w, g) and leaves_equal(wr, gr)


def test_ledger_view_matches_numpy_recomputation():
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 3), (100, 8 * BLOCK, 3)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [6, 6])]))
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 9])]))  # t1 shares t0's 2 blocks
    s, _ = alloc.pin_prefix(s, 0, 1)
    led = alloc.ledger(s)
    want = recompute(TINY, jax.device_get(s))
    assert _ints(led.shared_blocks) == want["shared"].tolist()
    assert _ints(led.reclaimable_blocks) == want["reclaimable"].tolist()
    assert _ints(led.fragmentation) == want["fragmentation"].tolist()
    # By hand: t1 references blocks 0, 1 paid by t0; t0's reclaimable: block 2 only
    # (0 is pinned, 1 is also referenced by t1).
    assert _ints(led.shared_blocks[1])[0] == 2 and _ints(led.reclaimable_blocks[0])[0] == 1


@pytest.mark.parametrize("rows", [[(0, [1, 2, 3, 4, 5, 6, 7, 8]), (1, [1])]])
def test_whole_table_prompt(rows):
    alloc, s = fresh()
    s, r = alloc.admit(s, *prompts(rows))
    alloc.check(s)
    assert _ints(r.admitted) == [True, True] and seq_tokens(s, 0, P) == rows[0][1]
