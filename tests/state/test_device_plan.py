"""The device plan (`kvquota.reclaim.device_plan`, `plan_reclaim(..., on_device=True)`) equals the
host model's plan (plan_reclaim's default, the oracle) exactly — steps with their bytes and rows, fates with
their resume costs, shortfall, pinned and shared bytes held, version — for every preset and
request kind on the states the reclaim tests build; and each device plan applies as planned,
with check_invariants after every transformation. The Hypothesis reclaim machine
(test_state_machine_reclaim.py) compares every plan it makes the same way."""

import dataclasses

import numpy as np
import pytest

from kvquota.codes import FATE_GROWING
from kvquota.reclaim import PRESETS, ReclaimPolicy, ReclaimRequest, register
from kvquota.reclaim import planner as planner_mod
from kvquota.reclaim.device_plan import host_reason
from kvquota.reclaim.means import REGISTRY
from kvquota.sentinel import INVALID
from tests.state import test_quota_bugs as qb
from tests.state import test_reclaim as tr
from tests.state.common import BLOCK, fresh, prompts

CFG = tr.CFG
SMALL = tr.SMALL_KEEP  # every means, compression ungated, eviction allowed (stays on the host)
POLICIES = tr.POLICIES + [
    dataclasses.replace(SMALL, name="small-no-evict", allow_evict=False),
    dataclasses.replace(PRESETS["tiered"], name="tiered-largest", victim_order="largest",
                        compress_keep_recent=2),
    dataclasses.replace(PRESETS["tiered"], name="tiered-priority", victim_order="priority",
                        priorities=((0, 3), (1, -1), (2, 5), (3, 1)), compress_keep_recent=0),
    dataclasses.replace(PRESETS["tiered"], name="tiered-take-all", take_all=True,
                        compress_gated=False, compress_keep_recent=0),
    dataclasses.replace(PRESETS["swap-all"], name="swap-idle-only", means=("offload_idle",)),
]
NAMES = [p if isinstance(p, str) else p.name for p in POLICIES]


def _requests(tenants, blocks=(0, 1, 2, 5, 12)):
    """Quota cuts to several sizes, a lease expiry and room of several sizes, per tenant."""
    out = []
    for t in tenants:
        out += [ReclaimRequest.quota_cut(t, b * BLOCK) for b in blocks]
        out += [ReclaimRequest.lease_expiry(t)]
        out += [ReclaimRequest.make_room(t, b * BLOCK) for b in blocks + (40,)]
    return out


def _compare(alloc, s, policy, requests, *, apply=True, now=None):
    """Device plan == host plan for each request; the device plan applies as planned."""
    alloc.check(s)
    for req in requests:
        plan = alloc.plan_reclaim(s, req, policy, now=now, on_device=True)
        oracle = alloc.plan_reclaim(s, req, policy, now=now)
        assert plan == oracle, f"{req}\ndevice:\n{plan}\nhost:\n{oracle}"
        if apply:
            s2, rep = alloc.apply_plan(s, plan)
            alloc.check(s2)
            assert tr._figures(rep.steps) == tr._figures(plan.steps), str(plan)


# ---- the states of test_reclaim.py -----------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES, ids=NAMES)
def test_scenario(policy):
    alloc, s = tr.scenario()
    _compare(alloc, s, policy, _requests(range(3)))


@pytest.mark.parametrize("policy", POLICIES, ids=NAMES)
def test_pinned_scenario_and_a_pinned_block_no_table_holds(policy):
    alloc, s, _ = tr.pinned_scenario()
    _compare(alloc, s, policy, _requests(range(3), blocks=(0, 2, 12)))
    s, _ = alloc.free(s, [1])  # the private pinned block is now in no table
    _compare(alloc, s, policy, _requests((0, 2), blocks=(0, 2)), apply=False)


@pytest.mark.parametrize("policy", POLICIES, ids=NAMES)
def test_full_pool_and_a_small_host(policy):
    """Tenant 2 fills pool 0 (top-ups need room made); then a host of 2 blocks, too small for
    either of tenant 0's sequences, opens compression."""
    alloc, s = tr.scenario()
    s, adm = alloc.admit(s, *prompts([(2, list(range(10, 18))), (2, [20, 21])]))
    assert np.asarray(adm.admitted).all() and int(s.free.free_count[0]) == 0
    _compare(alloc, s, policy, _requests(range(3), blocks=(0, 1, 5)))
    small_host = dataclasses.replace(CFG, host_blocks=2)
    alloc2, s2 = fresh(small_host, tenants=((100, 16 * BLOCK, 1), (100, 16 * BLOCK, 1),
                                            (100, 16 * BLOCK, None)))
    s2, _ = alloc2.admit(s2, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (0, [9, 9, 9, 9, 9])]))
    s2, _ = alloc2.set_idle(s2, [1, INVALID])
    _compare(alloc2, s2, policy, _requests((0, 2), blocks=(0, 2)))


