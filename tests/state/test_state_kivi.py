"""KIVI compression at the paper's key group (Liu et al., 2024: G = 32 tokens, R = 128): a group
spans G / P whole blocks, is quantized with one per-channel key scale and zero point and taken
whole or not at all; the ledger charges exactly the blocks' stored bytes; bad settings are typed
errors that leave the state unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.quantization import quantize_pages
from kvquota import errors as E
from kvquota.sentinel import INVALID
from kvquota.state import StateConfig
from tests.state.common import TINY_MODEL, fresh, leaves_equal, prompts, snapshot

P = 8  # G = 32 is 4 blocks, G = 16 (kivi4-g16) 2 blocks
KIVI = StateConfig(TINY_MODEL, num_blocks=16, block_size=P, max_seqs=2, max_blocks_per_seq=6,
                   num_tenants=1, kv_format="f32",
                   compressed_pools=(("kivi2", 8), ("kivi4-g16", 8)))
POOL = {"kivi2": 1, "kivi4-g16": 2}
WIDTH = KIVI.max_tokens_per_seq  # 48


def _state(n_tokens=45, seed=0):
    big = 10 * KIVI.pool_bytes[0] * KIVI.num_blocks
    alloc, s = fresh(KIVI, tenants=((1000, big, None),))
    s, _ = alloc.admit(s, *prompts([(0, list(range(1, n_tokens + 1)))], width=WIDTH))
    alloc.check(s)
    rng = np.random.default_rng(seed)  # stands in for the model's K/V
    pool0 = s.pages[0]
    k, v = (jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (pool0.k, pool0.v))
    return alloc, s.replace(pages=(pool0.replace(k=k, v=v),) + s.pages[1:])


def _table(s):
    return [int(b) for b in np.asarray(s.seqs.block_tables[0])]


def test_a_group_of_four_blocks_shares_one_key_scale_and_the_ledger_is_exact():
    alloc, s = _state()
    table = _table(s)
    old_k = np.asarray(s.pages[0].k)[:, :, table[:4]]  # [L, Hkv, 4, P, D]: tokens 0..31
    before = jax.device_get(alloc.ledger(s))
    s, rep = alloc.compress(s, [0, INVALID], kv_format="kivi2", keep_recent=8)
    alloc.check(s)
    # 45 tokens, 8 kept: blocks 0..3 hold tokens 0..31 < 37, one whole group; block 4 (tokens
    # 32..39) reaches into the window and its group is never complete.
    assert [int(x) for x in rep.compressed_blocks] == [4, 0]
    new = _table(s)
    start = KIVI.pool_starts[POOL["kivi2"]]
    assert new[4:6] == table[4:6] and all(start <= b < start + 8 for b in new[:4])
    after = jax.device_get(alloc.ledger(s))
    assert (after.charged_blocks[0] - before.charged_blocks[0]).tolist() == [-4, 4, 0]
    assert rep.pool0_bytes_freed == 4 * KIVI.pool_bytes[0]
    assert rep.compressed_bytes_charged == 4 * KIVI.pool_bytes[POOL["kivi2"]]
    # Exactly the kernels' quantizer over the group (the NumPy rule is checked in
    # tests/kernels/test_quantization.py), every block holding the group's scale.
    local = np.asarray(new[:4]) - start
    want = jax.vmap(lambda x: quantize_pages(x, "kivi2", "key", group_pages=4))(
        jnp.asarray(old_k))
    got = jax.tree_util.tree_map(lambda a: np.asarray(a)[:, :, local], s.pages[POOL["kivi2"]].k)
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    scales = np.asarray(got.scales)  # [L, Hkv, 4, 1, D]
    assert (scales == scales[:, :, :1]).all()


@pytest.mark.parametrize("fmt,blocks", [("kivi2", 0), ("kivi4-g16", 2)])
def test_only_whole_groups_outside_the_window_are_taken(fmt, blocks):
    # 45 tokens, 16 kept: blocks 0..2 (tokens 0..23 < 29) are cold. G = 32 needs blocks 0..3:
    # nothing; G = 16 takes the group {0, 1}, block 2's partner (3) being in the window.
    alloc, s = _state()
    s2, rep = alloc.compress(s, [0, INVALID], kv_format=fmt, keep_recent=16)
    alloc.check(s2)
    assert rep.blocks_compressed == blocks
    if blocks == 0:
        assert leaves_equal(s, s2)


def test_max_blocks_never_splits_a_group():
    alloc, s = _state()
    s2, rep = alloc.compress(s, [0, INVALID], kv_format="kivi2", keep_recent=0, max_blocks=3)
    alloc.check(s2)
    assert rep.blocks_compressed == 0 and leaves_equal(s, s2)
    # 45 tokens, nothing kept: the groups {0..3} and {4, 5} - block 5 is partial: one group.
    s3, rep = alloc.compress(s, [0, INVALID], kv_format="kivi2", keep_recent=0, max_blocks=8)
    alloc.check(s3)
    assert rep.blocks_compressed == 4


def test_the_full_precision_window_defaults_to_the_formats_residual():
    alloc, s = _state()
    # kivi2's R = 128 > 45 tokens: nothing leaves full precision; kivi4-g16's R = 32 leaves
    # tokens 0..12 cold: block 0 alone, not its group {0, 1}.
    s2, rep = alloc.compress(s, [0, INVALID], kv_format="kivi2")
    assert rep.blocks_compressed == 0 and leaves_equal(s, s2)
    s3, rep = alloc.compress(s, [0, INVALID], kv_format="kivi4-g16")
    assert rep.blocks_compressed == 0 and leaves_equal(s, s3)
    s4, rep = alloc.compress(s, [0, INVALID], kv_format="kivi4-g16", keep_recent=29)
    alloc.check(s4)
    assert rep.blocks_compressed == 2


@pytest.mark.parametrize("block_size", [64, 12])
def test_a_key_group_that_is_no_whole_number_of_blocks_is_a_config_error(block_size):
    with pytest.raises(E.ConfigError, match="kivi2.*not a whole number of blocks"):
        dataclasses.replace(KIVI, block_size=block_size)


def test_bad_compress_leaves_the_state_unchanged():
    alloc, s = _state()
    before = snapshot(s)
    with pytest.raises(E.InvalidArgumentError):
        alloc.compress(s, [0, INVALID], kv_format="kivi2", keep_recent=-1)
    with pytest.raises(E.TierError):
        alloc.compress(s, [0, INVALID], kv_format="kivi2-g16")  # no such pool here
    assert leaves_equal(before, s)


@pytest.mark.parametrize("keep_recent,compressed", [(8, 4), (16, 0)])
def test_the_reclaim_planner_takes_whole_groups_as_compress_does(keep_recent, compressed):
    from kvquota.reclaim import PRESETS, ReclaimRequest
    from tests.state.test_reclaim import _figures

    pol = dataclasses.replace(PRESETS["tiered"], compress_format="kivi2",
                              compress_keep_recent=keep_recent)
    alloc, s = _state()
    # Tenant 0 holds 6 f32 blocks of 4,096 B; cut to 4: compressing the group of blocks 0..3
    # (4 x 640 B) fits; with 16 tokens kept no group is cold and the row is preempted instead.
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 4 * KIVI.pool_bytes[0]), pol)
    steps = {st.means: st for st in plan.steps}
    assert ("compress" in steps) == bool(compressed)
    s2, rep = alloc.apply_plan(s, plan)
    alloc.check(s2)
    assert _figures(rep.steps) == _figures(plan.steps)
    held = np.asarray(jax.device_get(alloc.ledger(s2)).charged_blocks[0])
    assert held[POOL["kivi2"]] == compressed
