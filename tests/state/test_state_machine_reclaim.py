"""Stateful property test of reclaim in one action: the tier machine's programs (admit, append,
free, offload, restore, compress, evict) with the session lifecycle (idle, resume, preempt),
pins (pin_prefix of a running sequence, private or shared across the two tenants' salt; unpin),
rebalance and plan_reclaim -> apply_plan (every preset, every request kind) mixed in, with cold
cached blocks off and on. After every step: check_invariants (the ledger recomputed from the
tables, exactly: drift 0 per tenant and pool) and every block's pin_count equal to the pins the
machine holds. Every plan made on the device (`on_device=True`) equals the host model's
(plan_reclaim's default) exactly: steps, fates, shortfall, held bytes. After every apply: each step's measured bytes equal the plan's, the returned
pool-0 capacity is allocatable at once by a top-up, and pinned blocks were never reclaimable
(DESIGN.md): every block pinned before the plan is still pinned as often, resident (on no free
list, same payer and tokens) and on the device — save a lease expiry's, whose release drops
every pin on the tenant's blocks (`release_tenant(unpin=True)`) — and the plan's
`pinned_bytes_held` is exactly the victims' pinned device bytes the plan leaves (0 after a
lease expiry)."""

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
from kvquota.reclaim.device_plan import host_reason
from tests.state.common import BLOCK, TINY, fresh, prompts
from tests.state import test_state_machine_tiers as tiers

