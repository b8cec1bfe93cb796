"""Admission without the rows the device would surely refuse (kvquota.serving.quota_view): the
device's `missing_blocks` is the least a row needs, every row the view calls a sure refusal is
refused by the device with that reason, and a load-test replay is the same with the view as
with every row sent to the device, refusal counts included, in fewer admit calls.
"""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquota as kq
from configs.models import get_model_config
from kvquota.codes import (OK, REFUSED_BYTE_QUOTA, REFUSED_GROWING, REFUSED_POOL_FULL,
                           REFUSED_TOKEN_QUOTA, SEQ_FREE)
from kvquota.serving import CostModelExecutor, Event, Request, Scheduler
from kvquota.serving.quota_view import QUOTA_REFUSALS, QuotaView
from kvquota.serving.waiting import Parking
from kvquota.sim import loadtest as lt
from kvquota.sim.traces import TraceConfig, generate_trace

TINY = get_model_config("tiny-qwen")
CONFIG = kq.StateConfig(TINY, num_blocks=40, block_size=4, max_seqs=8, max_blocks_per_seq=12,
                        num_tenants=3, kv_format="f32", keep_cold_blocks=True, with_pages=False)
BLOCK = CONFIG.pool_bytes[0]  # bytes of a pool-0 block (the only device pool here)
ROWS, WIDTH = 6, 48
ALLOC = kq.Allocator(CONFIG)
HOSTED = dataclasses.replace(CONFIG, host_blocks=16, keep_cold_blocks=False)  # suspensions


def _batch(rows):
    ten, lens = np.full(ROWS, -1, np.int32), np.zeros(ROWS, np.int32)
    tok = np.zeros((ROWS, WIDTH), np.int32)
    for i, (t, ids) in enumerate(rows):
        ten[i], lens[i], tok[i, : len(ids)] = t, len(ids), ids
    return ten, tok, lens


def _prompt(data, base):
    """A prompt that often shares a prefix with `base` (prefix-cache hits, cold ones too)."""
    keep = data.draw(st.integers(0, len(base)))
    tail = data.draw(st.lists(st.integers(0, 3), min_size=0 if keep else 1, max_size=WIDTH - keep))
    return list(base[:keep]) + tail


class Row:
    """A queued request as the view sees it: tenant and context."""

    def __init__(self, tenant, context):
        self.tenant, self.context = tenant, context


def _random_state(data, base):
    """Random quotas, holdings (some freed into cold cache blocks) and grow-no-admit flags."""
    state = ALLOC.init()
    for t in range(3):
        state, _ = ALLOC.register_tenant(
            state, t, token_quota=data.draw(st.integers(1, 120)),
            byte_quota=data.draw(st.integers(0, 14)) * BLOCK)
    held = [(data.draw(st.integers(0, 2)), _prompt(data, base)) for _ in range(3)]
    state, rep = ALLOC.admit(state, *_batch(held))
    admitted = np.flatnonzero(np.asarray(rep.admitted))
    freed = [int(s) for s, f in zip(np.asarray(rep.seq_id)[admitted],
                                    data.draw(st.lists(st.booleans(), min_size=len(admitted),
                                                       max_size=len(admitted)))) if f]
    if freed:
        state, _ = ALLOC.free(state, np.asarray(freed, np.int32))
    growing = data.draw(st.lists(st.booleans(), min_size=3, max_size=3))
    state = state.update(growing=jax.numpy.asarray(growing))
    kq.check_invariants(CONFIG, state)
    return state


def _tenants(state):
    t = jax.device_get(state.tenants)
    return np.asarray(t.used_tokens), np.asarray(t.charged_blocks)[:, 0]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.data())
