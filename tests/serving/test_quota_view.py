"""Quota waits (kvquota.serving.quota_view): the device's `missing_blocks` is the least a row
needs (what an admitted row got as new blocks; a refused one is refused with one block less of
room, and admitted with room for all its blocks), and the scheduler tries a quota-refused
request again only once its tenant has that room, instead of at every step that frees anything.
"""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquota as kq
from configs.models import get_model_config
from kvquota.codes import OK, REFUSED_BYTE_QUOTA, SEQ_FREE
from kvquota.serving import CostModelExecutor, Request, Scheduler
from kvquota.serving.quota_view import QUOTA_REFUSALS

TINY = get_model_config("tiny-qwen")
CONFIG = kq.StateConfig(TINY, num_blocks=40, block_size=4, max_seqs=8, max_blocks_per_seq=12,
                        num_tenants=3, kv_format="f32", keep_cold_blocks=True, with_pages=False)
BLOCK = CONFIG.pool_bytes[0]  # bytes of a pool-0 block (the only device pool here)
ROWS, WIDTH = 6, 48
ALLOC = kq.Allocator(CONFIG)


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
    state = ALLOC.init()
    for t in range(3):
        state, _ = ALLOC.register_tenant(
            state, t, token_quota=data.draw(st.integers(1, 120)),
            byte_quota=data.draw(st.integers(0, 14)) * BLOCK)
    base = [1, 2, 3, 0] * 12
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


def test_a_quota_refused_request_waits_for_the_room_it_needs(monkeypatch):
    """Tenant 0 (room for 6 blocks) runs a long and a short request; a third needs 4 blocks and
    is refused once. The short one's finish frees 2 blocks, not enough: no admit call. The long
    one's finish frees its 4: the third is admitted at that step's admit."""
    calls = []
    real = kq.Allocator.admit

    def admit(self, state, tenants, *args, **kwargs):
        calls.append(np.asarray(tenants).tolist())
        return real(self, state, tenants, *args, **kwargs)

    monkeypatch.setattr(kq.Allocator, "admit", admit)
    ex = CostModelExecutor(CONFIG, prefill_rows=2, chunk_size=16)
    s = Scheduler(ex, token_budget=64, max_admit=4, drift_every=1, check_every=1)
    s.register_tenant(0, token_quota=10**6, byte_quota=6 * BLOCK)
    long_, short = (s.submit(Request(0, [7] * n, new)) for n, new in ((9, 6), (5, 2)))
    s.step()  # both admitted: 3 + 2 blocks (5 of 6)
    third = s.submit(Request(0, [8] * 13, 3))  # 4 blocks: 5 + 4 > 6
    steps = []
    while third.status in ("pending", "queued"):
        before = len(calls)
        s.step()
        steps.append((s.t - 1, len(calls) - before, short.status, long_.status))
    assert s.summary()["refusals"] == {"over byte quota": 1}
    tried = [t for t, n, *_ in steps if n]
    assert len(tried) == 2  # refused once, then admitted
    admitted_at = tried[-1]
    assert third.admitted_step == admitted_at
    assert any(st_ == "finished" for _, _, st_, lg in steps if lg == "running")  # short ended
    assert long_.finished_step == admitted_at - 1  # freed at the start of the admitting step
    s.run()
    assert all(r.status == "finished" for r in (long_, short, third))


def test_a_request_that_can_never_fit_is_still_refused_for_good(monkeypatch):
    """A request larger than its tenant's whole quota waits while the tenant's other request
    runs; once the tenant holds nothing it is tried again, found hopeless (no event to come)
    and refused for good, so the run ends with it refused, not queued forever."""
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
    assert big.finish == "over byte quota" and big.refusals == {"over byte quota": 2}
    assert len(tries) == 2 and tries[1] == running.finished_step + 1  # waited, then tried
