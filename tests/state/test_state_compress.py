"""Compression into a quantized pool: exactly the chosen blocks change, bytes are exact, shared
and pinned blocks are never rewritten, and compressed blocks leave the prefix cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.quantization import quantize_pages
from kvquota import errors as E
from kvquota.sentinel import INVALID
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, snapshot
from tests.state.test_state_tiers import _ints, _with_pages

INT8 = 1  # TINY's compressed pool index


def test_compress_oldest_outside_the_recent_window():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (1, [8, 9])]))
    s = _with_pages(alloc, s)
    table = _ints(s.seqs.block_tables[0])  # 3 full blocks of 2 tokens + a partial one
    old_k = np.asarray(s.pages[0].k)[:, :, table[:2]]  # [L, Hkv, 2, P, D]
    before_other = snapshot(s)
    s, rep = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=2)
    alloc.check(s)
    # Blocks 0 and 1 lie wholly before the last 2 tokens (positions 5, 6); block 2 does not.
    assert _ints(rep.compressed_blocks) == [2, 0] and rep.lossy
    new = _ints(s.seqs.block_tables[0])
    assert new[2:] == table[2:] and all(TINY.pool_starts[INT8] <= b < TINY.pool_starts[2]
                                        for b in new[:2])
    assert rep.pool0_bytes_freed == 2 * BLOCK
    assert rep.compressed_bytes_charged == 2 * TINY.pool_bytes[INT8]
    assert rep.net_device_bytes_returned == 2 * (BLOCK - TINY.pool_bytes[INT8])
    assert _ints(s.tenants.charged_blocks[0]) == [2, 2, 0]
    # The stored codes are exactly what the kernels' quantizer makes of the old pages.
    local = np.asarray(new[:2]) - TINY.pool_starts[INT8]
    want = jax.vmap(lambda x: quantize_pages(x, "int8", "key"))(jnp.asarray(old_k))
    got = jax.tree_util.tree_map(lambda a: np.asarray(a)[:, :, local], s.pages[INT8].k)
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)))
    # Sequence 1 is untouched.
    assert _ints(s.seqs.block_tables[1]) == _ints(before_other.seqs.block_tables[1])
    # Compressed blocks are no lookup targets: the same prompt hits nothing now.
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))
    alloc.check(s)
    assert int(r.hit_blocks[0]) == 0
    # Decoding goes on (the tail stays in pool 0).
    s, r = alloc.append(s, [0, INVALID], [9, 0])
    assert bool(r.appended[0])
    alloc.check(s)


def test_max_blocks_and_window_larger_than_the_sequence():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))
    s1, rep = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=0, max_blocks=1)
    alloc.check(s1)
    assert _ints(rep.compressed_blocks) == [1, 0]
    assert _ints(s1.seqs.block_tables[0])[1:3] == _ints(s.seqs.block_tables[0])[1:3]
    s2, rep = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=100)
    assert rep.blocks_compressed == 0 and leaves_equal(s, s2)


def test_shared_and_pinned_blocks_are_never_compressed():
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 1), (100, 8 * BLOCK, 1)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))
    s, r = alloc.admit(s, *prompts([(1, [1, 2, 9])]))  # t1 shares block 0
    assert int(r.hit_blocks[0]) == 1
    s, _ = alloc.pin_blocks(s, [int(s.seqs.block_tables[0, 1])])
    s, rep = alloc.compress(s, [0, 1], kv_format="int8", keep_recent=0)
    alloc.check(s)
    # Seq 0: block 0 shared, block 1 pinned, block 2 compressed; seq 1 has no full own block.
    assert _ints(rep.compressed_blocks) == [1, 0]


BAD = [
    ("absent pool", E.TierError, lambda a, s: a.compress(s, [0], kv_format="int4")),
    ("full precision is no compressed pool", E.TierError,
     lambda a, s: a.compress(s, [0], kv_format="f32")),
    ("negative keep_recent", E.InvalidArgumentError,
     lambda a, s: a.compress(s, [0], kv_format="int8", keep_recent=-1)),
    ("unknown policy", E.InvalidArgumentError,
     lambda a, s: a.compress(s, [0], kv_format="int8", policy="h3o")),
    ("negative max_blocks", E.InvalidArgumentError,
     lambda a, s: a.compress(s, [0], kv_format="int8", max_blocks=-2)),
    ("a free slot", E.UnknownSequenceError, lambda a, s: a.compress(s, [3], kv_format="int8")),
    ("no room in the pool", E.PoolFullError,
     lambda a, s: a.compress(s, [0, 1], kv_format="int8", keep_recent=0)),
]


@pytest.mark.parametrize("name,error,call", BAD, ids=[b[0] for b in BAD])
def test_bad_compress_raises_and_leaves_state_unchanged(name, error, call):
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6]), (1, [6, 7, 8, 9, 1, 2])]))
    before = snapshot(s)
    with pytest.raises(error):
        call(alloc, s)
    assert leaves_equal(before, s)


def test_compress_into_a_plain_fp8_pool_is_a_cast():
    import dataclasses

    config = dataclasses.replace(TINY, compressed_pools=(("fp8", 4),))
    alloc, s = fresh(config)
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    s = _with_pages(alloc, s)
    old = np.asarray(s.pages[0].k)[:, :, _ints(s.seqs.block_tables[0])[0]]
    s, rep = alloc.compress(s, [0, INVALID], kv_format="fp8", keep_recent=1)
    alloc.check(s)
    assert rep.blocks_compressed == 2 and rep.net_device_bytes_returned == 2 * (BLOCK - BLOCK // 4)
    local = _ints(s.seqs.block_tables[0])[0] - config.pool_starts[1]
    got = np.asarray(s.pages[1].k[:, :, local])
    assert got.dtype == jnp.float8_e4m3fn
    assert np.array_equal(got.astype(np.float32), old.astype(jnp.float8_e4m3fn).astype(np.float32))
