"""Reclaim in one action: plan == apply exactly, fates, the returned quota allocatable at once,
lossless means leave others' attention bit-identical, grow-no-admit, and typed errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels.paged_attention as pa
from kvquota import errors as E
from kvquota.codes import (
    FATE_COMPRESSED,
    FATE_EVICTED,
    FATE_GROWING,
    FATE_PREEMPTED,
    FATE_RELEASED,
    FATE_SUSPENDED,
    FATE_UNTOUCHED,
    REFUSED_GROWING,
    SEQ_FREE,
    SEQ_IDLE,
    SEQ_PREEMPTED,
    SEQ_RUNNING,
    SEQ_SUSPENDED,
)
from kvquota.reclaim import PRESETS, ReclaimPolicy, ReclaimRequest, register
from kvquota.reclaim.means import REGISTRY, DropIdle
from kvquota.sentinel import INVALID
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, snapshot

# 16 device blocks of 2 tokens, an int8 pool and a host pool of 8 each, 3 tenants (0 and 1 in
# share group 1), 8 sequence slots of <= 4 blocks.
CFG = dataclasses.replace(TINY, num_blocks=16, max_seqs=8, num_tenants=3, host_blocks=8,
                          compressed_pools=(("int8", 8),))
SMALL_KEEP = ReclaimPolicy(name="small", compress_keep_recent=2, evict_keep_tokens=2,
                           compress_gated=False, allow_evict=True)
POLICIES = list(PRESETS) + [SMALL_KEEP,
                            dataclasses.replace(SMALL_KEEP, name="evict-small",
                                                means=("evict", "preempt")),
                            dataclasses.replace(SMALL_KEEP, name="compress-small",
                                                means=("compress", "preempt"))]


def _fill_pages(s, seed=0):
    """Distinct random K/V in pool 0's held blocks (stands in for the model's); free pages stay
    zero, as scrub_on_free requires."""
    rng = np.random.default_rng(seed)
    pool0 = s.pages[0]
    held = (np.asarray(s.blocks.ref_count[: CFG.num_blocks]) > 0)[None, None, :, None, None]
    k = jnp.asarray(np.where(held, rng.standard_normal(pool0.k.shape), 0).astype(np.float32))
    v = jnp.asarray(np.where(held, rng.standard_normal(pool0.v.shape), 0).astype(np.float32))
    return s.replace(pages=(pool0.replace(k=k, v=v),) + s.pages[1:])


def scenario():
    """t0: a 7-token prompt sharing 2 blocks with t1's prompt (same group) and a private 5-token
    one; t1: the shared prompt + 1; t2: a private 6-token prompt. Sequence 1 (t0) is idle."""
    alloc, s = fresh(CFG, tenants=((100, 16 * BLOCK, 1), (100, 16 * BLOCK, 1),
                                   (100, 16 * BLOCK, None)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (0, [9, 9, 9, 9, 9])]))
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 8]), (2, [5, 5, 5, 5, 5, 6])]))
    s, _ = alloc.set_idle(s, [1, INVALID])
    s = _fill_pages(s)
    alloc.check(s)
    return alloc, s


REQUESTS = [ReclaimRequest.quota_cut(0, 2 * BLOCK), ReclaimRequest.quota_cut(0, 0),
            ReclaimRequest.lease_expiry(0), ReclaimRequest.make_room(2, 12 * BLOCK),
            ReclaimRequest.quota_cut(2, 10 * BLOCK)]


def _figures(steps):
    return [(st.means, st.seqs, st.blocks, st.quota_bytes, st.pool_bytes, st.pool0_bytes,
             st.host_bytes) for st in steps]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p if isinstance(p, str) else p.name)
def test_plan_equals_apply_for_every_policy_and_request(policy):
    alloc, s = scenario()
    for req in REQUESTS:
        plan = alloc.plan_reclaim(s, req, policy)
        before = snapshot(s)
        s2, rep = alloc.apply_plan(s, plan)
        assert leaves_equal(s, before)  # not donated: the input is intact
        alloc.check(s2)
        assert _figures(rep.steps) == _figures(plan.steps), (str(plan), rep.steps)
        assert plan.shortfall_bytes == max(0, plan.target_bytes - plan.planned_bytes) or \
            req.kind == "lease_expiry"
        # Every sequence of the victim tenant(s) has exactly one fate.
        victims = {req.tenant} if req.kind != "make_room" else {0, 1}
        live = np.flatnonzero(np.isin(np.asarray(s.seqs.seq_tenant), list(victims)))
        assert sorted(f.seq for f in plan.fates) == sorted(live.tolist())
        status = np.asarray(s2.seqs.seq_status)
        for f in plan.fates:
            want = {FATE_UNTOUCHED: (SEQ_RUNNING, SEQ_IDLE), FATE_GROWING: (SEQ_RUNNING,),
                    FATE_COMPRESSED: (SEQ_RUNNING, SEQ_IDLE), FATE_EVICTED: (SEQ_RUNNING, SEQ_IDLE),
                    FATE_SUSPENDED: (SEQ_SUSPENDED,), FATE_RELEASED: (SEQ_FREE,),
                    FATE_PREEMPTED: (SEQ_FREE,) if plan.policy.rebalance else (SEQ_PREEMPTED,)}
            assert status[f.seq] in want[f.fate], (f, status[f.seq])
        # Quota cut: met unless a shortfall is reported.
        if req.kind == "quota_cut" and not plan.policy.grow_no_admit:
            dev = alloc.ledger(s2).device_bytes[req.tenant]
            assert dev <= req.byte_quota + plan.shortfall_bytes


def pinned_scenario():
    """`scenario()` with tenant 0 pinning two blocks: one only it holds (seq 1's first block) and
    one it shares with tenant 1 (the shared prompt's first block, which it pays for)."""
    alloc, s = scenario()
    private, shared = int(s.seqs.block_tables[1, 0]), int(s.seqs.block_tables[0, 0])
    assert int(s.blocks.ref_count[private]) == 1 and int(s.blocks.ref_count[shared]) == 2
    assert int(s.blocks.payer[private]) == int(s.blocks.payer[shared]) == 0
    s, _ = alloc.pin_blocks(s, np.array([private, shared], np.int32))
    alloc.check(s)
    return alloc, s, (private, shared)


def test_a_plan_reads_the_victims_pinned_blocks_that_no_table_holds():
    """A plan reads only the victims' rows and blocks (`plan_view`); a block the victim pinned
    and then freed its sequence of is in no table, yet charged and held: the view finds it by
    its payer, and the plan counts it as held by pins, as apply measures."""
    from kvquota.reclaim.planner import plan_view

    alloc, s, (private, shared) = pinned_scenario()
    s, _ = alloc.free(s, [1])  # seq 1 held the private pinned block
    alloc.check(s)
    assert private not in np.asarray(s.seqs.block_tables).ravel()
    view = plan_view(CFG, s, lambda v: [0])
    assert {private, shared} <= set(view.block_ids.tolist())
    assert set(view.rows.tolist()) == {0, 2}  # tenant 0's live row and its heir's (same salt)
    # What tenant 0 still pays for on the device after a cut to 0: the two pinned blocks, and
    # under tiered the unpinned shared block (tenant 1 still reads it); preempting seq 0 instead
    # passes that block's charge to tenant 1 (still counted as held by others).
    left = {"tiered": 3 * BLOCK, "preempt-all": 2 * BLOCK}
    for policy, device_bytes in left.items():
        plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0), policy)
        assert (plan.pinned_bytes_held, plan.shared_bytes_held) == (2 * BLOCK, BLOCK), str(plan)
        s2, rep = alloc.apply_plan(s, plan)
        alloc.check(s2)
        assert _figures(rep.steps) == _figures(plan.steps), str(plan)
        assert alloc.ledger(s2).device_bytes[0] == device_bytes


