"""Offload to the host pool and restore: lossless, exact in bytes, isolated from other sequences."""

import dataclasses

import jax
import numpy as np
import pytest

from kvquota import errors as E
from kvquota.codes import SEQ_RUNNING, SEQ_SUSPENDED
from kvquota.sentinel import INVALID
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, seq_tokens, snapshot


def _with_pages(alloc, s, seed=0):
    """Fill the pages of pool 0's held blocks with distinct random values (stands in for the
    model's K/V); free pages stay zero, as scrub_on_free requires."""
    rng = np.random.default_rng(seed)
    pool0 = s.pages[0]
    held = (np.asarray(s.blocks.ref_count[: TINY.num_blocks]) > 0)[None, None, :, None, None]
    k = np.where(held, rng.standard_normal(pool0.k.shape), 0).astype(np.float32)
    v = np.where(held, rng.standard_normal(pool0.v.shape), 0).astype(np.float32)
    return s.replace(pages=(pool0.replace(k=jax.numpy.asarray(k), v=jax.numpy.asarray(v)),)
                     + s.pages[1:])


def _seq_pages(s, seq):
    """K and V of a sequence's tokens, read through its table from whichever full-precision pool
    holds them (None for a token in a compressed pool)."""
    table = np.asarray(s.seqs.block_tables[seq])
    n = int(s.seqs.seq_lens[seq])
    out = []
    for i in range(n):
        blk, off = table[i // TINY.block_size], i % TINY.block_size
        pool = int(np.searchsorted(TINY.pool_starts, blk, side="right") - 1)
        local = blk - TINY.pool_starts[pool]
        if TINY.pool_formats[pool].quantized:  # compressed: not comparable bit for bit
            out.append(None)
            continue
        out.append((np.asarray(s.pages[pool].k[:, :, local, off]),
                    np.asarray(s.pages[pool].v[:, :, local, off])))
    return out


@pytest.fixture
def two_seqs():
    """seq 0: t0, 5 tokens (3 own blocks); seq 1: t1, 3 tokens (2 own blocks); pages random."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [7, 8, 9])]))
    s = _with_pages(alloc, s)
    alloc.check(s)
    return alloc, s


def test_offload_then_restore_is_bit_exact_and_isolated(two_seqs):
    alloc, s = two_seqs
    before0, before1 = _seq_pages(s, 0), _seq_pages(s, 1)
    toks = seq_tokens(s, 0, TINY.block_size)
    free0 = int(s.free.free_count[0])
    s, rep = alloc.offload(s, [0, INVALID])
    alloc.check(s)
    assert int(s.seqs.seq_status[0]) == SEQ_SUSPENDED and int(s.seqs.seq_status[1]) == SEQ_RUNNING
    assert rep.blocks_moved == 3 and _ints(rep.moved_blocks) == [3, 0]
    assert rep.bytes_moved == 3 * BLOCK and rep.pool_bytes_returned == 3 * BLOCK
    assert rep.transfer_seconds == 3 * BLOCK / TINY.host_bandwidth
    assert int(s.free.free_count[0]) == free0 + 3
    assert int(s.free.free_count[TINY.host_pool]) == TINY.host_blocks - 3
    assert _ints(s.tenants.charged_blocks[0]) == [0, 0, 3]
    assert seq_tokens(s, 0, TINY.block_size) == toks
    assert _same(_seq_pages(s, 0), before0) and _same(_seq_pages(s, 1), before1)
    # The device byte quota no longer counts the offloaded blocks; the ledger's host column does.
    led = alloc.ledger(s)
    assert int(led.charged_blocks[0, 0]) == 0 and int(led.host_bytes[0]) == 3 * BLOCK
    assert int(led.device_bytes[0]) == 0 and led.summary(0)[0]["host_bytes"] == 3 * BLOCK
    assert not led.host_alarm  # 3 of 4 host blocks: 75 % < the 80 % watermark
    s, rep = alloc.restore(s, [0, INVALID])
    alloc.check(s)
    assert int(s.seqs.seq_status[0]) == SEQ_RUNNING and rep.blocks_moved == 3
    assert int(s.free.free_count[TINY.host_pool]) == TINY.host_blocks
    assert _ints(s.tenants.charged_blocks[0]) == [3, 0, 0]
    assert _same(_seq_pages(s, 0), before0) and _same(_seq_pages(s, 1), before1)
    # Decoding goes on: the restored sequence appends, and its full blocks are lookup targets
    # again (a new prompt with the same first 4 tokens hits them).
    s, r = alloc.append(s, [0, INVALID], [6, 0])
    assert bool(r.appended[0])
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    alloc.check(s)
    assert int(r.hit_blocks[0]) == 2


def test_shared_and_pinned_blocks_stay_on_the_device():
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 1), (100, 8 * BLOCK, 1)))  # one share group
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # blocks 0, 1 (full), 2
    s, r = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 9])]))  # t1 hits blocks 0 and 1
    assert int(r.hit_blocks[0]) == 2
    s, _ = alloc.pin_blocks(s, [2])
    s, rep = alloc.offload(s, [0, INVALID])
    alloc.check(s)
    assert rep.blocks_moved == 0 and int(s.seqs.seq_status[0]) == SEQ_SUSPENDED
    assert _ints(s.seqs.block_tables[0][:3]) == [0, 1, 2]
    s, _ = alloc.restore(s, [0, INVALID])
    alloc.check(s)


def test_freeing_and_releasing_a_suspended_sequence():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3]), (1, [4, 5, 6])]))
    s, _ = alloc.offload(s, [0, 1])
    s2, rep = alloc.free(s, [0])
    alloc.check(s2)
    assert rep.blocks_returned.tolist()[TINY.host_pool] == 2
    s3, rep = alloc.release_tenant(s, 1)
    alloc.check(s3)
    assert int(s3.tenants.charged_blocks[1].sum()) == 0
    # Every report carries the host pool's use and its watermark alarm (4 host blocks, 80 %).
    assert int(rep.host_blocks_used) == 2 and not rep.host_alarm


def test_watermark_alarm():
    config = dataclasses.replace(TINY, host_watermark=0.5)
    alloc, s = fresh(config)
    s, _ = alloc.admit(s, *prompts([(0, [1]), (1, [2, 3, 4])]))
    s, rep = alloc.offload(s, [0, INVALID])
    assert rep.host_blocks_used.tolist() == 1 and not rep.host_alarm
    s, rep = alloc.offload(s, [1, INVALID])
    assert rep.host_blocks_used.tolist() == 3 and rep.host_alarm  # 3 of 4 >= 50 %
    assert alloc.ledger(s).host_alarm


def test_donated_offload_matches_plain(two_seqs):
    alloc, s = two_seqs
    want, wrep = alloc.offload(s, [0, INVALID])
    got, grep = alloc.offload(jax.tree_util.tree_map(lambda x: x.copy(), s), [0, INVALID],
                              donate=True)
    assert leaves_equal(want, got) and leaves_equal(wrep, grep)


BAD = [
    ("offload a free slot", E.UnknownSequenceError, lambda a, s: a.offload(s, [3])),
    ("offload twice in one call", E.DuplicateIdError, lambda a, s: a.offload(s, [0, 0])),
    ("restore a running sequence", E.UnknownSequenceError, lambda a, s: a.restore(s, [0])),
    ("append to a suspended sequence", E.UnknownSequenceError,
     lambda a, s: a.append(s, [2, INVALID], [1, 0])),
    ("fork a suspended sequence", E.UnknownSequenceError, lambda a, s: a.fork(s, [2])),
    ("offload without host room", E.PoolFullError, lambda a, s: a.offload(s, [0, 1])),
]


@pytest.mark.parametrize("name,error,call", BAD, ids=[b[0] for b in BAD])
def test_bad_moves_raise_and_leave_state_unchanged(name, error, call):
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [6, 7, 8, 9, 1])]))
    s, _ = alloc.admit(s, *prompts([(0, [2])]))
    s, _ = alloc.offload(s, [2, INVALID])  # seq 2 suspended, 1 host block used of 4
    before = snapshot(s)
    with pytest.raises(error):
        call(alloc, s)
    assert leaves_equal(before, s)


def test_restore_without_device_room_or_over_quota():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # 3 blocks
    s, _ = alloc.offload(s, [0, INVALID])
    cut, _ = alloc.set_quota(s, 0, byte_quota=2 * BLOCK)
    with pytest.raises(E.QuotaExceededError):
        alloc.restore(cut, [0, INVALID])
    s, _ = alloc.admit(s, *prompts([(1, [1] * 8), (1, [2] * 8)]))  # pool 0: 8 - 8 = 0 free
    assert int(s.free.free_count[0]) == 0
    before = snapshot(s)
    with pytest.raises(E.PoolFullError):
        alloc.restore(s, [0, INVALID])
    assert leaves_equal(before, s)


def test_no_host_pool_is_a_typed_error():
    alloc, s = fresh(dataclasses.replace(TINY, host_blocks=0))
    s, _ = alloc.admit(s, *prompts([(0, [1])]))
    with pytest.raises(E.TierError):
        alloc.offload(s, [0])


def _ints(x):
    return [int(v) for v in np.asarray(x)]


def _same(a, b):
    return all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
