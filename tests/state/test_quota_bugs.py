"""Regressions for the ledger and validation bugs an independent model and a new user found
(issue 49, items 1-4, 6 and 7), each on the hand-checked TINY pool (8 device blocks of 2 tokens,
1024 B = 32 units each; an int8 pool of 4 and a host pool of 4 blocks).

Every test checks the invariants after each transformation, and that a refused call leaves the
state unchanged.
"""

import dataclasses
import gc

import numpy as np
import pytest

import kvquota as kq
from configs.models import get_model_config
from kvquota.allocator import Allocator
from kvquota.codes import SEQ_RUNNING
from kvquota.reclaim.plan import ReclaimRequest
from kvquota.state import StateConfig
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, snapshot

UNIT = TINY.unit_bytes
INT8_UNITS = TINY.pool_units[1]  # units of one int8 block (codes and scales)
HUGE = 64 * BLOCK


def _compressed_and_offloaded():
    """Tenant 0 holds seq 0 (6 tokens: 3 full blocks, compressed into int8) and seq 1 (4 tokens:
    2 blocks, offloaded to the host pool)."""
    alloc, s = fresh(tenants=((100, HUGE, None), (100, HUGE, None)))
    s, rep = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6]), (0, [7, 8, 9, 10])]))
    assert np.asarray(rep.seq_id).tolist() == [0, 1]
    s, rep = alloc.compress(s, [0], kv_format="int8", keep_recent=0)
    alloc.check(s)
    assert int(np.asarray(rep.compressed_blocks).sum()) == 3
    s, _ = alloc.offload(s, [1])
    alloc.check(s)
    charged = np.asarray(s.tenants.charged_blocks)[0].tolist()
    assert charged == [0, 3, 2]  # pool 0, int8, host
    return alloc, s


# ---- 1. restore counts every device pool's charges -----------------------------------------
def test_restore_over_quota_counting_compressed_blocks_is_refused():
    """3 int8 blocks stay charged on the device; bringing seq 1's 2 blocks back to pool 0 would
    hold 2 x 32 + 3 x INT8_UNITS units. A quota of exactly 2 blocks (64 units) must refuse it:
    counting pool 0 only (0 + 64 <= 64) let it through."""
    alloc, s = _compressed_and_offloaded()
    s, _ = alloc.set_quota(s, 0, byte_quota=2 * BLOCK)
    alloc.check(s)
    before = snapshot(s)
    with pytest.raises(kq.QuotaExceededError, match="tenant 0 would hold"):
        alloc.restore(s, [1])
    assert leaves_equal(s, before)


def test_restore_exactly_at_quota_counting_compressed_blocks_is_accepted():
    alloc, s = _compressed_and_offloaded()
    at = (2 * 32 + 3 * INT8_UNITS) * UNIT
    s, _ = alloc.set_quota(s, 0, byte_quota=at - UNIT)  # one unit short: refused
    with pytest.raises(kq.QuotaExceededError):
        alloc.restore(s, [1])
    s, _ = alloc.set_quota(s, 0, byte_quota=at)
    s, _ = alloc.restore(s, [1])
    alloc.check(s)
    led = alloc.ledger(s)
    assert np.asarray(s.tenants.charged_blocks)[0].tolist() == [2, 3, 0]
    assert int(led.charged_bytes[0]) == at


# ---- 2. a lease change keeps grow-no-admit -------------------------------------------------
def test_set_lease_keeps_grow_no_admit_and_set_quota_ends_it():
    alloc, s = fresh(tenants=((100, HUGE, None), (100, HUGE, None)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4])]))
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0), "grow-no-admit")
    s, _ = alloc.apply_plan(s, plan)
    alloc.check(s)
    assert np.asarray(s.tenants.growing).tolist() == [True, False]
    s, _ = alloc.set_lease(s, 0, 50)
    alloc.check(s)
    assert np.asarray(s.tenants.growing).tolist() == [True, False]
    assert int(s.tenants.lease_expiry[0]) == 50 and int(s.tenants.byte_quota[0]) == 0
    # Behaviour, not just the flag: the survivor still grows past its cut quota (a new block).
    s, rep = alloc.append(s, np.array([0], np.int32), np.array([9], np.int32))
    alloc.check(s)
    assert np.asarray(rep.appended).tolist() == [True]
    assert np.asarray(s.tenants.charged_blocks)[0, 0] == 3
    # A new quota is a new contract: it ends grow-no-admit.
    s, _ = alloc.set_quota(s, 0, byte_quota=HUGE)
    alloc.check(s)
    assert np.asarray(s.tenants.growing).tolist() == [False, False]


