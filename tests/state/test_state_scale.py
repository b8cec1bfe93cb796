"""The vectorised builder and the release at scale (metadata-only Qwen2.5-72B layout), checked
against check_invariants and against the benchmark's straightforward per-block Python pool."""

import jax
import numpy as np
import pytest

from configs.models import get_model_config
from experiments.bench_reclaim import PythonPool, same_result
from kvquota.allocator import Allocator
from kvquota.builder import SyntheticSpec, build_state
from kvquota.state import StateConfig
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, whole_array_copies

QWEN72 = get_model_config("qwen2.5-72b")


def _config(blocks, seqs, tenants=16, mb=64):
    return StateConfig(QWEN72, num_blocks=blocks, block_size=16, max_seqs=seqs,
                       max_blocks_per_seq=mb, num_tenants=tenants, with_pages=False,
                       compressed_pools=(("kivi2", 64),), host_blocks=64)


def test_builder_state_is_consistent_and_release_matches_python_pool():
    config = _config(1 << 14, 256)
    state = build_state(config, SyntheticSpec(num_seqs=256, num_groups=2, group_size=4,
                                              pin_prefixes=True, seed=3))
    alloc = Allocator(config)
    alloc.check(state)
    led = alloc.ledger(state)
    # Charges add up to the pool's watermark, in exact bytes (a 72B block is 5 MiB).
    held = config.num_blocks - int(state.free.free_count[0])
    assert int(led.charged_bytes.sum()) == held * config.pool_bytes[0]
    pool = PythonPool(config, jax.device_get(state))
    for tenant in (15, 0):  # a private tenant, then a group's prefix creator
        state, rep = alloc.release_tenant(state, tenant)
        alloc.check(state)
        pool.release(tenant)
        loop = dict(ref=pool.ref, payer=pool.payer, payer_refs=pool.payer_refs,
                    free=sorted(pool.free_list), charged=pool.charged, used=pool.used)
        assert same_result(state, loop)
    # The creator's prefix was pinned: its blocks stay charged to it (no unpin asked).
    assert int(state.tenants.pinned_blocks[0].sum()) == 4
    state, rep = alloc.release_tenant(state, 0, unpin=True)
    alloc.check(state)
    assert int(rep.unpinned_blocks) == 4 and int(state.tenants.charged_blocks[0].sum()) == 0


def test_donated_ops_match_plain_ops():
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 1), (100, 8 * BLOCK, 1)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [6, 7, 8])]))
    steps = [
        ("fork", lambda a, x, d: a.fork(x, [0], donate=d)),
        ("pin_prefix", lambda a, x, d: a.pin_prefix(x, 0, 2, donate=d)),
        ("unpin_blocks", lambda a, x, d: a.unpin_blocks(x, [0], donate=d)),
        ("set_quota", lambda a, x, d: a.set_quota(x, 1, token_quota=3, donate=d)),
        ("set_lease", lambda a, x, d: a.set_lease(x, 1, 7, donate=d)),
        ("free", lambda a, x, d: a.free(x, [1], donate=d)),
        ("release", lambda a, x, d: a.release_tenant(x, 0, unpin=True, donate=d)),
    ]
    for name, op in steps:
        want_s, want_r = op(alloc, s, False)
        got_s, got_r = op(alloc, jax.tree_util.tree_map(lambda v: v.copy(), s), True)
        alloc.check(got_s)
        assert leaves_equal(want_s, got_s), name
        assert leaves_equal(want_r, got_r), name
        s = want_s


def test_quota_cut_and_lease():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # 5 tokens, 3 blocks
    s, rep = alloc.set_quota(s, 0, token_quota=2, byte_quota=BLOCK + 1)
    alloc.check(s)
    # Cut below usage: 5 - 2 tokens over, 3 - 1 blocks over (the odd byte rounds down).
    assert int(rep.tokens_over) == 3 and rep.bytes_over == 2 * BLOCK
    s2, r = alloc.append(s, [0, -1], [9, 0])
    assert int(r.reason[0]) == 1  # REFUSED_TOKEN_QUOTA: nothing new while over quota
    s, _ = alloc.set_lease(s, 0, 10)
    assert alloc.expired_tenants(s, 9).tolist() == [] and alloc.expired_tenants(s, 10).tolist() == [0]
    for t in alloc.expired_tenants(s, 10):
        s, r = alloc.release_tenant(s, int(t))
    alloc.check(s)
    assert r.pool_bytes_returned == 3 * BLOCK


@pytest.mark.slow
def test_builder_at_2_20_blocks():
    config = _config(1 << 20, 8192, tenants=64, mb=256)
    state = build_state(config, SyntheticSpec(num_seqs=8192, num_groups=4, group_size=4))
    Allocator(config).check(state)
    assert int(state.free.free_count[0]) >= config.num_blocks // 10 - 1


def test_tiny_config_bytes():
    # The numbers the hand-checked tests rely on.
    assert TINY.pool_bytes == (1024, 288, 1024) and TINY.unit_bytes == 32
    assert np.asarray(TINY.pool_units).tolist() == [32, 9, 32]