# Three policies run by default (between them every means but evict); the rest under `slow`.
PINNED_DEFAULT = ("tiered", "small", "compress-small")


@pytest.mark.parametrize("policy", [
    pytest.param(p, marks=() if (p if isinstance(p, str) else p.name) in PINNED_DEFAULT
                 else pytest.mark.slow) for p in POLICIES],
    ids=lambda p: p if isinstance(p, str) else p.name)
def test_pinned_blocks_are_never_planned_as_reclaimable(policy):
    """Pins hold their blocks on the device under every preset: a plan counts them as held by
    pins, never as bytes it takes, and apply measures exactly what the plan said."""
    alloc, s, pinned = pinned_scenario()
    for req in (ReclaimRequest.quota_cut(0, 0), ReclaimRequest.quota_cut(0, 2 * BLOCK),
                ReclaimRequest.make_room(2, 12 * BLOCK)):
        plan = alloc.plan_reclaim(s, req, policy)
        s2, rep = alloc.apply_plan(s, plan)
        alloc.check(s2)
        assert _figures(rep.steps) == _figures(plan.steps), (str(plan), rep.steps)
        for b in pinned:  # still resident, pinned and charged to tenant 0
            assert int(s2.blocks.pin_count[b]) == 1 and int(s2.blocks.payer[b]) == 0
        if req.kind == "quota_cut":
            assert plan.pinned_bytes_held == 2 * BLOCK
            # Everything else tenant 0 paid for on the device is at most what the plan took.
            before = alloc.ledger(s).device_bytes[0]
            assert plan.planned_bytes <= before - 2 * BLOCK
            assert alloc.ledger(s2).device_bytes[0] >= 2 * BLOCK