STATS = collections.Counter()
KINDS = ["quota_cut", "lease_expiry", "make_room"]
SYSTEM = [5, 4, 3, 2]  # a system prompt of two full blocks that both tenants send


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
        self.pins = []  # block ids the machine pinned and has not unpinned, with multiplicity

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

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data())
    def pin(self, data):
        """Pin a prefix of a running sequence: private blocks, or blocks shared with the other
        tenant (one salt: share_group=0), or blocks pinned already."""
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        have = -(-int(self.s.seqs.seq_lens[seq]) // TINY.block_size)
        self._pin(seq, data.draw(st.integers(1, have)))

    @rule(t=st.integers(0, TINY.num_tenants - 1), n=st.integers(1, len(SYSTEM) // TINY.block_size),
          toks=st.lists(st.integers(1, 5), max_size=TINY.max_tokens_per_seq - len(SYSTEM)))
    def admit_pinned(self, t, n, toks):
        """A request with the system prompt both tenants send, its first n blocks pinned (the
        second tenant's admission shares the first one's blocks, pinned or not)."""
        self.s, r = self.alloc.admit(self.s, *prompts([(t, SYSTEM + toks)]))
        if bool(r.admitted[0]):
            self._pin(int(r.seq_id[0]), n)

    def _pin(self, seq, n):
        blocks = np.asarray(self.s.seqs.block_tables[seq, :n])
        assert (blocks >= 0).all() and (blocks < self._device_end()).all()  # running: on device
        before = np.asarray(self.s.blocks.pin_count)[blocks]
        self.s, rep = self.alloc.pin_prefix(self.s, seq, n)
        assert np.asarray(rep.pin_count)[:n].tolist() == (before + 1).tolist()
        self.pins += [int(b) for b in blocks]
        STATS["pins"] += 1
        # Private: only this sequence references the block and its tenant pays for it. Shared:
        # other sequences reference it too, or the other tenant pays (a prefix-cache hit).
        own = ((np.asarray(self.s.blocks.ref_count)[blocks] == 1)
               & (np.asarray(self.s.blocks.payer)[blocks] == int(self.s.seqs.seq_tenant[seq])))
        STATS["pinned private blocks"] += int(own.sum())
        STATS["pinned shared blocks"] += int((~own).sum())

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        """Drop one pin from each of a few distinct blocks the machine holds pinned."""
        held = sorted(set(self.pins))
        blocks = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=min(4, len(held)),
                                    unique=True))
        self.s, _ = self.alloc.unpin_blocks(self.s, np.asarray(blocks, np.int32))
        for b in blocks:
            self.pins.remove(b)
        STATS["unpins"] += 1

    @precondition(lambda self: self._pinned_prefixes())
    @rule(data=st.data())
    def unpin_prefix(self, data):
        """Unpin the first k blocks of a running sequence whose prefix the machine pinned."""
        seq, n = data.draw(st.sampled_from(self._pinned_prefixes()))
        k = data.draw(st.integers(1, n))
        blocks = [int(b) for b in np.asarray(self.s.seqs.block_tables[seq, :k])]
        self.s, _ = self.alloc.unpin_prefix(self.s, seq, k)
        for b in blocks:
            self.pins.remove(b)
        STATS["unpins"] += 1

    def _pinned_prefixes(self):
        """(running seq, length of its table prefix whose blocks the machine holds pinned)."""
        held = set(self.pins)
        out = []
        for seq in self._seqs(codes.SEQ_RUNNING):
            table = np.asarray(self.s.seqs.block_tables[seq])
            n = 0
            while n < len(table) and int(table[n]) in held:
                n += 1
            if n:
                out.append((seq, n))
        return out

    def _device_end(self):
        """Block ids below this are on the device (pool 0 and the compressed pools)."""
        c = self.CONFIG
        return c.pool_starts[c.host_pool] if c.host_pool is not None else c.total_blocks

    def _pinned_device_bytes(self, host, tenants):
        """Device bytes of the blocks charged to `tenants` that are pinned, from the per-block
        columns (not the ledger's pinned_blocks)."""
        c = self.CONFIG
        pool = np.searchsorted(np.asarray(c.pool_starts), np.arange(c.total_blocks), "right") - 1
        per_block = np.asarray(c.pool_bytes)[pool] * np.asarray(c.device_pools)[pool]
        mine = np.isin(host["payer"], tenants) & (host["pin_count"] > 0)
        return int(per_block[mine].sum())

    def _pin_view(self):
        """Host copies (np.array, not views: the apply that follows may donate the state)."""
        return jax.tree.map(np.array, dict(
            pin_count=self.s.blocks.pin_count, payer=self.s.blocks.payer,
            token_ids=self.s.blocks.token_ids,
            free_list=self.s.free.free_list, free_count=self.s.free.free_count,
            charged=self.s.tenants.charged_blocks, registered=self.s.tenants.registered))

    @rule(donate=st.booleans())
    def rebalance(self, donate):
        n = len(self._seqs(codes.SEQ_PREEMPTED))
        self.s, moved = self.alloc.rebalance(self.s, donate=donate)
        assert moved["recycled_slots"] == n and not self._seqs(codes.SEQ_PREEMPTED)

    @rule(kind=st.sampled_from(KINDS), tenant=st.integers(0, TINY.num_tenants - 1),
          policy=st.sampled_from(sorted(PRESETS)), blocks=st.integers(0, 8),
          donate=st.booleans())
    def reclaim(self, kind, tenant, policy, blocks, donate):
        self._reclaim(kind, tenant, policy, blocks, donate)

    @precondition(lambda self: self.pins)
    @rule(data=st.data(), kind=st.sampled_from(KINDS), policy=st.sampled_from(sorted(PRESETS)),
          blocks=st.integers(0, 8), donate=st.booleans())
    def reclaim_pinned(self, data, kind, policy, blocks, donate):
        """A reclaim whose victim pays for pinned blocks (the uniform tenant of `reclaim` often
        holds none): a quota cut or lease expiry of the payer, or room made from it."""
        payers = sorted({int(p) for p in np.asarray(self.s.blocks.payer)[self.pins]})
        payer = data.draw(st.sampled_from(payers))
        tenant = (payer + 1) % TINY.num_tenants if kind == "make_room" else payer
        self._reclaim(kind, tenant, policy, blocks, donate)

    def _reclaim(self, kind, tenant, policy, blocks, donate):
        req = {"quota_cut": ReclaimRequest.quota_cut(tenant, blocks * BLOCK),
               "lease_expiry": ReclaimRequest.lease_expiry(tenant),
               "make_room": ReclaimRequest.make_room(tenant, blocks * BLOCK)}[kind]
        c = self.CONFIG
        pre = self._pin_view()
        plan = self.alloc.plan_reclaim(self.s, req, policy, on_device=True)
        # The device plan equals the host model's (plan_reclaim's default), exactly.
        oracle = self.alloc.plan_reclaim(self.s, req, policy)
        assert plan == oracle, f"device:\n{plan}\nhost:\n{oracle}"
        STATS["device plans compared"] += host_reason(plan.policy, req) is None
        cap = int(self.alloc.allocatable_blocks(self.s)[0])
        self.s, rep = self.alloc.apply_plan(self.s, plan, donate=donate)
        got = [dataclasses.replace(s, per_seq=()) for s in rep.steps]
        assert got == [dataclasses.replace(s, per_seq=()) for s in plan.steps], str(plan)
        returned = sum(s.pool0_bytes for s in rep.steps) // TINY.pool_bytes[0]
        assert int(self.alloc.allocatable_blocks(self.s)[0]) == cap + returned
        # Pins: never reclaimable. The victims are the tenant (quota cut, lease expiry) or every
        # other registered tenant (make room); only a lease expiry's release drops pins.
        victims = ([tenant] if kind != "make_room" else
                   [u for u in np.flatnonzero(pre["registered"]) if u != tenant])
        held = self._pinned_device_bytes(pre, victims)
        want = 0 if kind == "lease_expiry" else held
        assert plan.pinned_bytes_held == want, (held, str(plan))
        post = self._pin_view()
        free = {int(b) for p, start in enumerate(c.pool_starts)
                for b in post["free_list"][start:start + post["free_count"][p]]}
        unpinned = set()
        for b in sorted(set(self.pins)):
            if kind == "lease_expiry" and pre["payer"][b] == tenant:
                assert post["pin_count"][b] == 0, (b, str(plan))
                unpinned.add(b)
                continue
            assert post["pin_count"][b] == pre["pin_count"][b], (b, str(plan))
            assert b < self._device_end() and b not in free, (b, str(plan))
            assert post["payer"][b] == pre["payer"][b], (b, str(plan))
            assert (post["token_ids"][b] == pre["token_ids"][b]).all(), (b, str(plan))
        self.pins = [b for b in self.pins if b not in unpinned]
        if held and kind != "lease_expiry":
            units = np.asarray(c.pool_bytes) * np.asarray(c.device_pools)
            assert int((post["charged"][victims] * units).sum()) >= held, str(plan)
            if kind == "quota_cut":  # the pinned bytes stay charged: never planned
                charged = int((pre["charged"][tenant] * units).sum())
                assert plan.planned_bytes <= charged - held, str(plan)
                assert plan.shortfall_bytes >= plan.target_bytes - (charged - held), str(plan)
        STATS[f"reclaim {kind} holding pins"] += bool(held)
        STATS["reclaims holding pins"] += bool(held)
        STATS["lease expiry unpins"] += len(unpinned)
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

    @invariant()
    def pins_are_the_machines(self):
        """Only the machine pins: each block's pin_count is how often it holds the block."""
        want = np.bincount(np.asarray(self.pins, np.int64), minlength=self.CONFIG.total_blocks)
        assert (np.asarray(self.s.blocks.pin_count) == want).all(), self.pins