def test_donated_cores_update_in_place():
    """No whole-array copy of a per-block array or of the block table in the compiled donated
    cores (what makes a serving step or a release cost O(rows touched), not O(pool)). Fork still
    copies the [S, MB] table once (it is not on the per-step path)."""

    from kvquota.core import admission, pins, release

    config = StateConfig(get_model_config("tiny-qwen"), num_blocks=4093, block_size=4,
                         max_seqs=37, max_blocks_per_seq=29, num_tenants=5, with_pages=False)
    state = build_state(config, SyntheticSpec(num_seqs=30, num_groups=1, group_size=2,
                                              pool_fill=0.4, pin_prefixes=True))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    heirs = (i32([2, 2, 3, 3]), i32([0, 1, 0, 1]))  # (rows, cols) of heir table entries
    calls = {
        "admit": (admission.admit_core.jitted(donate=True), (i32([0, 1]), i32(np.ones((2, 9))), i32([9, 5]))),
        "append": (admission.append_core.jitted(donate=True), (i32([0, 1]), i32([3, 4]))),
        "pin": (pins.pin_core.jitted(donate=True), (i32([0, 1]),)),
        "unpin": (pins.unpin_core.jitted(donate=True), (i32([0, 1]), heirs)),
        "free": (release.drop_core.jitted(donate=True), (i32([0, 1]), heirs, None, 0)),
        "free_16_columns": (release.drop_core.jitted(donate=True), (i32([0, 1]), heirs, None, 0, 16)),
        "release_unpin": (release.drop_core.jitted(donate=True), (i32([0, 1]), None, np.int32(0), 4)),
    }
    for name, (fn, args) in calls.items():
        copies = whole_array_copies(fn.lower(config, state, *args).compile().as_text(),
                                    (config.total_blocks, "37,29"))
        assert not copies, (name, copies[:3])


def test_donated_reclaim_cores_update_in_place():
    """The same for the cores a reclaim plan applies (offload, restore, compress, preempt): a
    read of `generation` (relinking moved blocks) or `fill` (archiving tokens) ordered before
    settle's writes, so no per-block array is copied. (The eviction cores still copy a few:
    their rewrite is issue 46's.)"""

    from kvquota.core import compress, lifecycle, tiers

    config = StateConfig(get_model_config("tiny-qwen"), num_blocks=4093, block_size=4,
                         max_seqs=37, max_blocks_per_seq=29, num_tenants=5, with_pages=False,
                         host_blocks=1021, compressed_pools=(("int8", 1021),))
    state = build_state(config, SyntheticSpec(num_seqs=30, num_groups=1, group_size=2,
                                              pool_fill=0.4, pin_prefixes=True))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    scores = np.tile(np.arange(29, dtype=np.float32), (2, 1))
    calls = {
        "offload": (tiers.offload_core, (i32([0, 1]),)),
        "restore": (tiers.restore_core, (i32([0, 1]),)),
        "compress": (compress.compress_core, (i32([0, 1]), scores, i32([5, 5]), np.int32(0), 1)),
        "preempt": (lifecycle.preempt_core, (i32([0, 1]), None)),
    }
    for name, (core, args) in calls.items():
        text = core.jitted(donate=True).lower(config, state, *args).compile().as_text()
        copies = whole_array_copies(text, (config.total_blocks, config.num_blocks, "37,29"))
        assert not copies, (name, copies[:3])


def test_cold_compaction_loop_hoists_nothing_pool_sized():
    """The cold ring's compaction (a loop of zero or one trip) must build its [N_0]-sized stamps
    and masks inside the trip: hoisted out of the loop as invariants, they were computed on
    every free, append and admit (2-4 ms a call at 2^20 blocks). Likewise the pops' trip into
    the cold blocks, which carries only the arrays it writes."""
    import re

    from kvquota.core import admission, release

    config = StateConfig(get_model_config("tiny-qwen"), num_blocks=4093, block_size=4,
                         max_seqs=37, max_blocks_per_seq=29, num_tenants=5, with_pages=False,
                         keep_cold_blocks=True)
    state = build_state(config, SyntheticSpec(num_seqs=30, num_groups=1, group_size=2,
                                              pool_fill=0.4))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    calls = {
        "admit": (admission.admit_core.jitted(donate=True), (i32([0, 1]), i32(np.ones((2, 9))), i32([9, 5]))),
        "append": (admission.append_core.jitted(donate=True), (i32([0, 1]), i32([3, 4]))),
        "free": (release.drop_core.jitted(donate=True), (i32([0, 1]), None, None, 0)),
    }
    # The pool-0-sized arrays a pop's trip into the cold blocks (`cold._take_cold`, a loop of
    # zero or one trip around the compaction's) writes: `oldest`'s ring and stamps, the chain
    # data `leave_cache` clears, the index's slot_of.
    writes = [getattr(state.blocks, f) for f in ("fill", "hashed", "block_salt", "parent",
                                                 "parent_gen", "generation", "cold_at")]
    writes += [state.free.cold_ring, state.index.slot_of]
    take_cold = sum(x.shape == (config.num_blocks,) for x in writes)
    pool0 = re.compile(r"\b\w+\[%d\]" % config.num_blocks)
    for name, (fn, args) in calls.items():
        text = fn.lower(config, state, *args).compile().as_text()
        loops = [len(pool0.findall(line.split(" while(")[0]))
                 for line in text.splitlines() if " while(" in line]
        assert 2 in loops, (name, loops)  # the compaction loop is there
        # carried: the ring and the stamps (cold_at), or what the cold take writes; no more
        assert max(loops) <= take_cold and all(n <= 2 or n == take_cold for n in loops), (
            name, loops, take_cold)
        assert (take_cold in loops) == (name != "free"), (name, loops)  # pops: admit, append