def test_missing_blocks_is_the_least_each_row_needs(data):
    """Random quotas, holdings (some freed into cold cache blocks), grow-no-admit flags and
    batches. Admitted rows: missing_blocks == new_blocks, and each tenant is charged at least
    their sum (cold hits revived on top). A row refused for quota with no admitted row before
    it in the batch, tried alone on the state it was decided on with its tenant's quotas at
    used + its tokens and charged + missing - 1 blocks, is refused over byte quota; with room
    for every block of its prompt, admitted (unless the pool is short)."""
    base = [1, 2, 3, 0] * 12
    state = _random_state(data, base)
    rows = [(data.draw(st.integers(0, 2)), _prompt(data, base))
            for _ in range(data.draw(st.integers(1, ROWS)))]
    after, rep = ALLOC.admit(state, *_batch(rows))
    kq.check_invariants(CONFIG, after)
    rep = jax.device_get(rep)
    (used, charged0), (_, charged) = _tenants(state), _tenants(after)
    ok = np.asarray(rep.admitted)
    assert (rep.missing_blocks[ok] == rep.new_blocks[ok]).all()
    for t in range(3):
        mine = [i for i, (u, _) in enumerate(rows) if u == t and ok[i]]
        assert charged[t] - charged0[t] >= sum(int(rep.missing_blocks[i]) for i in mine)
    first_ok = min(np.flatnonzero(ok), default=ROWS)
    host = jax.device_get(state)
    room = int(host.free.free_count[0]) + int(host.free.cold_count)
    slots = int((np.asarray(host.seqs.seq_status) == SEQ_FREE).sum())
    for i, (t, ids) in enumerate(rows):
        if rep.reason[i] not in QUOTA_REFUSALS or i > first_ok:
            continue  # (after an admitted row the cache and use differ from what row i saw)
        least, most = int(rep.missing_blocks[i]), -(-len(ids) // CONFIG.block_size)
        for blocks, want in ((least - 1, REFUSED_BYTE_QUOTA), (most, OK)):
            if blocks < 0 or want == OK and (most > room or not slots):
                continue  # the pool, not the quota, would refuse it
            trial, _ = ALLOC.set_quota(state, t, token_quota=int(used[t]) + len(ids),
                                       byte_quota=(int(charged0[t]) + blocks) * BLOCK)
            trial, one = ALLOC.admit(trial, *_batch([(t, ids)]))
            kq.check_invariants(CONFIG, trial)
            assert int(one.reason[0]) == want, (i, t, ids, least, blocks)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.data())
def test_sure_refusals_are_the_devices_refusals(data):
    """Random states and batches, each row's missing blocks known from a first try on the same
    cache (or not: then at least one): the device refuses every sure-refused row with the
    view's reason."""
    base = [1, 2, 3, 0] * 12
    state = _random_state(data, base)
    rows = [Row(data.draw(st.integers(0, 2)), _prompt(data, base))
            for _ in range(data.draw(st.integers(1, ROWS)))]
    batch = _batch([(r.tenant, r.context) for r in rows])
    _, first = ALLOC.admit(state, *batch)
    view = QuotaView(CONFIG)
    for r, tried, missing in zip(rows, data.draw(st.lists(st.booleans(), min_size=len(rows),
                                                          max_size=len(rows))),
                                 np.asarray(first.missing_blocks)):
        if tried:
            view.least[r] = int(missing)
    assert view.read(state) == 1 and view.read(state) == 0  # read once, then current
    sure = view.sure_refusals(rows)
    after, rep = ALLOC.admit(state, *batch)
    kq.check_invariants(CONFIG, after)
    reasons = np.asarray(rep.reason)
    for i, reason in sure.items():
        assert reasons[i] == reason, (i, rows[i].tenant, rows[i].context, reasons[i], reason)


def test_each_reason_is_found_before_the_call():
    """By hand: over token quota (also after a row of the tenant that goes to the device),
    over byte quota (the missing blocks of an earlier try), growing past a cut, each as the
    device says."""
    state = ALLOC.init()
    for t, (tq, bq) in enumerate([(10, 40 * BLOCK), (100, 2 * BLOCK), (100, 0)]):
        state, _ = ALLOC.register_tenant(state, t, token_quota=tq, byte_quota=bq)
    state, _ = ALLOC.admit(state, *_batch([(1, [5] * 4)]))  # tenant 1 holds 1 of its 2 blocks
    state = state.update(growing=jax.numpy.asarray([False, False, True]))
    rows = [Row(0, [1] * 11), Row(0, [1] * 4), Row(0, [1] * 11), Row(1, [2] * 8),
            Row(1, [2] * 3), Row(2, [3] * 3)]
    view = QuotaView(CONFIG)
    view.least[rows[3]] = 2  # its last try missed 2 blocks: 1 block of room is short
    view.read(state)
    sure = view.sure_refusals(rows)
    assert sure == {0: REFUSED_TOKEN_QUOTA, 2: REFUSED_TOKEN_QUOTA, 3: REFUSED_BYTE_QUOTA,
                    5: REFUSED_GROWING}
    _, rep = ALLOC.admit(state, *_batch([(r.tenant, r.context) for r in rows]))
    assert np.asarray(rep.reason).tolist() == [REFUSED_TOKEN_QUOTA, 0, REFUSED_TOKEN_QUOTA,
                                               REFUSED_BYTE_QUOTA, 0, REFUSED_GROWING]


@pytest.mark.parametrize("policy", ["tiered", pytest.param("grow-no-admit",
                                                             marks=pytest.mark.slow)])