class ColdReclaimMachine(ReclaimMachine):
    CONFIG = dataclasses.replace(TINY, keep_cold_blocks=True)


FAST = settings(tiers.FAST, max_examples=12, stateful_step_count=40)  # ~1 min a machine, 2 cores
FLOORS = {"reclaim quota_cut": 5, "reclaim lease_expiry": 5, "reclaim make_room": 5,
          "reclaim steps": 5, "preempts": 3, "idles": 2, "top-ups": 2,
          "pins": 5, "unpins": 2, "pinned private blocks": 5, "pinned shared blocks": 1,
          "reclaims holding pins": 2, "device plans compared": 5}


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


def test_lease_expiry_plans_the_heir_of_a_pinned_block_others_reference():
    """Found by the machine's pins (the plan's model looked for heirs by the dropped rows' salts
    only, so it kept the charge where release_tenant(unpin=True) passes it on): tenant 0 pins
    its prompt's first block and frees the sequence; tenant 1 admits the same prompt (one salt)
    and hits the pinned block. A lease expiry of tenant 0 unpins it and its charge passes to
    tenant 1: the plan must say so."""
    alloc, s = fresh(TINY, tenants=((64, 8 * BLOCK, 0), (64, 8 * BLOCK, 0)))
    s, r = alloc.admit(s, *prompts([(0, SYSTEM)]))
    s, _ = alloc.pin_prefix(s, int(r.seq_id[0]), 1)
    s, _ = alloc.free(s, [int(r.seq_id[0])])
    s, r = alloc.admit(s, *prompts([(1, SYSTEM)]))
    assert int(r.hit_blocks[0]) == 1
    plan = alloc.plan_reclaim(s, ReclaimRequest.lease_expiry(0), "tiered")
    s, rep = alloc.apply_plan(s, plan)
    assert np.asarray(s.tenants.charged_blocks)[:, 0].tolist() == [0, 2]  # the heir pays
    assert rep.steps == plan.steps, str(plan)


@pytest.mark.slow
@pytest.mark.parametrize("machine", [ReclaimMachine, ColdReclaimMachine])
def test_reclaim_state_machine_long(machine, capsys):
    stats = _run(machine, tiers.SLOW, capsys)
    low = {k: (stats.get(k, 0), 10 * f) for k, f in FLOORS.items() if stats.get(k, 0) < 10 * f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"