# ---- 3. a state made for another model ------------------------------------------------------
@pytest.mark.parametrize("other", ["qwen2.5-72b", "smollm2-135m"])
def test_a_state_of_another_model_is_refused(other):
    """Metadata-only states of Qwen2.5-7B and of another model have the same shapes; the bytes
    per block differ (7B: 917,504 B a block of 16; 72B: 5,242,880 B), so accepting it would
    misreport every byte figure."""
    def config(name):
        return StateConfig(get_model_config(name), num_blocks=64, max_seqs=4,
                           max_blocks_per_seq=8, num_tenants=2, with_pages=False)

    mine = Allocator(config("qwen2.5-7b"))
    s = mine.init()
    s, _ = mine.register_tenant(s, 0, token_quota=10**6, byte_quota=2**40)
    mine.check(s)
    theirs = Allocator(config(other))
    before = snapshot(s)
    for call in (lambda: theirs.ledger(s), lambda: theirs.check(s),
                 lambda: theirs.append(s, np.array([-1], np.int32), np.array([0], np.int32)),
                 lambda: theirs.admit(s, *prompts([(0, [1, 2, 3])]))):
        with pytest.raises(kq.StateMismatchError, match="another config"):
            call()
    assert leaves_equal(s, before)


def test_a_state_serves_allocators_that_differ_only_in_behaviour():
    """Scrubbing and lookup settings do not change what the arrays mean: the state is accepted."""
    alloc, s = fresh()
    other = Allocator(dataclasses.replace(TINY, scrub_on_free=False, lookup_candidates=2))
    other.check(s)
    assert int(other.ledger(s).charged_bytes.sum()) == 0


# ---- 4. None once the last returned state is collected ---------------------------------------
@pytest.mark.parametrize("call", [
    lambda alloc: alloc.ledger(None),
    lambda alloc: alloc.admit(None, *prompts([(0, [1, 2])])),
    lambda alloc: alloc.free(None, [0]),
])
def test_none_is_refused_after_the_last_state_was_collected(call):
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))
    del s
    gc.collect()
    with pytest.raises(kq.StateMismatchError, match="expected a KVState"):
        call(alloc)


# ---- 6. every config error is typed ---------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("num_blocks", 0), ("num_blocks", -4), ("block_size", 0), ("block_size", 3.5),
    ("num_tenants", 0), ("max_seqs", True), ("host_blocks", -1), ("host_watermark", 0.0),
    ("kv_format", "int8"), ("compressed_pools", [("int8", 4)]),
])
def test_state_config_errors_are_typed(field, value):
    with pytest.raises(kq.ConfigError, match=field.split("_")[0]):
        dataclasses.replace(TINY, **{field: value})


# ---- 7. errors name the argument and the rule -------------------------------------------------
def test_admit_with_a_negative_tenant_names_the_row_and_the_rule():
    alloc, s = fresh()
    before = snapshot(s)
    ten, tok, lens = prompts([(0, [1, 2]), (0, [3, 4])])
    ten[1] = -3
    with pytest.raises(kq.UnknownTenantError, match=r"tenants\[1\] = -3"):
        alloc.admit(s, ten, tok, lens)
    assert leaves_equal(s, before)


@pytest.mark.parametrize("bad", [-5, TINY.model.vocab_size])
def test_out_of_vocabulary_token_ids_are_token_id_errors(bad):
    alloc, s = fresh()
    ten, tok, lens = prompts([(0, [1, 2, 3])])
    tok[0, 2] = bad
    with pytest.raises(kq.TokenIdError, match=rf"tokens\[0, 2\] = {bad}"):
        alloc.admit(s, ten, tok, lens)
    s, rep = alloc.admit(s, *prompts([(0, [1, 2, 3])]))
    alloc.check(s)
    assert int(s.seqs.seq_status[0]) == SEQ_RUNNING
    before = snapshot(s)
    with pytest.raises(kq.TokenIdError, match=rf"tokens\[0\] = {bad}"):
        alloc.append(s, np.array([0], np.int32), np.array([bad], np.int32))
    assert leaves_equal(s, before)


def test_values_beyond_int32_are_input_dtype_errors():
    alloc, s = fresh()
    with pytest.raises(kq.InputDtypeError, match="int32"):
        alloc.append(s, np.array([2**40], np.int64), np.array([1], np.int64))