def test_a_replay_is_the_same_without_the_view(policy, monkeypatch):
    """Load-test replays with deep quota cuts: every step and request record, refusal counts
    included, is the same with the view as with every row sent to the device, in fewer admit
    calls."""
    cfg = lt.LoadConfig(blocks=256, max_seqs=8, max_blocks_per_seq=48, num_tenants=4,
                        token_budget=256, max_admit=4, prefill_rows=2, chunk_size=128,
                        replicas=1)  # one scheduler: its admit calls are all of the replay's
    trace = generate_trace(TraceConfig(
        requests=60, tenants=3, groups=1, system_prompt_tokens=32, rate_per_s=400.0,
        prompt_mean=96, prompt_max=256, output_mean=24, output_max=64, followup_mean=24,
        session_fraction=0.4, turns_mean=3, think_time_mean_s=0.05, context_max=700,
        quota_cuts=3, cut_to=0.05, lease_expiries=0))
    real_sure, real_admit = QuotaView.sure_refusals, kq.Allocator.admit

    def run(policy, view):
        calls, found = [], []

        def admit(self, *args, **kwargs):
            calls.append(1)
            return real_admit(self, *args, **kwargs)

        def sure(self, rows):
            out = real_sure(self, rows) if view else {}
            found.append(len(out))
            return out

        monkeypatch.setattr(kq.Allocator, "admit", admit)
        monkeypatch.setattr(QuotaView, "sure_refusals", sure)
        rp = lt.Replay(cfg, trace, policy, ex=lt.executor(cfg))
        rp.run()
        steps = [{k: v for k, v in p.items() if k != "wall_s"} for p in rp.samples]
        return (steps, rp.request_records(), rp.sched.summary()["refusals"]), len(calls), \
            sum(found)

    (with_view, calls, found), (without, all_calls, _) = run(policy, True), run(policy, False)
    assert found > 0 and with_view[2]  # refusals happened and the view found some
    assert with_view == without
    assert calls < all_calls


def test_a_request_that_can_never_fit_is_still_refused_for_good(monkeypatch):
    """A request larger than its tenant's whole quota goes to the device once; its retries
    while the tenant's other request runs are refused on the host; once the tenant holds
    nothing the refusal is found hopeless (no event to come) and final."""
    ex = CostModelExecutor(CONFIG, prefill_rows=2, chunk_size=16)
    s = Scheduler(ex, token_budget=64, max_admit=4, drift_every=1, check_every=1)
    s.register_tenant(0, token_quota=10**6, byte_quota=6 * BLOCK)
    running = s.submit(Request(0, [7] * 9, 4))
    s.step()
    big = s.submit(Request(0, [8] * 30, 2))  # 8 blocks > the whole quota of 6
    tries = []
    real = kq.Allocator.admit
    monkeypatch.setattr(kq.Allocator, "admit", lambda self, *a, **k: tries.append(s.t) or
                        real(self, *a, **k))
    s.run()
    assert running.status == "finished" and big.status == "refused"
    assert big.finish == "over byte quota" and big.refusals["over byte quota"] >= 2
    assert len(tries) == 1  # its first try; every retry was refused on the host


def test_parking_waits_for_what_can_make_room():
    """A quota park ends on a quota op or reclaim, a free of the tenant's own sequences, or a
    request among its heads, not on another tenant's free; a pool park on anyone's free."""
    park = Parking()
    seq_tenant = np.asarray([0, 0, 1, 2])  # slot -> tenant (the host mirror)
    park.refused(0, REFUSED_BYTE_QUOTA)
    park.refused(1, REFUSED_POOL_FULL)
    park.refused(2, REFUSED_TOKEN_QUOTA)
    park.refused(2, REFUSED_POOL_FULL)  # the pool outweighs: tenant 2 waits on anyone
    assert park.tenants() == {0, 1, 2}
    park.op("free", (np.asarray([2], np.int32),), seq_tenant)  # tenant 1 frees a sequence
    assert park.tenants() == {0}
    park.op("set_idle", (np.asarray([0], np.int32),), seq_tenant)  # keeps its KV: no room
    park.arrived(0, among_heads=False)  # behind a backlog: the heads are the same
    assert park.tenants() == {0}
    park.op("preempt", (np.asarray([1], np.int32),), seq_tenant)  # its own: room
    assert park.tenants() == set()
    for release in (lambda: park.arrived(0, among_heads=True),
                    lambda: park.op("apply_plan", (None,), seq_tenant),
                    lambda: park.op("set_quota", (0,), seq_tenant)):
        park.refused(0, REFUSED_GROWING)
        release()
        assert park.tenants() == set()


