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
    assert ledger(alloc, s) == dict(charged=[[0, 0, 3], [2, 0, 0]], used=[5, 3],
                                    free=[6, 4, 1], cold=0)
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
    assert ledger(alloc, s) == dict(charged=[[3, 0, 0], [2, 0, 0]], used=[5, 3],
                                    free=[3, 4, 4], cold=0)
    assert _ints(alloc.ledger(s).host_bytes) == [0, 0] and _ints(rep.quota_units_released) == [
        TINY.pool_units[TINY.host_pool] * 3, 0]  # the host charges dropped
    assert _same(_seq_pages(s, 0), before0) and _same(_seq_pages(s, 1), before1)
    # Decoding goes on: the restored sequence appends, and its full blocks are lookup targets
    # again (a new prompt with the same first 4 tokens hits them).
    s, r = alloc.append(s, [0, INVALID], [6, 0])
    assert bool(r.appended[0])
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    alloc.check(s)
    assert int(r.hit_blocks[0]) == 2


# An int8 block of TINY: K and V x 2 layers x 2 KV heads x 2 tokens x (16 int8 values + one bf16
# scale per token and head) = 8 x 2 x 18 B.
I8 = 288
assert TINY.pool_bytes[1] == I8


def test_the_ledger_follows_the_blocks_through_compress_offload_and_restore():
    """Exact ledger figures after each move of t0's sequence [1, 2, 3, 4, 5] (two full blocks
    and a partial one) beside t1's [7, 8, 9]: compress moves the full blocks' charge from pool 0
    to the int8 pool, offload the partial block's (the compressed ones stay on the device) to
    the host pool, restore brings it back to pool 0; logical tokens never change and t1's row
    never moves."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [7, 8, 9])]))
    alloc.check(s)
    assert ledger(alloc, s) == dict(charged=[[3, 0, 0], [2, 0, 0]], used=[5, 3],
                                    free=[3, 4, 4], cold=0)
    assert _ints(alloc.ledger(s).charged_bytes) == [3 * BLOCK, 2 * BLOCK]

    s, rep = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=0)
    alloc.check(s)
    assert ledger(alloc, s) == dict(charged=[[1, 2, 0], [2, 0, 0]], used=[5, 3],
                                    free=[5, 2, 4], cold=0)
    led = alloc.ledger(s)
    assert _ints(led.charged_bytes) == [BLOCK + 2 * I8, 2 * BLOCK]
    assert _ints(led.device_bytes) == [BLOCK + 2 * I8, 2 * BLOCK]
    assert _ints(led.host_bytes) == [0, 0]
    assert _ints(rep.compressed_blocks) == [2, 0] and _ints(rep.blocks_returned) == [2, 0, 0]
    assert _ints(rep.quota_units_released) == [2 * TINY.pool_units[0], 0]
    assert rep.pool0_bytes_freed == 2 * BLOCK and rep.compressed_bytes_charged == 2 * I8
    assert rep.net_device_bytes_returned == 2 * (BLOCK - I8)

    s, rep = alloc.offload(s, [0, INVALID])
    alloc.check(s)
    assert ledger(alloc, s) == dict(charged=[[0, 2, 1], [2, 0, 0]], used=[5, 3],
                                    free=[6, 2, 3], cold=0)
    led = alloc.ledger(s)
    assert _ints(led.host_bytes) == [BLOCK, 0] and _ints(led.device_bytes) == [2 * I8, 2 * BLOCK]
    assert _ints(rep.moved_blocks) == [1, 0] and _ints(rep.blocks_returned) == [1, 0, 0]
    assert rep.bytes_moved == BLOCK and rep.pool_bytes_returned == BLOCK

    s, rep = alloc.restore(s, [0, INVALID])
    alloc.check(s)
    assert ledger(alloc, s) == dict(charged=[[1, 2, 0], [2, 0, 0]], used=[5, 3],
                                    free=[5, 2, 4], cold=0)
    led = alloc.ledger(s)
    assert _ints(led.host_bytes) == [0, 0]
    assert _ints(led.device_bytes) == [BLOCK + 2 * I8, 2 * BLOCK]
    assert _ints(rep.moved_blocks) == [1, 0] and _ints(rep.blocks_returned) == [0, 0, 1]


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
    # Nothing moved, so nothing in the ledger did: t0 still pays its three blocks on the
    # device (one pinned), t1 its own [9] and references t0's two shared ones.
    same = dict(charged=[[3, 0, 0], [1, 0, 0]], used=[5, 5], free=[4, 4, 4], cold=0)
    led = alloc.ledger(s)
    assert ledger(alloc, s) == same and rep.pool_bytes_returned == 0
    assert _ints(led.pinned_blocks[:, 0]) == [1, 0] and _ints(led.shared_blocks[:, 0]) == [0, 2]
    assert _ints(led.host_bytes) == [0, 0] and _ints(led.device_bytes) == [3 * BLOCK, BLOCK]
    s, rep = alloc.restore(s, [0, INVALID])
    alloc.check(s)
    assert ledger(alloc, s) == same and rep.blocks_moved == 0


def test_freeing_and_releasing_a_suspended_sequence():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3]), (1, [4, 5, 6])]))
    s, _ = alloc.offload(s, [0, 1])
    alloc.check(s)
    # Each tenant's two blocks are charged in the host pool now; none on the device.
    assert ledger(alloc, s) == dict(charged=[[0, 0, 2], [0, 0, 2]], used=[3, 3],
                                    free=[8, 4, 0], cold=0)
    s2, rep = alloc.free(s, [0])
    alloc.check(s2)
    assert rep.blocks_returned.tolist()[TINY.host_pool] == 2
    # t0's host charge and tokens are gone, its two host blocks free again; t1 unchanged.
    assert ledger(alloc, s2) == dict(charged=[[0, 0, 0], [0, 0, 2]], used=[0, 3],
                                     free=[8, 4, 2], cold=0)
    assert _ints(rep.tokens_released) == [3, 0] and rep.quota_bytes_released == 2 * BLOCK
    assert rep.pool_bytes_returned == 2 * BLOCK
    s3, rep = alloc.release_tenant(s, 1)
    alloc.check(s3)
    assert int(s3.tenants.charged_blocks[1].sum()) == 0
    assert ledger(alloc, s3) == dict(charged=[[0, 0, 2], [0, 0, 0]], used=[3, 0],
                                     free=[8, 4, 2], cold=0)
    assert _ints(rep.tokens_released) == [0, 3] and rep.quota_bytes_released == 2 * BLOCK
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


def ledger(alloc, s):
    """The ledger's counts as plain ints, for exact comparison with figures worked out by hand:
    charged blocks [T][POOLS] (pools: 0 = f32 device, 1 = int8, 2 = host), used tokens [T],
    allocatable blocks per pool [POOLS], cold blocks."""
    led = jax.device_get(alloc.ledger(s))
    return dict(charged=led.charged_blocks.tolist(), used=led.used_tokens.tolist(),
                free=led.free_blocks.tolist(), cold=int(led.cold_blocks))


def _same(a, b):
    return all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