@pytest.mark.parametrize("policy", ["tiered", "swap-all", "tiered-take-all"])
def test_host_above_its_watermark_opens_compression(policy):
    """Tenant 1 offloads an idle session into most of the host pool: the alarm rings before
    tenant 0's plan starts, so gated compression runs as soon as it is reached."""
    pol = POLICIES[NAMES.index(policy)]
    alloc, s = fresh(CFG, tenants=((100, 16 * BLOCK, None), (100, 16 * BLOCK, None),
                                   (100, 16 * BLOCK, None)))
    s, _ = alloc.admit(s, *prompts([(1, list(range(1, 9))), (1, list(range(11, 19)))]))
    s, _ = alloc.offload(s, [0, 1])
    alloc.check(s)
    s, _ = alloc.admit(s, *prompts([(0, list(range(1, 9))), (0, [9, 9, 9, 9, 9])]))
    _compare(alloc, s, pol, _requests((0, 2), blocks=(0, 2)))


def test_blocks_already_compressed_and_offloaded():
    """Test_quota_bugs' state: tenant 0 holds 3 int8 blocks and 2 on the host before the plan."""
    alloc, s = qb._compressed_and_offloaded()
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 5]), (0, [1, 2, 3, 4])]))
    for policy in POLICIES:
        _compare(alloc, s, policy, _requests((0, 1), blocks=(0, 2)))


@pytest.mark.parametrize("policy", ["tiered", "preempt-all", "swap-all", "small-no-evict"])
def test_cold_cached_blocks(policy):
    """keep_cold_blocks: freed full blocks stay as cold cached blocks (free capacity, and hits
    for a preempted sequence's replay)."""
    pol = POLICIES[NAMES.index(policy)]
    cold = dataclasses.replace(CFG, keep_cold_blocks=True)
    alloc, s = fresh(cold, tenants=((100, 16 * BLOCK, 1), (100, 16 * BLOCK, 1),
                                    (100, 16 * BLOCK, None)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (0, [9, 9, 9, 9, 9])]))
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 8]), (2, [5, 5, 5, 5, 5, 6])]))
    s, _ = alloc.free(s, [3])  # tenant 2's blocks go cold
    s, _ = alloc.set_idle(s, [1, INVALID])
    s, _ = alloc.admit(s, *prompts([(2, [1, 2, 3, 4, 6, 6])]))
    _compare(alloc, s, pol, _requests(range(3), blocks=(0, 2, 12)))


def test_lease_expiry_hands_a_pinned_block_to_the_tenant_that_references_it():
    """test_state_machine_reclaim's heir case: tenant 0 pins its prompt's first block and frees
    the sequence; tenant 1 hits it. A lease expiry of tenant 0 unpins it and its charge passes
    to tenant 1."""
    alloc, s = fresh(qb.TINY, tenants=((64, 8 * BLOCK, 0), (64, 8 * BLOCK, 0)))
    system = [5, 4, 3, 2]
    s, r = alloc.admit(s, *prompts([(0, system)]))
    s, _ = alloc.pin_prefix(s, int(r.seq_id[0]), 1)
    s, _ = alloc.free(s, [int(r.seq_id[0])])
    s, r = alloc.admit(s, *prompts([(1, system), (0, system + [1, 1])]))
    for policy in PRESETS:
        _compare(alloc, s, policy, _requests((0, 1), blocks=(0, 1, 3)))


def test_drop_idle_with_a_clock():
    """`now` past tenant 0's lease makes it inactive: drop_idle takes its idle session."""
    alloc, s = tr.scenario()
    s, _ = alloc.set_lease(s, 0, 5)
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0), "tiered", now=7, on_device=True)
    assert plan.steps[0].means == "drop_idle"
    _compare(alloc, s, "tiered", _requests((0, 2), blocks=(0, 2)), now=7)
    _compare(alloc, s, "tiered", _requests((0,), blocks=(0, 2)), now=3, apply=False)


def test_grow_no_admit_fates():
    alloc, s = tr.scenario()
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0), "grow-no-admit",
                              on_device=True)
    assert {f.seq: f.fate for f in plan.fates}[0] == FATE_GROWING and not plan.steps


# ---- what runs where ---------------------------------------------------------------------------
def test_the_device_plans_every_preset_without_the_host_model(monkeypatch):
    """Every preset and request kind except a plan that may evict never builds the host model."""
    alloc, s = tr.scenario()

    def refuse(*args, **kwargs):
        raise AssertionError("the host planner ran")

    monkeypatch.setattr(planner_mod.Planner, "__init__", refuse)
    for name, policy in PRESETS.items():
        for req in _requests((0, 2), blocks=(0, 2)):
            if host_reason(policy, req) is None:
                alloc.plan_reclaim(s, req, policy, on_device=True)
            else:
                assert name == "evict-first" and req.kind != "lease_expiry"
                with pytest.raises(AssertionError, match="host planner ran"):
                    alloc.plan_reclaim(s, req, policy, on_device=True)


def test_host_reasons_are_named():
    cut, lease = ReclaimRequest.quota_cut(0, 0), ReclaimRequest.lease_expiry(0)
    assert host_reason(PRESETS["evict-first"], cut) == "the policy may evict"
    assert host_reason(PRESETS["evict-first"], lease) is None  # a release evicts nothing
    assert host_reason(dataclasses.replace(SMALL, allow_evict=False), cut) is None
    register(tr.DropEveryIdle())
    try:
        toy = ReclaimPolicy(name="toy", means=("drop_every_idle", "preempt"))
        assert "drop_every_idle" in host_reason(toy, cut)
        alloc, s = tr.scenario()
        _compare(alloc, s, toy, [cut])  # the host plans it; the oracle agrees with itself
    finally:
        del REGISTRY[tr.DropEveryIdle.name]
