"""The victims of refused appends (kvquota.serving.preemption): the youngest running requests
until the refused rows would fit, not one victim per refused row; the rounds preempt the same
requests as one victim at a time with the room read after each."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquota as kq
from configs.models import get_model_config
from kvquota.codes import REFUSED_BYTE_QUOTA, REFUSED_POOL_FULL
from kvquota.sentinel import INVALID
from kvquota.serving import CostModelExecutor, Request, Scheduler
from kvquota.serving.preemption import POOL, Geometry, Room, choose_victims, shortfalls
from tests.state.common import seq_tokens

TINY = get_model_config("tiny-qwen")
CONFIG = kq.StateConfig(TINY, num_blocks=40, block_size=4, max_seqs=8, max_blocks_per_seq=12,
                        num_tenants=3, kv_format="f32", keep_cold_blocks=True, with_pages=False)
BLOCK = CONFIG.pool_bytes[0]


def _three_short_and_one_long(config, quotas):
    """Tenant 0's requests A, B, C (1-block prompts) and the youngest, D (tenant `quotas`' last:
    an 18-token prompt, 5 blocks), admitted and prefilled at step 0; at step 1 A, B and C reach
    a block boundary with no room left (8 blocks held), D does not."""
    ex = CostModelExecutor(config, prefill_rows=4, chunk_size=32)
    s = Scheduler(ex, token_budget=64, max_admit=4, drift_every=1, check_every=1)
    for t, blocks in enumerate(quotas):
        s.register_tenant(t, token_quota=10**6, byte_quota=blocks * BLOCK)
    short = [s.submit(Request(0, [10 + i] * 4, 4)) for i in range(3)]
    long = s.submit(Request(len(quotas) - 1, [20] * 18, 4))
    s.step()
    assert all(r.status == "running" and len(r.tokens) == 1 for r in [*short, long])
    return s, short, long


def _one_victim_makes_room_for_three(s, short, long, reason):
    s.step()  # A, B, C refused: D's five blocks cover them
    assert s.summary()["preemptions"] == 1 and long.status == "queued"
    assert s.summary()["refusals"] == {reason: 3}
    s.step()
    assert all(r.status == "running" and len(r.tokens) == 2 for r in short)
    s.run()
    assert all(r.status == "finished" and r.finish == "length" for r in [*short, long])
    assert [r.preemptions for r in [*short, long]] == [0, 0, 0, 1]
    kq.Allocator(s.config).check(s.state)


def test_a_preempted_request_is_requeued_with_its_prompt_and_generated_tokens():
    """The requeue's context is what the request prefills on resume: its prompt and every token
    it generated, in order (the cost model's tokens are a hash of (request, index): a resume
    from the prompt alone would re-sample them at the wrong positions). Checked on the queued
    request, then on the cache its resume prefilled."""
    s, short, long = _three_short_and_one_long(CONFIG, [8])
    prompt = [20] * 18
    s.step()  # D decodes its second token; A, B and C are refused: D is preempted
    assert long.status == "queued" and long.resuming and long.preemptions == 1
    generated = list(long.tokens)
    assert len(generated) == 2
    assert long.context == prompt + generated and len(long.context) == 20
    assert long.seq == INVALID and long.prefilled == 0
    assert s.waiting.queues[long.tenant][0] is long  # the front of its tenant's queue
    for _ in range(8):  # re-admitted once A, B and C free room
        s.step()
        if long.status != "queued":
            break
    # Admitted and prefilled in one step: the prompt's 4 full blocks went cold at the
    # preemption and hit; the other 4 context tokens are recomputed. The cache holds the
    # context exactly; the token sampled after it is pending (not in the cache yet).
    assert long.status == "running" and long.cached_tokens == 16 and long.prefilled == 20
    assert int(s.state.seqs.seq_lens[long.seq]) == 20
    assert seq_tokens(s.state, long.seq, CONFIG.block_size) == prompt + generated
    assert long.tokens[:2] == generated and len(long.tokens) == 3
    kq.Allocator(s.config).check(s.state)


def test_three_appends_refused_over_byte_quota_preempt_one_request_that_covers_them():
    """Up to release 0.14.0 each refused row took a victim (D, then C): two preemptions where
    D's room alone lets A, B and C grow."""
    s, short, long = _three_short_and_one_long(CONFIG, [8])
    _one_victim_makes_room_for_three(s, short, long, "over byte quota")


def test_three_appends_refused_for_the_pool_preempt_anyones_youngest_once():
    """The pool (8 blocks) is full; the youngest request is tenant 1's D."""
    s, short, long = _three_short_and_one_long(dataclasses.replace(CONFIG, num_blocks=8),
                                               [100, 100])
    _one_victim_makes_room_for_three(s, short, long, "pool full")


class Req:
    """A request as `choose_victims` sees it."""

    def __init__(self, tenant, seq, admitted):
        self.tenant, self.seq, self.admitted = tenant, seq, admitted


GEO = Geometry(block_size=4, unit0=2, max_unit=2)


