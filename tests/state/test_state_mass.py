"""Attention statistics in the state: mass lands on the slot of each cached token, follows a
block when it moves, and is reset when the block is freed or handed out again."""

import numpy as np
import pytest

from kvquota import errors as E
from kvquota.sentinel import INVALID
from tests.state.common import TINY, fresh, leaves_equal, prompts, snapshot
from tests.state.test_state_tiers import _ints


def _mass_of(s, seq):
    table, n = _ints(s.seqs.block_tables[seq]), int(s.seqs.seq_lens[seq])
    mass = np.asarray(s.blocks.attn_mass)
    return [float(mass[table[i // TINY.block_size], i % TINY.block_size]) for i in range(n)]


def test_mass_accumulates_per_token_and_resets_on_free():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [6, 7])]))
    step = np.zeros((2, 8), np.float32)
    step[0, :5] = [0.5, 0.125, 0.125, 0.125, 0.125]  # dyadic: sums are exact in f32
    step[1, :2] = [0.75, 0.25]
    step[0, 6] = 9.0  # past seq 0's length: ignored
    s, _ = alloc.record_attention(s, [0, 1], step)
    s, _ = alloc.record_attention(s, [0, INVALID], step)
    alloc.check(s)
    assert _mass_of(s, 0) == [1.0, 0.25, 0.25, 0.25, 0.25] and _mass_of(s, 1) == [0.75, 0.25]
    s, _ = alloc.free(s, [0])
    alloc.check(s)  # freed blocks carry no mass
    s, _ = alloc.admit(s, *prompts([(0, [9, 9, 9])]))  # reuses freed blocks
    assert _mass_of(s, 0) == [0.0, 0.0, 0.0]


def test_mass_follows_compressed_and_offloaded_blocks():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    s, _ = alloc.record_attention(s, [0, INVALID],
                                  np.array([[1, 2, 3, 4, 5, 0, 0, 0], [0] * 8], np.float32))
    s, _ = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=1)
    assert _mass_of(s, 0) == [1, 2, 3, 4, 5]
    s, _ = alloc.offload(s, [0, INVALID])
    s, _ = alloc.restore(s, [0, INVALID])
    alloc.check(s)
    assert _mass_of(s, 0) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("mass,error", [
    (np.full((2, 8), -1.0, np.float32), E.InputDtypeError),
    (np.full((2, 8), np.nan, np.float32), E.InputDtypeError),
    (np.ones((2, 8), np.int32), E.InputDtypeError),
    (np.ones((2, 9), np.float32), E.InputShapeError),
    (np.ones((1, 8), np.float32), E.InputShapeError),
])
def test_bad_mass_is_refused(mass, error):
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))
    before = snapshot(s)
    with pytest.raises(error):
        alloc.record_attention(s, [0, INVALID], mass)
    assert leaves_equal(before, s)


def test_coldest_first_compression_takes_the_lowest_mass_blocks():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))  # 3 full blocks + a tail
    mass = np.array([[3, 3, 0.5, 0.5, 2, 2, 0, 0], [0] * 8], np.float32)  # block 1 coldest
    s, _ = alloc.record_attention(s, [0, INVALID], mass)
    table = _ints(s.seqs.block_tables[0])
    s2, rep = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=0, max_blocks=2,
                             policy="coldest")
    alloc.check(s2)
    new = _ints(s2.seqs.block_tables[0])
    # Blocks 1 (mass 1) and 2 (mass 4) go; block 0 (mass 6) stays in pool 0.
    assert new[0] == table[0] and new[1] != table[1] and new[2] != table[2]
    s3, _ = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=0, max_blocks=2)
    assert _ints(s3.seqs.block_tables[0])[2] == table[2]  # "oldest" takes blocks 0 and 1