class DropEveryIdle(DropIdle):
    """A toy means: every IDLE victim session dropped, whether its tenant is active or not."""

    name = "drop_every_idle"

    def candidates(self, planner):
        return planner.untouched((SEQ_IDLE,))


def test_a_new_means_is_one_class_and_one_registry_line():
    """Tenant 0 is active (seq 0 runs), so drop_idle leaves its idle seq 1 alone; the toy means
    takes it, and plan, apply, fates and archives treat it as any built-in means."""
    alloc, s = scenario()
    cut = ReclaimRequest.quota_cut(0, 0)
    assert all(st.means != "drop_idle" for st in alloc.plan_reclaim(s, cut, "tiered").steps)
    register(DropEveryIdle())
    try:
        policy = ReclaimPolicy(name="toy", means=("drop_every_idle", "preempt"))
        plan = alloc.plan_reclaim(s, cut, policy)
        s2, rep = alloc.apply_plan(s, plan)
    finally:
        del REGISTRY[DropEveryIdle.name]
    alloc.check(s2)
    assert [(st.means, st.seqs) for st in plan.steps] == [("drop_every_idle", (1,)),
                                                          ("preempt", (0,))]
    assert _figures(rep.steps) == _figures(plan.steps)
    assert {f.seq: f.fate for f in plan.fates} == {0: FATE_PREEMPTED, 1: FATE_PREEMPTED}
    assert sorted(a.seq for a in rep.archives) == [0, 1]
    with pytest.raises(E.InvalidArgumentError, match="unknown reclaim means"):
        ReclaimPolicy(name="toy", means=("drop_every_idle",))  # unregistered again


def test_tiered_quota_cut_then_topup_fits_at_once():
    alloc, s = scenario()
    # Tenant 2 fills pool 0 (5 free blocks) so nothing is left for a top-up.
    s, adm = alloc.admit(s, *prompts([(2, list(range(10, 18))), (2, [20, 21])]))
    assert np.asarray(adm.admitted).all() and int(s.free.free_count[0]) == 0
    led = alloc.ledger(s)
    # t0 is charged 7 blocks: its idle session's 3, its running prompt's 2 own and the 2 it
    # shares with t1. Offloading moves own blocks only, so a cut to 2 blocks is met exactly
    # and a cut to 1 falls short by the shared block t0 still references, reported as such.
    short = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, BLOCK))
    assert short.shortfall_bytes == BLOCK and short.shared_bytes_held == 2 * BLOCK
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 2 * BLOCK))
    assert plan.shortfall_bytes == 0 and plan.target_bytes == led.device_bytes[0] - 2 * BLOCK
    assert [st.means for st in plan.steps] == ["offload_idle", "suspend_running"]
    s2, rep = alloc.apply_plan(s, plan)
    alloc.check(s2)
    returned = sum(st.pool_bytes for st in rep.steps)
    assert returned == plan.target_bytes == 5 * BLOCK
    fates = {f.seq: f for f in rep.fates}
    assert fates[1].fate == FATE_SUSPENDED and fates[1].resume_bytes == 3 * BLOCK
    assert fates[1].resume_seconds == pytest.approx(3 * BLOCK / CFG.host_bandwidth)
    # The returned pool-0 bytes (5 blocks) are refused before and allocatable right after.
    topup = prompts([(2, list(range(30, 38))), (2, [40, 41])])
    _, before = alloc.admit(s, *topup)
    assert not np.asarray(before.admitted).any(), before.reasons()
    s3, after = alloc.admit(s2, *topup)
    assert np.asarray(after.admitted).all(), after.reasons()
    alloc.check(s3)


