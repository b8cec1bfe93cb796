"""The metadata-only load test (issue #13 part 3): the cost model per device by hand, the KV
read counted from the host mirror against the block tables, a replay's clock, sessions and
drift, the jitter definition, and the figures' definitions on hand-made requests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvquota as kq
from configs.models import get_model_config
from kvquota.serving import CostModelExecutor, Request, Scheduler
from kvquota.sentinel import INVALID
from kvquota.serving import executors
from kvquota.serving.executors import pool_of, weight_count
from kvquota.sim import figures, loadtest_io
from kvquota.sim import loadtest as lt
from kvquota.sim.traces import TraceConfig, generate_trace

TINY = get_model_config("tiny-qwen")
CONFIG = kq.StateConfig(TINY, num_blocks=48, block_size=4, max_seqs=4, max_blocks_per_seq=16,
                        num_tenants=3, kv_format="f32", host_blocks=32, keep_cold_blocks=True,
                        with_pages=False)
BLOCK = CONFIG.pool_bytes[0]

# A small load: 256 blocks of Qwen2.5-72B KV, 8 decode rows, a trace that overloads it.
SMALL = lt.LoadConfig(blocks=256, max_seqs=8, max_blocks_per_seq=48, num_tenants=4,
                      token_budget=256, max_admit=4, prefill_rows=2, chunk_size=128,
                      drift_every=50, compressed_fraction=0.25, replicas=1)


def small_trace(seed=0, requests=40, **changes):
    return generate_trace(TraceConfig(**{**dict(
        seed=seed, requests=requests, tenants=3, groups=1, system_prompt_tokens=32,
        rate_per_s=200.0, prompt_mean=96, prompt_max=256, output_mean=24, output_max=64,
        followup_mean=24, followup_sigma=0.5, session_fraction=0.4, turns_mean=3,
        think_time_mean_s=0.05, context_max=700, quota_cuts=2, cut_to=0.3, lease_expiries=1),
        **changes}))


def test_cost_model_per_device_is_its_formula_by_hand():
    """TP 4: weights and KV read split 4 ways, prefill at 4 x the per-device rate, host
    bytes over 4 links (all-reduce off: zero latency, NVLink without limit). One step of 3
    decode rows and a 16-token chunk, figures by hand."""
    ex = CostModelExecutor(CONFIG, prefill_rows=3, chunk_size=16, hbm_bandwidth=1e12,
                           prefill_tokens_per_s=1e5, weight_bytes=10**6, step_overhead_s=1e-4,
                           host_bandwidth=1e9, tp=4, nvlink_bandwidth=float("inf"))
    s = Scheduler(ex, check_every=1, drift_every=1)
    s.register_tenant(0, token_quota=10**6, byte_quota=40 * BLOCK)
    for i, n in enumerate((5, 9, 13)):
        s.submit(Request(0, list(range(50 * i, 50 * i + n)), 10))
    first = s.step()  # three prefills, 27 tokens, 2 + 3 + 4 blocks read, nothing decoded
    assert first["step_s"] == pytest.approx(
        (10**6 + 9 * BLOCK) / 4 / 1e12 + 27 / (4 * 1e5) + 1e-4, rel=1e-12)
    s.submit(Request(0, list(range(150, 166)), 10, arrival=1))
    rec = s.step()
    blocks = 2 + 3 + 4 + 4  # ceil(len / 4) over each row's table after the append
    want = (10**6 + blocks * BLOCK) / 4 / 1e12 + 16 / (4 * 1e5) + 1e-4
    assert rec["step_s"] == pytest.approx(want, rel=1e-12)
    assert s.clock == pytest.approx(first["step_s"] + want, rel=1e-12)
    assert ex.modelled_seconds([0, 0], 0, 8 * 10**9) == pytest.approx(
        10**6 / 4 / 1e12 + 8e9 / (4 * 1e9) + 1e-4, rel=1e-12)
    with pytest.raises(kq.errors.InvalidArgumentError):
        CostModelExecutor(CONFIG, tp=0)


def test_all_reduce_by_hand():
    """Two ring all-reduces per layer of tokens x hidden bf16 values: latency + 2 (tp-1)/tp x
    bytes / NVLink bandwidth each; nothing at TP 1 or for an empty step."""
    m = TINY
    ex = CostModelExecutor(CONFIG, tp=4, nvlink_bandwidth=1e9, allreduce_latency_s=1e-5)
    per = 1e-5 + 2 * 3 / 4 * 10 * m.hidden_size * 2 / 1e9
    assert ex.allreduce_seconds(10) == pytest.approx(2 * m.num_layers * per, rel=1e-12)
    assert ex.allreduce_seconds(0) == 0.0
    assert CostModelExecutor(CONFIG, tp=1, allreduce_latency_s=1.0).allreduce_seconds(10) == 0


def test_a_replica_holds_what_its_hbm_holds_beside_the_weights():
    """blocks None: pool 0 + the compressed pool fill tp x usable HBM minus the weights, to
    within one block; the deployment is tp x replicas devices."""
    cfg = lt.LoadConfig(compressed_fraction=0.125, host_fraction=0.5, tp=8)
    sc = lt.state_config(cfg)
    weights = 2 * weight_count(get_model_config("qwen2.5-72b"))
    room = 8 * 141e9 * 0.9 - weights
    per_block = sc.pool_bytes[0] + 0.125 * sc.pool_bytes[1]
    assert sc.num_blocks == lt.blocks_that_fit(cfg) == int(room // per_block)
    assert lt.device_bytes(sc) <= room < lt.device_bytes(sc) + 2 * per_block
    assert lt.state_config(dataclasses.replace(cfg, blocks=4096)).num_blocks == 4096
    with pytest.raises(kq.errors.InvalidArgumentError, match="do not hold the weights"):
        lt.blocks_that_fit(dataclasses.replace(cfg, tp=1))


def test_reclaim_work_is_priced_by_hand():
    """Offload and suspend: host bytes; compress: each block read at pool 0's size and written
    at the compressed pool's; evict: the victims' scores (f32 mass per layer, KV head and token
    for StreamingLLM) plus the kept blocks copied; preempt: nothing now (its recompute is a
    prefill later)."""
    from kvquota.reclaim.plan import PlanStep
    cfg = dataclasses.replace(SMALL, compressed_fraction=0.25)
    ex = lt.executor(cfg)
    b0, b1 = ex.state_config.pool_bytes[0], ex.state_config.pool_bytes[1]
    m = ex.state_config.model

    class Report:
        class plan:
            policy = kq.RECLAIM_PRESETS["evict-first"]
        steps = (PlanStep("offload_idle", (1,), 3, host_bytes=3 * b0),
                 PlanStep("compress", (2,), 5), PlanStep("evict", (3, 4), 7),
                 PlanStep("preempt", (5,), 9))

    host, hbm = ex.reclaim_work(Report)
    kept = 2 * (-(-64 // 16))  # evict_keep_tokens = 64 per sequence, whole blocks
    score = 4 * m.num_layers * m.num_kv_heads * 16
    assert host == 3 * b0
    assert hbm == 5 * (b0 + b1) + (7 + kept) * score + 2 * kept * b0


def test_the_host_link_is_a_queue_that_spills_into_later_steps():
    """A suspension moves more bytes than one step's share of the host link: the transfer
    spills over the next steps, each carrying at most host_step_bytes, in order, until the
    queue is empty; the bytes moved add up to what the plan offloaded."""
    cfg = dataclasses.replace(SMALL, cost=lt.CostConstants(host_step_s=2e-5))
    rp = lt.Replay(cfg, small_trace(1), "swap-all")
    rp.run()
    cap = rp.ex.host_step_bytes
    queued = [r["host_queue_bytes"] for r in rp.sched.records]  # after each step
    events = [e for e in rp.sched.event_log if "work" in e]
    offloaded = sum(e["work"]["host_bytes"] for e in events)
    assert offloaded > 3 * cap  # the test means something: several steps of transfer
    assert queued[-1] == 0 and max(queued) > cap
    steps = [r for r in rp.sched.records if r["reclaim_s"] > 0]
    assert len(steps) > 3
    for r in steps:  # at most one step's share of the link, plus the plans made before it
        assert r["reclaim_s"] <= 2e-5 + len(r["events"]) * rp.ex.plan_s + 1e-12


def test_replicas_split_the_load_and_the_quotas():
    """Two replicas: each its own state and scheduler; every trace request lands on one of them
    (a session's turns on one), each tenant's quota is its share of one replica's pool, both
    replicas got work, every event reached both, drift 0 and invariants hold on each."""
    cfg = dataclasses.replace(SMALL, replicas=2)
    trace = small_trace(2, requests=60)
    rp = lt.Replay(cfg, trace, "tiered")
    reqs = rp.run()
    recs = rp.request_records()
    ids = [r["id"] for r in recs]  # a session ended early never submits its later turns
    assert len(set(ids)) == len(ids) == len(reqs) and set(ids) <= {r.id for r in trace.requests}
    assert {r.id for r in trace.requests if r.turn == 0} <= set(ids)
    assert {r["replica"] for r in recs} == {0, 1}
    session_of = {r.id: r.session for r in trace.requests}
    where = {}
    for r in recs:
        if session_of[r["id"]] >= 0:
            assert where.setdefault(session_of[r["id"]], r["replica"]) == r["replica"]
    for s in rp.scheds:
        kq.check_invariants(rp.sc, s.state)
        assert len(s.event_log) == len(trace.events)
    assert all(d["bytes"] == 0 == d["tokens"] for d in rp.drift)
    assert {d["replica"] for d in rp.drift} == {0, 1}
    t0 = trace.tenants[0]
    ledger = rp.scheds[1].alloc.ledger(rp.scheds[1].state).summary()
    if not any(e.tenant == t0.tenant for e in trace.events):
        assert ledger[t0.tenant]["byte_quota"] == lt.quotas(rp.sc, t0.quota_share)["byte_quota"]
    events = rp.event_records()
    assert len(events) == 2 * len(trace.events)
    fig = figures.reclaim_figures(events)
    assert fig["events"] == len(trace.events)
    assert fig["target_bytes"] == sum(e["target_bytes"] for e in events)
    for e in events:
        assert e["planned_bytes"] + e["shortfall_bytes"] >= e["target_bytes"]


def test_step_figures_by_hand():
    """pool0_above_80_share weights each step by its clock interval; jitter is attributed to
    the step's cause; zero-target quota cuts are counted over replicas, lease expiries never."""
    cfg = dataclasses.replace(SMALL, jitter_window=2)
    pool = 100

    def p(clock, step_s, device, prefill=0, reclaim=0.0, replica=0, events=()):
        return {"clock_s": clock, "step_s": step_s, "bytes": {"device": device},
                "decode_rows": 1, "prefill_rows": prefill, "reclaim_s": reclaim,
                "replica": replica, "events": list(events)}

    samples = [p(1.0, 1.0, 90), p(2.0, 1.0, 50), p(4.0, 2.0, 85, reclaim=0.5,
                                                       events=["quota_cut"]),
               p(5.0, 1.0, 85, prefill=1), p(2.0, 2.0, 10, replica=1)]
    got = figures.step_figures(samples, cfg, pool)
    assert got["pool0_above_80_share"] == pytest.approx((1 + 2 + 1) / (5 + 2))
    c = got["jitter_by_cause"]
    assert c["reclaim"]["steps"] == 1 and c["reclaim"]["p99_step_jitter_s"] == pytest.approx(1.0)
    assert c["prefill"]["steps"] == 1 and c["neither"]["steps"] == 1
    assert got["recovery_s_max"] == pytest.approx(2.0)  # the event's step, then 1.0 s: back
    ev = lambda order, kind, target, replica: {  # noqa: E731
        "order": order, "kind": kind, "tenant": 0, "replica": replica, "target_bytes": target,
        "planned_bytes": target, "reclaimed_bytes": target, "shortfall_bytes": 0}
    fig = figures.reclaim_figures([ev(0, "quota_cut", 0, 0), ev(0, "quota_cut", 5, 1),
                                   ev(1, "quota_cut", 0, 0), ev(1, "quota_cut", 0, 1),
                                   ev(2, "lease_expiry", 0, 0)])
    assert fig["events"] == 3 and fig["zero_target_events"] == 1 and fig["target_bytes"] == 5


def _exact_reads(config, state, batch, out):
    """The KV read of the step, from the block tables after it: every entry of each row that
    ran (appended decode rows, prefill rows), counted per pool."""
    rows = np.concatenate([np.where(out.appended, batch.dec_seq, -1), batch.pre_seq])
    host = jax.device_get(state.seqs.block_tables)
    reads = np.zeros(config.num_pools, np.int64)
    slack = 0
    lens = jax.device_get(state.seqs.seq_lens)
    for q in rows[rows >= 0]:
        ids = host[q][host[q] >= 0]
        np.add.at(reads, pool_of(config, ids, xp=np), 1)
        slack += len(ids) * config.block_size - int(lens[q])
    return reads, slack


@pytest.mark.slow  # ~20 s a policy: a replay checked against the tables at every step
@pytest.mark.parametrize("policy", [
    "swap-all", pytest.param("tiered", marks=pytest.mark.slow),
    pytest.param("evict-first", marks=pytest.mark.slow)])
def test_kv_read_from_the_mirror_is_the_tables(policy):
    """Compressions, evictions, offloads and restores move entries out of pool 0: the cost
    model's per-pool read (the host mirror's counts) equals the block tables at every step."""
    ex = lt.executor(SMALL)
    rp = lt.Replay(SMALL, small_trace(1), policy, ex=ex)
    seen = []
    step = ex.step

    def checked(state, batch):
        state, out = step(state, batch)
        seen.append((_exact_reads(ex.state_config, state, batch, out),
                     (out.block_reads.tolist(), out.slack_tokens)))
        return state, out

    ex.step = checked
    rp.run()
    assert len(seen) > 50
    for (reads, slack), (got, got_slack) in seen:
        assert got == reads.tolist() and got_slack == slack
    if policy == "swap-all":  # suspended and restored: host entries came and went
        assert rp.sched.summary()["suspensions"] > 0


@pytest.fixture(scope="module")
def replays():
    trace = small_trace()
    ex = lt.executor(SMALL)
    out = {}
    for policy in lt.POLICIES:
        rp = lt.Replay(SMALL, trace, policy, ex=ex)
        rp.run()
        out[policy] = (rp, rp.request_records())
    return trace, out


@pytest.mark.slow  # the five-policy replay fixture (~15 s): the default run's budget
def test_replay_ends_every_request_with_zero_drift(replays):
    trace, out = replays
    for policy, (rp, reqs) in out.items():
        kq.check_invariants(rp.sc, rp.sched.state)
        assert rp.drift and all(d["bytes"] == 0 and d["tokens"] == 0 for d in rp.drift)
        assert {d["why"] for d in rp.drift} >= {"event", "end"}
        assert not rp.steps_capped and rp.sched.done
        assert all(r["status"] in ("finished", "refused") for r in reqs), policy
        ids = [r["id"] for r in reqs]
        assert len(ids) == len(set(ids)) and set(ids) <= {r.id for r in trace.requests}
        for r in reqs:  # the clock: a first token after the arrival, the end after that
            if r["ttft_s"] is not None:
                assert r["ttft_s"] > 0
            if r["ttft_s"] is not None and r["status"] == "finished":
                assert r["finish_s"] >= r["arrival_s"] + r["ttft_s"]
        clock = [p["clock_s"] for p in rp.samples]
        assert clock == sorted(clock) and clock[-1] == rp.sched.clock


@pytest.mark.slow  # the five-policy replay fixture (~15 s): the default run's budget
def test_events_run_when_the_clock_passes_them(replays):
    trace, out = replays
    rp, _ = out["tiered"]
    ran = [p for p in rp.samples if p["events"]]
    kinds = [k for p in ran for k in p["events"]]
    assert sorted(kinds) == sorted(e.kind for e in trace.events)
    for p in ran:  # the step before ended past the event's time
        i = rp.samples.index(p)
        assert any(rp.samples[i - 1]["clock_s"] >= e.time_s for e in trace.events)


@pytest.mark.slow  # the five-policy replay fixture (~15 s): the default run's budget
def test_sessions_arrive_think_s_after_the_previous_turn(replays):
    trace, out = replays
    rp, reqs = out["preempt-all"]
    think = {r.id: r.think_s for r in trace.requests}
    by_id = {r["id"]: r for r in reqs}
    later = [r for r in trace.requests if r.turn > 0 and r.id in by_id]
    assert later
    for t in later:
        prev = next(q for q in trace.requests if q.session == t.session and q.turn == t.turn - 1)
        assert by_id[t.id]["arrival_s"] == pytest.approx(by_id[prev.id]["finish_s"] + think[t.id])


@pytest.mark.slow  # the five-policy replay fixture (~15 s): the default run's budget
def test_policies_differ_on_the_same_trace(replays):
    _, out = replays
    by_policy = {p: figures.summarize(rp, reqs, rp.event_records())
                 for p, (rp, reqs) in out.items()}
    assert by_policy["preempt-all"]["preemptions"] > 0
    assert by_policy["swap-all"]["suspensions"] > 0
    assert len({(f["preemptions"], f["suspensions"], f["paid_resume_tokens"],
                 f["paid_resume_bytes"]) for f in by_policy.values()}) > 2


def test_jitter_is_the_distance_from_the_recent_median():
    got = figures.jitter([1.0, 1.0, 1.0, 5.0, 1.0], window=2)
    assert got.tolist() == [0.0, 0.0, 4.0, 2.0]


def test_goodput_counts_tokens_of_requests_within_both_slos():
    cfg = dataclasses.replace(SMALL, slo_ttft_s=1.0, slo_tpot_s=0.1)
    base = dict(status="finished", finish="length", preemptions=0, suspensions=0)
    reqs = [dict(base, ttft_s=0.5, tpot_s=0.05, output_tokens=10),  # good
            dict(base, ttft_s=2.0, tpot_s=0.05, output_tokens=20),  # late first token
            dict(base, ttft_s=0.5, tpot_s=0.2, output_tokens=40),  # slow stream
            dict(base, ttft_s=0.5, tpot_s=None, output_tokens=1),  # one token: TTFT only
            dict(base, finish="released: lease_expiry", ttft_s=0.1, tpot_s=0.01,
                 output_tokens=80)]
    got = figures.latency_figures(reqs, cfg, seconds=2.0)
    assert got["good_tokens"] == 11 and got["goodput"] == 5.5
    assert got["completed"] == 4 and got["p50_ttft_s"] == 0.5


def test_compacting_ended_requests_changes_nothing(monkeypatch):
    """The replay keeps ended requests' token ids as int32 arrays (memory at 10^5 requests): the
    same records and summary as a replay that keeps the lists, and only ended ones compacted."""
    trace, ex = small_trace(requests=24), lt.executor(SMALL)
    cfg = dataclasses.replace(SMALL, drift_every=5)
    compacted = lt.Replay(cfg, trace, "tiered", ex=ex)
    compacted.run()
    arrays = [r for r in compacted.sched.requests if isinstance(r.prompt, np.ndarray)]
    assert arrays and all(lt.ended(r) for r in arrays)
    assert all(isinstance(r.tokens, np.ndarray) and r.tokens.dtype == np.int32 for r in arrays)
    monkeypatch.setattr(lt.Replay, "_compact", lambda self, k: None)
    kept = lt.Replay(cfg, trace, "tiered", ex=ex)
    kept.run()
    assert not any(isinstance(r.prompt, np.ndarray) for r in kept.sched.requests)
    assert compacted.request_records() == kept.request_records()
    assert compacted.sched.summary() == kept.sched.summary()
    for a, b in zip(compacted.sched.requests, kept.sched.requests):
        assert list(a.prompt) == list(b.prompt) and list(a.tokens) == list(b.tokens)


def test_clients_out_of_patience_cancel_what_waits_unadmitted():
    """patience_s: a request not admitted within patience_s of its arrival is refused 'timed
    out' at the first step past its deadline (counted in that step's record), never admitted,
    its session over; every request admitted was admitted before its deadline. Zero drift,
    invariants hold. A patience longer than any wait changes no step or request record."""
    trace, ex, patience = small_trace(requests=80), lt.executor(SMALL), 0.5
    runs = {}
    for p in (None, patience, 1e6):
        rp = lt.Replay(dataclasses.replace(SMALL, patience_s=p), trace, "tiered", ex=ex)
        rp.run()
        kq.check_invariants(rp.sc, rp.sched.state)
        assert all(d["bytes"] == d["tokens"] == 0 for d in rp.drift)
        runs[p] = rp, rp.request_records()
    (patient, patient_reqs), (rp, reqs) = runs[None], runs[patience]
    waits = [patient.clock_at[0][r.admitted_step] - r.arrival_s for r in patient.sched.requests
             if r.admitted_step >= 0]
    assert max(waits) > patience  # without patience some wait longer
    gone = [r for r in rp.sched.requests if r.finish == "timed out"]
    assert gone and figures.summarize(rp, reqs, [])["refused_requests"]["timed out"] == \
        len(gone)
    assert sum(p["refusals"].get("timed out", 0) for p in rp.samples) == len(gone)  # per step
    for r in gone:  # cancelled as the first step past its deadline began (clock_at: starts)
        assert r.admitted_step == -1 and len(r.tokens) == 0 and r.status == "refused"
        assert rp.clock_at[0][r.finished_step] == r.finish_s
        assert rp.clock_at[0][r.finished_step - 1] < r.arrival_s + patience <= r.finish_s
        if r.session is not None:
            assert r.session.ended and r.session.requests[-1] is r
    for r in rp.sched.requests:
        if r.admitted_step >= 0:
            assert rp.clock_at[0][r.admitted_step] < r.arrival_s + patience
    (forever, forever_reqs) = runs[1e6]
    assert _no_wall(forever.samples) == _no_wall(patient.samples)
    assert forever_reqs == patient_reqs


def test_sessions_end_with_the_trace():
    """sessions_end_with_trace: no request arrives after the trace's last first-turn arrival; a
    session ends with its last turn sent exactly when its next turn was due after it (no
    events here end sessions otherwise), its sequence freed (none stays IDLE at the end). Off,
    some turn arrives later (the flag bites). Zero drift, invariants hold, every request ends."""
    trace = small_trace(requests=80, quota_cuts=0, lease_expiries=0)
    ex = lt.executor(SMALL)
    end = max(r.arrival_s for r in trace.requests if r.arrival_s is not None)
    think = {r.id: r.think_s for r in trace.requests}
    later_turn = {(r.session, r.turn): r for r in trace.requests if r.session >= 0}
    runs = {}
    for on in (False, True):
        rp = lt.Replay(dataclasses.replace(SMALL, sessions_end_with_trace=on), trace, "tiered",
                       ex=ex)
        rp.run()
        kq.check_invariants(rp.sc, rp.sched.state)
        assert all(d["bytes"] == d["tokens"] == 0 for d in rp.drift)
        assert all(r.status in ("finished", "refused") for r in rp.sched.requests)
        assert not rp.sched.idle_of
        runs[on] = rp
    assert max(r.arrival_s for r in runs[False].sched.requests) > end
    rp = runs[True]
    assert max(r.arrival_s for r in rp.sched.requests) <= end
    stopped = 0
    for r in rp.sched.requests:
        s = r.session
        if s is None or r is not s.requests[-1] or r.status != "finished" or \
                r.turn + 1 == len(s.turns):
            continue
        due = r.finish_s + think[later_turn[int(s.name), r.turn + 1].id]
        assert s.ended == (due > end)
        stopped += s.ended
    assert stopped


def test_on_a_step_clock_patience_counts_steps():
    """A replay on a step clock (the real check's: arrivals by step) times its clients out at
    steps x step_clock, the first step past arrival + patience."""
    cfg, tick = dataclasses.replace(SMALL, patience_s=0.5), 0.02
    rp = lt.Replay(cfg, small_trace(requests=80), "tiered", ex=lt.executor(SMALL),
                   step_clock=tick)
    rp.run()
    kq.check_invariants(rp.sc, rp.sched.state)
    gone = [r for r in rp.sched.requests if r.finish == "timed out"]
    assert gone and all(r.arrival_s is None and r.admitted_step == -1 for r in gone)
    for r in gone:
        assert (r.finished_step - 1) * tick < r.arrival * tick + 0.5 <= r.finished_step * tick


def _no_wall(samples):
    return [{k: v for k, v in p.items() if k != "wall_s"} for p in samples]


def test_a_fork_before_the_first_event_replays_like_a_fresh_replay():
    """The load test replays the stretch before the trace's first event once and forks it per
    policy: the fork's steps, requests, drift checks and summary equal a fresh replay's, the
    state's invariants hold, and the replay forked from is left as it was; the last policy
    goes on with that replay itself, again as a fresh replay would."""
    trace, ex = small_trace(requests=24), lt.executor(SMALL)
    trace = dataclasses.replace(trace, events=[  # the events late: a long stretch before them
        dataclasses.replace(e, time_s=e.time_s + 1.0) for e in trace.events])
    base = lt.Replay(SMALL, trace, "tiered", ex=ex)
    assert base.run(until_first_event=True) is None
    shared = base.sched.t
    assert shared > 20 and base.sched.live and not base.sched.event_log and trace.events
    fresh = lt.Replay(SMALL, trace, "evict-first", ex=ex)
    fresh.run()
    twin = base.fork("evict-first")
    assert twin.sched.state is not base.sched.state
    twin.run()
    kq.check_invariants(twin.sc, twin.sched.state)
    assert twin.sched.event_log and twin.sched.t > shared
    assert twin.request_records() == fresh.request_records()
    assert _no_wall(twin.samples) == _no_wall(fresh.samples)
    assert twin.drift == fresh.drift and twin.sched.summary() == fresh.sched.summary()
    assert base.sched.t == shared and not base.sched.event_log and base._next[1] == 0
    kq.check_invariants(base.sc, base.sched.state)  # not donated away by the twin's steps
    with pytest.raises(kq.InvalidArgumentError, match="before its first trace event"):
        twin.fork("tiered")
    last = base.fork("evict-first", copy=False)  # the last policy goes on with the base itself
    assert last is base and last.policy == "evict-first"
    last.run()
    assert last.request_records() == fresh.request_records()
    assert _no_wall(last.samples) == _no_wall(fresh.samples) and last.drift == fresh.drift


def test_compile_totals_count_each_new_program_once():
    """The per-policy compile_s and compiled_programs come from these totals: a program new to
    the process counts once, with its time; calling it again adds nothing (jit's cache)."""
    seconds0, programs0 = loadtest_io._compile_totals()
    fn = jax.jit(lambda x: x * 3 + 1)
    fn(np.arange(7))
    seconds1, programs1 = loadtest_io._compile_totals()
    fn(np.arange(7))
    assert programs1 == programs0 + 1 and seconds1 > seconds0
    assert loadtest_io._compile_totals() == (seconds1, programs1)


# ---- scheduling passes (steps_per_pass > 1) ----------------------------------------------------

def test_a_pass_is_its_steps_run_one_call_at_a_time():
    """`_cost_pass` over K steps equals K `_cost_step` calls with the rows each step runs
    (row i at steps j < count[i] until refused; from step 1 the token step j - 1 sampled):
    every leaf of the state and every step's read-back vector, exactly. The tenant's byte
    quota runs out mid-pass, so rows are refused at a block boundary and stop there."""
    alloc = kq.Allocator(CONFIG)
    state = alloc.init()
    state, _ = alloc.register_tenant(state, 0, token_quota=10**6, byte_quota=5 * BLOCK)
    prompts = np.zeros((3, 8), np.int32)
    prompts[:] = np.arange(8) + 100 * np.arange(3)[:, None]
    state, rep = alloc.admit(state, np.zeros(3, np.int32), prompts, np.array([3, 6, 2]))
    seqs = np.asarray(rep.seq_id)  # 1 + 2 + 1 blocks held: 1 left under the quota
    k, bd, bp = 4, 4, 2
    dec_seq = np.full(bd, INVALID, np.int32)
    dec_seq[:3] = seqs
    dec_tok = np.array([7, 8, 9, 0], np.int32)
    dec_key = np.array([[5, 0], [6, 2], [7, 1], [0, 0]], np.int32)
    count = np.array([4, 3, 4, 0], np.int32)
    pools = np.zeros((bd, CONFIG.num_pools), np.int32)
    pre_seq = np.full((k, bp), INVALID, np.int32)
    pre_key = np.zeros((k, bp, 2), np.int32)
    pre_pools = np.zeros((k, bp, CONFIG.num_pools), np.int32)
    got, flats = executors._cost_pass(jax.tree.map(jnp.copy, state), dec_seq, dec_tok, dec_key,
                                   count, pools, pre_seq, pre_key, pre_pools, config=CONFIG)
    kq.check_invariants(CONFIG, got)
    want, stopped, tok = state, np.zeros(bd, bool), dec_tok
    for j in range(k):
        active = (count > j) & ~stopped
        key = dec_key + np.array([0, j], np.int32)
        want, flat = executors._cost_step(
            want, np.where(active, dec_seq, INVALID).astype(np.int32), tok, key, pre_seq[j],
            pre_key[j], np.concatenate([pools, pre_pools[j]]), config=CONFIG)
        kq.check_invariants(CONFIG, want)
        out = executors.unpack_step(CONFIG, np.asarray(flat), bd, bp, 0.0)
        assert np.array_equal(np.asarray(flats[j]), np.asarray(flat)), j
        stopped |= active & ~out.appended
        tok = out.dec_next
    # row 0 took the last block under the quota at step 1; rows 1 and 2 needed one at step 2
    assert stopped.tolist() == [False, True, True, False]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_passes_keep_the_ledger_every_token_and_every_step():
    """A replay in passes of 4 steps: the invariants hold at every step, the drift is 0 at
    every check, every request ends, each request's tokens are exactly the cost model's tokens
    for (its id, 0..n-1) (none skipped or repeated inside a pass), a record per step, each
    moving the clock by its modelled seconds (or more: idle), and the tokens generated add up."""
    cfg = dataclasses.replace(SMALL, steps_per_pass=4)
    rp = lt.Replay(cfg, small_trace(requests=30), "tiered")
    rp.sched.check_every = 1
    reqs = rp.run()
    s = rp.sched
    kq.check_invariants(rp.sc, s.state)
    assert [d["bytes"] for d in rp.drift] == [0] * len(rp.drift) and len(rp.drift) > 3
    assert all(lt.ended(r) for r in reqs)
    assert any(len(r.tokens) > 4 for r in reqs)
    vocab = rp.sc.model.vocab_size
    for r in reqs:
        keys = np.stack([np.full(len(r.tokens), r.id), np.arange(len(r.tokens))], axis=1)
        want = np.asarray(executors.fake_tokens(jnp.asarray(keys, jnp.int32), vocab))
        assert list(r.tokens) == want.tolist(), r.id
    assert [rec["step"] for rec in s.records] == list(range(s.t))
    clock = np.array([0.0] + [rec["clock_s"] for rec in s.records])
    gaps = np.diff(clock) - [rec["step_s"] for rec in s.records]  # > 0: idle, jumped ahead
    assert (gaps > -1e-12).all() and (np.abs(gaps) < 1e-12).mean() > 0.9
    assert sum(rec["generated_tokens"] for rec in s.records) == \
        s.counters.total["generated_tokens"] == sum(len(r.tokens) for r in reqs)
    assert max(rec["decode_rows"] for rec in s.records) > 1
    with pytest.raises(kq.InvalidArgumentError, match="steps_per_pass"):
        Scheduler(lt.executor(SMALL), steps_per_pass=0)


# ---- quiet-step skipping (quiet_steps > 0) -------------------------------------------------------

def _replay_lines(cfg, trace, policy):
    """A replay's step lines (without their measured wall time) in (replica, step) order, its
    request lines, and the passes it ran as quiet windows."""
    rp = lt.Replay(cfg, trace, policy)
    rp.run()
    steps = sorted(({k: v for k, v in p.items() if k != "wall_s"} for p in rp.samples),
                   key=lambda p: (p["replica"], p["step"]))
    for s in rp.scheds:
        kq.check_invariants(rp.sc, s.state)
    return steps, rp.request_records(), sum(s.quiet_passes for s in rp.scheds)


def test_quiet_windows_are_their_steps_one_at_a_time():
    """A stretch where no arrival, event, admission, restore, host transfer, finish or refusal
    can occur runs as one pass (`Scheduler._quiet_window`): the step lines and request lines
    equal those of single steps exactly (clocks included), and windows did run. Two replicas
    (the order in which they interleave may differ) under eviction (quota cuts that evict)."""
    trace = small_trace(seed=2, requests=60)
    cfg = dataclasses.replace(SMALL, replicas=2)
    single = _replay_lines(cfg, trace, "evict-first")
    quiet = _replay_lines(dataclasses.replace(cfg, quiet_steps=32), trace, "evict-first")
    assert single[2] == 0 and quiet[2] >= 10
    assert quiet[0] == single[0]
    assert quiet[1] == single[1]
    with pytest.raises(kq.InvalidArgumentError, match="quiet_steps"):
        dataclasses.replace(SMALL, quiet_steps=-1)


def test_the_program_memory_guard_drops_compiled_programs_past_its_share_of_the_limit():
    """Every `every` calls the guard counts this process's memory mappings; past its share of
    the kernel's limit it drops jax's compiled programs (they hold hundreds of mappings each),
    and not before."""
    guard = loadtest_io.ProgramMemoryGuard(every=2, share=0.5)
    if guard.limit is None:
        pytest.skip("no /proc/sys/vm/max_map_count here")
    f = jax.jit(lambda x: x + 1)
    f(jnp.ones(3))
    guard.limit = 1 << 40  # far above any process
    guard(), guard()
    assert guard.clears == 0 and f._cache_size() == 1
    guard.limit = 2  # any process maps more than one region
    guard()  # the third call: not a counting one
    assert guard.clears == 0 and f._cache_size() == 1
    guard()
    assert guard.clears == 1 and f._cache_size() == 0