def test_shortfalls_count_tokens_and_blocks_at_boundaries_only():
    reqs = [Req(0, 0, 0), Req(0, 1, 1), Req(1, 2, 2)]
    length = np.asarray([8, 9, 12])  # rows 0 and 2 at a boundary
    rows = [(reqs[0], REFUSED_BYTE_QUOTA), (reqs[1], REFUSED_BYTE_QUOTA),
            (reqs[2], REFUSED_POOL_FULL)]
    room = Room(token_room=np.asarray([1, 5]), unit_room=np.asarray([1, 5]), pool0=0)
    assert shortfalls(rows, room, length, GEO) == {0: (1, 1), POOL: (0, 1)}
    roomy = Room(token_room=np.asarray([2, 0]), unit_room=np.asarray([2, 0]), pool0=1)
    assert shortfalls(rows, roomy, length, GEO) == {}


def test_a_group_with_one_running_request_is_alone():
    only = Req(0, 0, 0)
    other = Req(1, 1, 1)  # another tenant's: no victim for a quota refusal
    rows = [(only, REFUSED_BYTE_QUOTA)]
    victims, alone = choose_victims({0: (0, 2)}, rows, [only, other], np.asarray([4, 40]), GEO)
    assert victims == [] and alone == [only]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_rounds_preempt_what_one_victim_at_a_time_would(data):
    """One tenant's running requests, some refused at a boundary; each frees a random share of
    what it holds (at most its table's blocks). Preempting the youngest one at a time until the
    refused rows fit, and the rounds of `choose_victims` with the same frees, take the same
    victims and end with the same rows alone."""
    n = data.draw(st.integers(1, 8))
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)))
    stamps = data.draw(st.permutations(range(n)))  # admission stamps are unique
    reqs = [Req(0, i, stamps[i]) for i in range(n)]
    refused = [q for q in reqs if data.draw(st.booleans())] or reqs[:1]
    for q in refused:
        lengths[q.seq] = 4 * max(1, lengths[q.seq] // 4)  # at a block boundary
    frees = {q: data.draw(st.integers(0, -(-int(lengths[q.seq]) // 4))) for q in reqs}
    unit_room = data.draw(st.integers(-20, 2)) * GEO.unit0

    def room_after(gone):
        units = unit_room + sum(frees[q] * GEO.unit0 for q in gone)
        return Room(token_room=np.asarray([10**6]), unit_room=np.asarray([units]), pool0=0)

    def rows_of(gone, ended):
        return [(q, REFUSED_BYTE_QUOTA) for q in refused if q not in gone and q not in ended]

    # one at a time
    gone, ended = [], []
    while rows_of(gone, ended) and shortfalls(rows_of(gone, ended), room_after(gone), lengths,
                                              GEO):
        running = [q for q in reqs if q not in gone and q not in ended]
        if len(running) <= 1:
            ended.extend(running)
            continue
        gone.append(max(running, key=lambda q: q.admitted))
    # rounds
    taken, alone = [], []
    while rows_of(taken, alone):
        short = shortfalls(rows_of(taken, alone), room_after(taken), lengths, GEO)
        if not short:
            break
        running = [q for q in reqs if q not in taken and q not in alone]
        victims, lone = choose_victims(short, rows_of(taken, alone), running, lengths, GEO)
        assert victims or lone
        taken.extend(victims)
        alone.extend(lone)
    assert taken == gone and alone == ended


def test_a_step_is_a_pass_of_one_step(monkeypatch):
    """One step (steps_per_pass K = 1) and a pass of K > 1 run the same code:
    schedule() -> StepPlan, execute, update(plan, outputs). A single step's plan is a pass of
    one step (every decode row one token, one step of chunks, no pass arrays); there is no
    separate absorption of a single step."""
    from kvquota.serving import StepPlan

    calls, plans = [], []
    real_schedule, real_update = Scheduler.schedule, Scheduler.update

    def schedule(self, *args, **kwargs):
        plans.append((self.steps_per_pass, real_schedule(self, *args, **kwargs)))
        return plans[-1][1]

    def update(self, plan, outs):
        calls.append((self.steps_per_pass, len(outs)))
        return real_update(self, plan, outs)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(Scheduler, "update", update)
    runs = {}
    for k in (1, 4):
        s = Scheduler(CostModelExecutor(CONFIG, prefill_rows=2, chunk_size=8), token_budget=16,
                      max_admit=2, steps_per_pass=k, check_every=1)
        s.register_tenant(0, token_quota=10**6, byte_quota=40 * BLOCK)
        reqs = [s.submit(Request(0, [5 + i] * (6 + 3 * i), 7)) for i in range(3)]
        s.run()
        runs[k] = s, reqs
        assert all(r.status == "finished" and len(r.tokens) == 7 for r in reqs)
    one = [p for k, p in plans if k == 1]
    assert all(isinstance(p, StepPlan) for _, p in plans)
    assert len(one) == len([c for c in calls if c[0] == 1]) == runs[1][0].t  # a call per step
    assert all(p.passed is None and set(p.counts.tolist()) <= {1} and len(p.pres) <= 1
               for p in one)
    assert max(n for k, n in calls if k == 4) > 1  # a pass absorbed several steps in one update
    assert len([c for c in calls if c[0] == 4]) < runs[4][0].t
    assert not any(hasattr(Scheduler, name) for name in ("_absorb", "_run_pass", "_pass"))