def test_compression_waits_for_the_host_alarm_or_a_full_host():
    """Tiered order with a 2-token recent window: with room on the host, offload does it all;
    with a host pool too small for either sequence, compression is reached (lossy), and then
    preemption drops what is still needed."""
    pol = dataclasses.replace(PRESETS["tiered"], compress_keep_recent=2)
    alloc, s = scenario()
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 2 * BLOCK), pol)
    assert "compress" not in [st.means for st in plan.steps]
    small_host = dataclasses.replace(CFG, host_blocks=2)
    alloc2, s2 = fresh(small_host, tenants=((100, 16 * BLOCK, 1), (100, 16 * BLOCK, 1),
                                            (100, 16 * BLOCK, None)))
    s2, _ = alloc2.admit(s2, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (0, [9, 9, 9, 9, 9])]))
    s2, _ = alloc2.set_idle(s2, [1, INVALID])
    plan = alloc2.plan_reclaim(s2, ReclaimRequest.quota_cut(0, 2 * BLOCK), pol)
    means = [st.means for st in plan.steps]
    assert means == ["compress", "preempt"] and plan.shortfall_bytes == 0
    s3, rep = alloc2.apply_plan(s2, plan)
    alloc2.check(s3)
    assert _figures(rep.steps) == _figures(plan.steps)
    # (Compression alone gives 2,208 of the 5,120 B, so both sequences end preempted.)
    assert [f.fate for f in rep.fates] == [FATE_PREEMPTED, FATE_PREEMPTED]


def _attend(s, seqs):
    """Decode attention of `seqs` (reference path) with a fixed query, layer 0."""
    q = jnp.asarray(np.random.default_rng(1).standard_normal((len(seqs), 4, 16)), jnp.float32)
    tables = jnp.asarray(np.asarray(s.seqs.block_tables)[seqs])
    lens = jnp.asarray(np.asarray(s.seqs.seq_lens)[seqs])
    return np.asarray(pa.decode(q, s.pages[0].k[0], s.pages[0].v[0], tables, lens,
                                backend="reference"))


@pytest.mark.parametrize("policy", ["swap-all", "preempt-all"])
def test_lossless_means_leave_other_tenants_attention_bit_identical(policy):
    alloc, s = scenario()
    others = [3]  # tenant 2's sequence
    want = _attend(s, others)
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0), policy)
    s2, _ = alloc.apply_plan(s, plan)
    alloc.check(s2)
    np.testing.assert_array_equal(_attend(s2, others), want)
    # Offload -> restore: the suspended sequences attend exactly as before too.
    if policy == "swap-all":
        mine = [0, 1]
        before = _attend(s, mine)
        s3, _ = alloc.set_quota(s2, 0, byte_quota=16 * BLOCK)  # the quota comes back
        s3, _ = alloc.restore(s3, [0, 1])
        alloc.check(s3)
        np.testing.assert_array_equal(_attend(s3, mine), before)


