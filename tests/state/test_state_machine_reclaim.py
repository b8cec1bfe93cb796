"""Stateful property test of reclaim in one action: the tier machine's programs (admit, append,
free, offload, restore, compress, evict) with the session lifecycle (idle, resume, preempt),
rebalance and plan_reclaim -> apply_plan (every preset, every request kind) mixed in, with cold
cached blocks off and on. After every step: check_invariants (the ledger recomputed from the
tables, exactly: drift 0 per tenant and pool). After every apply: each step's measured bytes
equal the plan's, and the returned pool-0 capacity is allocatable at once by a top-up."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from kvquota import codes
from kvquota.allocator import Allocator
from kvquota.codes import OK, REFUSED_BYTE_QUOTA, REFUSED_GROWING, REFUSED_TOKEN_QUOTA
from kvquota.invariants import recompute
from kvquota.reclaim import PRESETS, ReclaimRequest
from tests.state.common import BLOCK, TINY, prompts
from tests.state import test_state_machine_tiers as tiers

STATS = collections.Counter()
KINDS = ["quota_cut", "lease_expiry", "make_room"]


class ReclaimMachine(tiers.TierMachine):
    CONFIG = TINY

    def __init__(self):
        super().__init__()
        self.alloc = Allocator(self.CONFIG)
        s = self.alloc.init()
        for t in range(TINY.num_tenants):
            s, _ = self.alloc.register_tenant(s, t, token_quota=64, byte_quota=8 * BLOCK,
                                              share_group=0)
        self.s = s

    def _free0(self):  # cold cached blocks are free capacity too
        return int(self.alloc.allocatable_blocks(self.s)[0])

    def _live(self, *statuses):
        return [q for status in statuses for q in self._seqs(status)]

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data())
    def set_idle(self, data):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        self.s, _ = self.alloc.set_idle(self.s, [seq])
        STATS["idles"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_IDLE))
    @rule(data=st.data())
    def resume(self, data):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_IDLE)))
        self.s, _ = self.alloc.resume(self.s, [seq])

    @precondition(lambda self: self._live(codes.SEQ_RUNNING, codes.SEQ_IDLE))
    @rule(data=st.data(), donate=st.booleans())
    def preempt(self, data, donate):
        seq = data.draw(st.sampled_from(self._live(codes.SEQ_RUNNING, codes.SEQ_IDLE)))
        want = self._tokens(seq)
        self.s, rep = self.alloc.preempt(self.s, [seq], donate=donate)
        (_, _, toks, _), = rep.archives()
        assert toks.tolist() == want
        STATS["preempts"] += 1

    @rule(donate=st.booleans())
    def rebalance(self, donate):
        n = len(self._seqs(codes.SEQ_PREEMPTED))
        self.s, moved = self.alloc.rebalance(self.s, donate=donate)
        assert moved["recycled_slots"] == n and not self._seqs(codes.SEQ_PREEMPTED)

    @rule(kind=st.sampled_from(KINDS), tenant=st.integers(0, TINY.num_tenants - 1),
          policy=st.sampled_from(sorted(PRESETS)), blocks=st.integers(0, 8),
          donate=st.booleans())
    def reclaim(self, kind, tenant, policy, blocks, donate):
        req = {"quota_cut": ReclaimRequest.quota_cut(tenant, blocks * BLOCK),
               "lease_expiry": ReclaimRequest.lease_expiry(tenant),
               "make_room": ReclaimRequest.make_room(tenant, blocks * BLOCK)}[kind]
        plan = self.alloc.plan_reclaim(self.s, req, policy)
        cap = int(self.alloc.allocatable_blocks(self.s)[0])
        self.s, rep = self.alloc.apply_plan(self.s, plan, donate=donate)
        got = [dataclasses.replace(s, per_seq=()) for s in rep.steps]
        assert got == [dataclasses.replace(s, per_seq=()) for s in plan.steps], str(plan)
        returned = sum(s.pool0_bytes for s in rep.steps) // TINY.pool_bytes[0]
        assert int(self.alloc.allocatable_blocks(self.s)[0]) == cap + returned
        STATS[f"reclaim {kind}"] += 1
        STATS["reclaim steps"] += len(plan.steps)
        if kind == "lease_expiry":  # a fresh lease for the next program steps
            self.s, _ = self.alloc.set_quota(self.s, tenant, byte_quota=8 * BLOCK)
        if returned:
            self._top_up(tenant if kind == "make_room" else 1 - tenant, returned)

    def _top_up(self, t, blocks):
        """The returned pool-0 blocks are allocatable now: a prompt of that many blocks is
        refused only by its own tenant's quota, never by the pool or a slot."""
        if not self._seqs(codes.SEQ_FREE):
            return  # sequence slots are not capacity: suspended sessions keep theirs
        blocks = min(blocks, TINY.max_blocks_per_seq)
        toks = [7] * (blocks * TINY.block_size)
        s, adm = self.alloc.admit(self.s, *prompts([(t, toks)]))
        reason = int(adm.reason[0])
        assert reason in (OK, REFUSED_BYTE_QUOTA, REFUSED_TOKEN_QUOTA, REFUSED_GROWING), \
            adm.reasons()
        if reason == OK:
            self.s = s
            STATS["top-ups"] += 1

    @invariant()
    def ledger_drift_is_zero(self):
        """Charges per tenant and pool minus their recomputation from the block tables."""
        r = recompute(self.CONFIG, jax.device_get(self.s))
        assert (np.asarray(self.s.tenants.charged_blocks) - r["charged"] == 0).all()


class ColdReclaimMachine(ReclaimMachine):
    CONFIG = dataclasses.replace(TINY, keep_cold_blocks=True)


FAST = settings(tiers.FAST, max_examples=12)  # ~1 min per machine on 2 cores
FLOORS = {"reclaim quota_cut": 5, "reclaim lease_expiry": 5, "reclaim make_room": 5,
          "reclaim steps": 5, "preempts": 3, "idles": 2, "top-ups": 2}


def _run(machine, how, capsys):
    STATS.clear()
    run_state_machine_as_test(machine, settings=how)
    with capsys.disabled():
        print(f"\n{machine.__name__} exploration: "
              + ", ".join(f"{k}={v}" for k, v in sorted(STATS.items())))
    return dict(STATS)


# The cold variant runs under `slow` (as do both long runs): the default run's budget (issue #13).
@pytest.mark.parametrize("machine", [ReclaimMachine,
                                     pytest.param(ColdReclaimMachine, marks=pytest.mark.slow)])
def test_reclaim_state_machine(machine, capsys):
    stats = _run(machine, FAST, capsys)
    low = {k: (stats.get(k, 0), f) for k, f in FLOORS.items() if stats.get(k, 0) < f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"


@pytest.mark.slow
@pytest.mark.parametrize("machine", [ReclaimMachine, ColdReclaimMachine])
def test_reclaim_state_machine_long(machine, capsys):
    stats = _run(machine, tiers.SLOW, capsys)
    low = {k: (stats.get(k, 0), 10 * f) for k, f in FLOORS.items() if stats.get(k, 0) < 10 * f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"
