"""A client's cancellation of a request that holds no KV yet (kvquota.serving.waiting): it leaves
its queue refused with the reason, its session ends and frees the sequence its previous turn
left IDLE, a tenant parked behind it may be tried again, and a request that holds KV cannot be
cancelled (typed error, nothing changed)."""

import jax
import numpy as np
import pytest

import kvquota as kq
from configs.models import get_model_config
from kvquota.codes import SEQ_FREE, SEQ_IDLE
from kvquota.errors import InvalidArgumentError
from kvquota.serving import CostModelExecutor, Request, Scheduler, Session

CONFIG = kq.StateConfig(get_model_config("tiny-qwen"), num_blocks=40, block_size=4, max_seqs=8,
                        max_blocks_per_seq=12, num_tenants=2, kv_format="f32",
                        keep_cold_blocks=False, with_pages=False)
BLOCK = CONFIG.pool_bytes[0]
ALLOC = kq.Allocator(CONFIG)


def _scheduler(byte_blocks=6, max_admit=2):
    ex = CostModelExecutor(CONFIG, prefill_rows=2, chunk_size=16)
    s = Scheduler(ex, token_budget=64, max_admit=max_admit, drift_every=1, check_every=1)
    s.register_tenant(0, token_quota=10**6, byte_quota=byte_blocks * BLOCK)
    s.register_tenant(1, token_quota=10**6, byte_quota=20 * BLOCK)
    return s


def _leaves(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(state))]


def test_a_queued_request_is_cancelled_and_its_tenant_tried_again():
    """Tenant 0 is over its quota with three requests queued behind a running one (two rows
    per admission), parked. Cancelling the second one brings the third among the heads: the
    park ends; the cancelled request is refused 'timed out' at this step and clock, never
    admitted; the others finish."""
    s = _scheduler()
    hog = s.submit(Request(0, [1] * 16, 8))  # 4 blocks, 6 with its output: the whole quota
    s.step()
    waiting = [s.submit(Request(0, [10 + i] * 9, 2)) for i in range(3)]  # 3 blocks each
    s.step()
    assert s.waiting.parked.tenants() == {0} and all(r.status == "queued" for r in waiting)
    s.cancel(waiting[1], "timed out")
    ALLOC.check(s.state)
    gone = waiting[1]
    assert (gone.status, gone.finish, gone.finished_step, gone.finish_s) == (
        "refused", "timed out", s.t, s.clock)
    assert list(s.waiting.queues[0]) == [waiting[0], waiting[2]] and s.waiting.parked.tenants() == set()
    assert s.summary()["refusals"]["timed out"] == 1
    s.run()
    ALLOC.check(s.state)
    assert all(r.finish == "length" for r in (hog, waiting[0], waiting[2]))
    assert gone.admitted_step == -1 and gone.tokens == [] and gone.seq == kq.INVALID


def test_a_cancel_behind_the_heads_leaves_the_park():
    """The request cancelled is the last of the queue: the heads stay the same, so does the
    park."""
    s = _scheduler()
    s.submit(Request(0, [1] * 16, 8))
    s.step()
    waiting = [s.submit(Request(0, [10 + i] * 9, 2)) for i in range(3)]
    s.step()
    s.cancel(waiting[2])
    assert waiting[2].finish == "cancelled" and s.waiting.parked.tenants() == {0}


def test_a_pending_session_turn_is_cancelled_and_its_idle_sequence_freed():
    """Turn 1 of a session is due 50 steps after turn 0 finished; its client gives up before:
    the session ends, no later turn is submitted, and the IDLE sequence of turn 0 is freed
    (its blocks back in the pool, the tenant charged nothing)."""
    s = _scheduler(byte_blocks=20)
    sess = s.submit_session(Session(0, [[3] * 8, [4] * 4, [5] * 4], 3, gap=50))
    while sess.idle_seq == kq.INVALID:
        s.step()
    idle, turn1 = sess.idle_seq, sess.requests[1]
    assert turn1.status == "pending" and int(s.state.seqs.seq_status[idle]) == SEQ_IDLE
    s.cancel(turn1)
    ALLOC.check(s.state)
    assert sess.ended and sess.idle_seq == kq.INVALID and idle not in s.idle_of
    assert int(s.state.seqs.seq_status[idle]) == SEQ_FREE and s.m.status[idle] == SEQ_FREE
    assert int(np.asarray(s.state.tenants.charged_blocks)[0].sum()) == 0
    assert s.waiting.pending == [] and s.done
    s.run()
    assert len(sess.requests) == 2 and turn1.status == "refused"


def test_a_request_holding_kv_is_not_cancelled():
    """Prefilling, running, finished, or another scheduler's: InvalidArgumentError, the state,
    queues and records unchanged."""
    s = _scheduler(byte_blocks=20)
    prefilling = s.submit(Request(0, [1] * 40, 4))  # 40 tokens: three 16-token chunks
    running = s.submit(Request(1, [2] * 4, 8))
    s.step()
    s.step()
    stranger = _scheduler().submit(Request(0, [1] * 4, 2))
    assert (prefilling.status, running.status) == ("prefill", "running")
    before = _leaves(s.state), {t: list(q) for t, q in s.waiting.queues.items()}, len(s.records)
    for r in (prefilling, running, stranger):
        with pytest.raises(InvalidArgumentError, match="cancel"):
            s.cancel(r)
    assert all(np.array_equal(a, b) for a, b in zip(before[0], _leaves(s.state)))
    assert ({t: list(q) for t, q in s.waiting.queues.items()}, len(s.records)) == before[1:]
    assert (prefilling.status, running.status) == ("prefill", "running")
    s.run()
    assert prefilling.finish == running.finish == "length"
    with pytest.raises(InvalidArgumentError, match="finished"):
        s.cancel(running)
    ALLOC.check(s.state)