def test_shared_system_prompt_survives_lease_expiry_of_one_tenant():
    alloc, s = scenario()
    s, _ = alloc.pin_prefix(s, 2, 2)  # t1 pins the shared 4-token system prompt (2 blocks)
    want = _attend(s, [2])
    plan = alloc.plan_reclaim(s, ReclaimRequest.lease_expiry(0))
    assert plan.shared_bytes_held >= 0 and [st.means for st in plan.steps] == ["release"]
    s2, rep = alloc.apply_plan(s, plan)
    alloc.check(s2)
    assert all(f.fate == FATE_RELEASED for f in rep.fates)
    np.testing.assert_array_equal(_attend(s2, [2]), want)
    led = alloc.ledger(s2)
    assert led.charged_bytes[0] == 0 and led.device_bytes[1] >= 2 * BLOCK  # t1 inherited
    # A later lookup of the system prompt hits only live, pool-0 blocks holding those tokens.
    s3, adm = alloc.admit(s2, *prompts([(1, [1, 2, 3, 4, 7])]))
    alloc.check(s3)
    assert int(adm.cached_tokens[0]) == 4
    table = np.asarray(s3.seqs.block_tables[int(adm.seq_id[0])])[:2]
    assert (table < CFG.num_blocks).all()
    np.testing.assert_array_equal(np.asarray(s3.blocks.token_ids)[table].ravel(), [1, 2, 3, 4])


def test_lookups_after_reclaim_never_hit_freed_compressed_or_host_blocks():
    alloc, s = scenario()
    for policy in (SMALL_KEEP, "swap-all", "preempt-all"):
        plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0), policy)
        s2, _ = alloc.apply_plan(s, plan)
        # Reuse the freed blocks for other tokens, then look the old prompts up again.
        s2, _ = alloc.admit(s2, *prompts([(2, [60, 61, 62, 63, 64, 65, 66, 67])]))
        s3, adm = alloc.admit(s2, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (1, [1, 2, 3, 4, 8])]))
        alloc.check(s3)
        toks = np.asarray(s3.blocks.token_ids)
        for i, prompt in enumerate([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8]]):
            if not adm.admitted[i]:
                continue
            hits = int(adm.hit_blocks[i])
            table = np.asarray(s3.seqs.block_tables[int(adm.seq_id[i])])[:hits]
            assert (table < CFG.num_blocks).all()  # pool 0 only
            np.testing.assert_array_equal(toks[table].ravel(), prompt[: 2 * hits])


def test_grow_no_admit_refuses_admissions_until_under_quota_and_keeps_appending():
    alloc, s = scenario()
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(2, 2 * BLOCK), "grow-no-admit")
    assert plan.steps == () and plan.shortfall_bytes == plan.target_bytes == BLOCK
    assert {f.seq: f.fate for f in plan.fates} == {3: FATE_GROWING}
    s, _ = alloc.apply_plan(s, plan)
    alloc.check(s)
    assert bool(alloc.ledger(s).growing[2])
    for tok in range(2):  # running sequence 3 grows past the cut: 6 -> 8 tokens, a new block
        s, app = alloc.append(s, [3, INVALID], [20 + tok, 0])
        assert bool(app.appended[0]), app.reasons()
        alloc.check(s)
    assert alloc.ledger(s).device_bytes[2] == 4 * BLOCK
    _, adm = alloc.admit(s, *prompts([(2, [30, 31])]))
    assert int(adm.reason[0]) == REFUSED_GROWING
    # Once its usage is under the quota again, it is admitted.
    s, _ = alloc.free(s, [3, INVALID])
    s, adm = alloc.admit(s, *prompts([(2, [30, 31])]))
    assert bool(adm.admitted[0]), adm.reasons()
    alloc.check(s)


def test_preempt_archives_tokens_and_rebalance_recycles_the_slot():
    alloc, s = scenario()
    s2, rep = alloc.preempt(s, [0, INVALID])
    alloc.check(s2)
    (seq, ten, tok, pos), = rep.archives()
    assert (seq, ten, pos) == (0, 0, 7) and tok.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert int(s2.seqs.seq_status[0]) == SEQ_PREEMPTED and int(s2.tenants.preemptions[0]) == 1
    with pytest.raises(E.UnknownSequenceError):
        alloc.append(s2, [0, INVALID], [1, 0])
    s3, moved = alloc.rebalance(s2)
    alloc.check(s3)
    assert moved == {"recycled_slots": 1, "cold_blocks_dropped": 0}
    assert int(s3.seqs.seq_status[0]) == SEQ_FREE


