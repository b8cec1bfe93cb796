"""Forced hash collisions: the token, salt and parent checks must turn them into misses, never
into a wrong block."""

import dataclasses

import jax
import numpy as np
import pytest

from kvquota.allocator import Allocator
from kvquota.errors import InvariantError
from kvquota.hashing import block_hash, salt_root
from tests.state.common import TINY, fresh, prompts, seq_tokens

P = TINY.block_size
# hash_bits=0 masks both 32-bit words to zero: every full block has the same hash, so every
# lookup is a forced collision and only the checks decide.
COLLIDE = dataclasses.replace(TINY, hash_bits=0, lookup_candidates=8)


def _ints(x):
    return np.asarray(x).tolist()


def test_all_hashes_equal_never_return_wrong_block():
    alloc = Allocator(COLLIDE)
    s = alloc.init()
    s, _ = alloc.register_tenant(s, 0, token_quota=100, byte_quota=8 * 1024)
    s, _ = alloc.register_tenant(s, 1, token_quota=100, byte_quota=8 * 1024)
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # blocks 0=(1,2) 1=(3,4) 2=(5)
    alloc.check(s)
    assert _ints(s.blocks.block_hash[:2]) == [[0, 0], [0, 0]]
    # (5, 6) collides with blocks 0 and 1 by hash, but their tokens differ: miss.
    s, r = alloc.admit(s, *prompts([(0, [5, 6, 3, 4, 9])]))  # new 3=(5,6) 4=(3,4) 5=(9)
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 0 and _ints(s.seqs.block_tables[1])[:3] == [3, 4, 5]
    # [5 6 | 3 4 | 7]: block 0 hits 3. For (3, 4) both 1 and 4 match hash and tokens, but 1
    # follows (1, 2): its K/V belong to another context. The parent check picks 4.
    s, r = alloc.admit(s, *prompts([(0, [5, 6, 3, 4, 7])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 4 and _ints(s.seqs.block_tables[2])[:2] == [3, 4]
    # [1 2 | 5 6 | 8]: (1, 2) hits 0; (5, 6) = block 3 has no parent -> miss after one block.
    s, _ = alloc.free(s, [2])
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 5, 6, 8])]))
    alloc.check(s)
    assert _ints(r.cached_tokens)[0] == 2 and int(s.seqs.block_tables[2, 0]) == 0
    assert int(s.seqs.block_tables[2, 1]) not in (3, 4)
    # Another tenant (private salt) never hits, whatever the hash says (room made first).
    s, _ = alloc.free(s, [1])
    s, r = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 5])]))
    alloc.check(s)
    assert _ints(r.admitted)[0] and _ints(r.seq_id)[0] == 1 and _ints(r.cached_tokens)[0] == 0
    # Every table spells out exactly its own prompt.
    want = {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5], 2: [1, 2, 5, 6, 8]}
    assert {seq: seq_tokens(s, seq, P) for seq in range(3)} == want


def test_forced_collision_on_stored_hash_is_caught_by_token_check():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # block 0 = (1, 2)
    # Give block 0 the full 2 x 32-bit hash that the prompt block (7, 8) of tenant 0 will have.
    root = salt_root(np.asarray(s.tenants.salt)[[0]], xp=np)
    forged = block_hash(root, np.array([[7, 8]], np.int32), xp=np)[0]
    s = s.update(block_hash=s.blocks.block_hash.at[0].set(forged))
    with pytest.raises(InvariantError):  # the corruption itself is visible to the checker
        alloc.check(s)
    s, r = alloc.admit(s, *prompts([(0, [7, 8, 9])]))
    assert _ints(r.cached_tokens)[0] == 0 and _ints(r.hit_blocks)[0] == 0
    seq = int(r.seq_id[0])
    assert int(s.seqs.block_tables[seq, 0]) != 0 and seq_tokens(s, seq, P) == [7, 8, 9]


def test_same_batch_prompts_do_not_hit_each_other():
    # New blocks' K/V are written by the caller after admit, so a prompt may only hit blocks
    # that existed before the call: two equal prompts in one batch get separate blocks.
    alloc, s = fresh()
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3]), (0, [1, 2, 3])]))
    alloc.check(s)
    assert _ints(r.cached_tokens) == [0, 0]
    assert _ints(s.seqs.block_tables[0])[:2] == [0, 1] and _ints(s.seqs.block_tables[1])[:2] == [2, 3]
    jax.block_until_ready(s)