def test_a_tenant_over_quota_leaves_the_admission_rows_to_the_others():
    """Tenant 0 is over its byte quota with four older requests queued; when tenant 1's
    request finishes and frees its blocks, tenant 1's next request is admitted at once, not
    after tenant 0's refused heads have taken the step's four admission rows again. Tenant 0's
    requests are admitted once its own running request has finished."""
    ex = CostModelExecutor(CONFIG, prefill_rows=2, chunk_size=16)
    s = Scheduler(ex, token_budget=64, max_admit=4, drift_every=1, check_every=1)
    s.register_tenant(0, token_quota=10**6, byte_quota=6 * BLOCK)
    s.register_tenant(1, token_quota=10**6, byte_quota=20 * BLOCK)
    hog = s.submit(Request(0, [1] * 16, 8))  # 4 blocks, 6 with its output
    short = s.submit(Request(1, [5] * 4, 2))
    s.step()
    waiting = [s.submit(Request(0, [10 + i] * 9, 2)) for i in range(4)]  # 3 blocks each
    while short.status != "finished":
        s.step()
        assert all(r.status == "queued" for r in waiting)
    late = s.submit(Request(1, [6] * 4, 2))
    freed_at = s.t
    s.step()  # frees short (tenant 1's blocks), then admits
    assert late.admitted_step == freed_at and hog.status == "running"
    assert all(r.status == "queued" and r.refusals == {"over byte quota": 1} for r in waiting)
    s.run()
    assert all(r.status == "finished" and r.finish == "length" for r in [hog, short, late, *waiting])
    assert min(r.admitted_step for r in waiting) > hog.finished_step
    ALLOC.check(s.state)


def test_a_request_preempted_for_its_tenants_quota_waits_for_one_of_its_tenants_frees():
    """Two requests of tenant 0 outgrow its 5-block quota: the younger is preempted, and it is
    not re-admitted into the room its preemption made, where the next block boundary preempted
    it again (three times, retried at every free of its tenant's), but once the older one has
    finished: one preemption, one refusal."""
    ex = CostModelExecutor(CONFIG, prefill_rows=2, chunk_size=16)
    s = Scheduler(ex, token_budget=64, max_admit=4, drift_every=1, check_every=1)
    s.register_tenant(0, token_quota=10**6, byte_quota=5 * BLOCK)
    older = s.submit(Request(0, [1] * 4, 8))  # 1 block, 3 with its output
    s.step()
    younger = s.submit(Request(0, [2] * 6, 8))  # 2 blocks, 4 with its output
    while not younger.preemptions:
        s.step()
    while older.status != "finished":
        assert younger.status == "queued"
        s.step()
    s.run()
    assert older.finish == younger.finish == "length" and younger.preemptions == 1
    assert s.summary()["refusals"] == {"over byte quota": 1}
    ALLOC.check(s.state)


def _swapped(parked: bool):
    """Tenant 0's two requests are both suspended to host by a cut to 4 blocks at step 3; the
    older is restored at once, the younger's restore is over quota until the older finishes.
    Returns the requests, the summary and the steps at which a restore was tried."""
    ex = CostModelExecutor(HOSTED, prefill_rows=2, chunk_size=16)
    s = Scheduler(ex, token_budget=64, max_admit=4, policy="swap-all", drift_every=1,
                  check_every=1, events=[Event(3, "quota_cut", 0, byte_quota=4 * BLOCK)])
    for t in range(2):
        s.register_tenant(t, token_quota=10**6, byte_quota=20 * BLOCK)
    reqs = [s.submit(Request(0, [1] * 8, 6)), s.submit(Request(0, [2] * 8, 6)),
            s.submit(Request(1, [3] * 8, 12))]
    tries, restore = [], s.alloc.restore
    s.alloc.restore = lambda *a, **k: tries.append(s.t) or restore(*a, **k)
    if not parked:  # the rule before: the oldest suspended request is retried at every step
        s.waiting.unrestored.refused = lambda *a: None
    summary = s.run()
    kq.Allocator(HOSTED).check(s.state)
    return reqs, summary, tries


def test_a_restore_refused_over_quota_waits_for_its_tenants_free():
    """A suspended request refused a restore is tried again when its tenant frees (or a quota
    changes), not at every step: the same run, in fewer restore calls."""
    (older, younger, other), summary, tries = _swapped(parked=True)
    assert older.suspensions == younger.suspensions == 1 and other.suspensions == 0
    assert tries == [3, 3, older.finished_step + 1]  # the older's free makes the room
    assert younger.status == "finished" and younger.finish == "length"
    reqs, ref, ref_tries = _swapped(parked=False)
    assert len(ref_tries) > len(tries)
    fields = ("tokens", "finish", "finished_step", "first_token_s", "paid_resume_bytes", "suspensions")
    assert [[getattr(r, f) for f in fields] for r in (older, younger, other)] == \
        [[getattr(r, f) for f in fields] for r in reqs]
    drop = ("decode_steps", "syncs_per_decode_step")  # steps with no facade call: more
    assert {k: v for k, v in summary.items() if k not in drop} == \
        {k: v for k, v in ref.items() if k not in drop}