def test_rebalance_drops_cold_blocks_lru_and_keeps_capacity():
    cfg = dataclasses.replace(CFG, keep_cold_blocks=True)
    alloc, s = fresh(cfg, tenants=((100, 16 * BLOCK, 1), (100, 16 * BLOCK, 1),
                                   (100, 16 * BLOCK, None)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (2, [6, 6, 6, 6, 6])]))
    s, _ = alloc.free(s, [0])  # t0's 2 full blocks go cold first (the tail to the free list)
    s, _ = alloc.free(s, [1])  # then t2's
    alloc.check(s)
    cap = alloc.allocatable_blocks(s).tolist()
    s2, moved = alloc.rebalance(s, cold_blocks=2)
    alloc.check(s2)
    assert moved == {"recycled_slots": 0, "cold_blocks_dropped": 2}
    assert alloc.allocatable_blocks(s2).tolist() == cap
    # The least recently used (t0's) left the cache; t2's next turn still hits its blocks.
    _, adm = alloc.admit(s2, *prompts([(2, [6, 6, 6, 6, 6]), (0, [1, 2, 3, 4, 5])]))
    assert adm.cached_tokens.tolist() == [4, 0]


def test_idle_resume_and_appends():
    alloc, s = scenario()
    with pytest.raises(E.UnknownSequenceError):
        alloc.append(s, [1, INVALID], [1, 0])  # idle: no appends
    s, _ = alloc.resume(s, [1, INVALID])
    s, app = alloc.append(s, [1, INVALID], [1, 0])
    assert bool(app.appended[0])
    alloc.check(s)


@pytest.mark.parametrize("bad, error", [
    (lambda a, s: a.plan_reclaim(s, ReclaimRequest.quota_cut(7, 0)), E.UnknownTenantError),
    (lambda a, s: a.plan_reclaim(s, ReclaimRequest.quota_cut(0, -1)), E.QuotaValueError),
    (lambda a, s: a.plan_reclaim(s, ReclaimRequest.make_room(2, -5)), E.QuotaValueError),
    (lambda a, s: a.plan_reclaim(s, ReclaimRequest("shrink", 0)), E.InvalidArgumentError),
    (lambda a, s: a.plan_reclaim(s, ReclaimRequest.lease_expiry(0), "fastest"),
     E.InvalidArgumentError),
    (lambda a, s: a.plan_reclaim(s, ReclaimRequest.lease_expiry(0),
                                 ReclaimPolicy(compress_format="kivi2")), E.TierError),
    (lambda a, s: a.apply_plan(a.admit(s, *prompts([(2, [1])]))[0],
                               a.plan_reclaim(s, ReclaimRequest.lease_expiry(0))),
     E.PlanMismatchError),
    (lambda a, s: a.apply_plan(s, "plan"), E.InvalidArgumentError),
])
def test_bad_requests_are_typed_and_leave_the_state_unchanged(bad, error):
    alloc, s = scenario()
    before = snapshot(s)
    with pytest.raises(error):
        bad(alloc, s)
    assert leaves_equal(s, before)


def test_bad_policy_fields_are_typed():
    with pytest.raises(E.InvalidArgumentError):
        ReclaimPolicy(means=("teleport",))
    with pytest.raises(E.InvalidArgumentError):
        ReclaimPolicy(victim_order="oldest")


def test_donated_apply_consumes_the_input():
    alloc, s = scenario()
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0))
    want, _ = alloc.apply_plan(s, plan)
    got, _ = alloc.apply_plan(s, plan, donate=True)
    assert leaves_equal(jax.device_get(got), jax.device_get(want))
    with pytest.raises(E.StateMismatchError):
        alloc.ledger(s)


def test_pinning_a_host_block_is_refused():
    """A pin keeps a block resident on the device; a suspended sequence's host block is not
    (restore would otherwise leave the pinned block behind on the host)."""
    alloc, s = scenario()
    s, _ = alloc.offload(s, [1, INVALID])
    host_block = int(np.asarray(s.seqs.block_tables[1])[0])
    assert host_block >= CFG.pool_starts[CFG.host_pool]
    before = snapshot(s)
    with pytest.raises(E.TierError):
        alloc.pin_blocks(s, [host_block])
    assert leaves_equal(s, before)
