"""A multi-tenant serving scheduler: continuous batching over the functional state, with reclaim
events while requests decode (DESIGN.md §1.6, §2 "Life of a request").

A `step()` is `schedule()` -> execute -> `update(plan, outputs)`, as vLLM's scheduler does:

* `schedule()` does the host work before the device runs and returns a `StepPlan` (plain data):
  (1) it frees last step's finished sequences (a session's turn goes IDLE, KV kept, and its next
  turn is submitted); (2) runs this step's events (`serving.events`): a quota cut / lease expiry
  is plan_reclaim -> apply_plan, whose fates reach the requests (suspended ones are restored from
  host once room is back, preempted ones go to the front of their tenant's queue and are
  re-admitted, prefix-cache hits first, the rest recomputed by chunked prefill); a new tenant
  registers (and may make room), a burst submits requests (and may change quotas: a top-up);
  (3) moves the arrived requests into their tenants' queues (`serving.waiting.WaitQueue`) and
  admits queued ones (per-tenant FIFO, resumes first) in one facade call; (4) picks the rows:
  running requests decode, prefilling ones get chunks under the token budget (`planning`).
* execute runs the plan: one executor step (one jitted call and one readback, checked against
  the host mirror), or, with `steps_per_pass` K > 1 (the cost model only: multi-step
  scheduling, vLLM's `num_scheduler_steps` idea), a pass of K steps in one call.
* `update()` absorbs the outputs step by step: tokens, finishes and completed prefills at each
  step's own step and clock, then the step's record (`serving.metrics`). A single step is a pass
  of one step: the same code. In a pass of K > 1, what ends inside it (a finish, an append
  refused) is seen at its end: frees, events, admissions and preemptions wait for the next pass,
  and a row that finishes its prefill decodes from the next pass on; the point is the wall (the
  per-step host work and device calls happen once per pass).

Appends refused for quota (pool) preempt the tenant's (anyone's) youngest running requests until
they would fit, as vLLM does (`serving.preemption`); a request alone and still refused ends with
the reason. Every request ends finished (`finish` says why), refused (with the reason), or is
still queued. Facade calls donate the state.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import numpy as np

from kvquota.allocator import Allocator
from kvquota.codes import (FATE_COMPRESSED, FATE_EVICTED, FATE_PREEMPTED, FATE_RELEASED,
                           FATE_SUSPENDED, INT32_MAX, OK, REASONS, REFUSED_BYTE_QUOTA,
                           REFUSED_POOL_FULL, REFUSED_SEQ_FULL, SEQ_IDLE, SEQ_PREEMPTED,
                           SEQ_RUNNING, SEQ_SUSPENDED)
from kvquota.errors import (InvalidArgumentError, KVQuotaError, PoolFullError,
                            QuotaExceededError, UnknownTenantError)
from kvquota.reclaim.plan import get_reclaim_policy
from kvquota.sentinel import INVALID
from kvquota.serving import metrics
from kvquota.serving.events import EventTimeline, request_fates
from kvquota.serving.executors import HostMirror, StepBatch, bucket
from kvquota.serving.planning import PassBatch, compose_pass, pass_batch
from kvquota.serving.preemption import POOL, Geometry, Room, choose_victims, group_of, shortfalls
from kvquota.serving.quota_view import QUOTA_REFUSALS, QuotaView
from kvquota.serving.requests import Event, Request, RequestStatus, Session, check_request
from kvquota.serving.waiting import WaitQueue

INF = float("inf")
PENDING, QUEUED, PREFILL = RequestStatus.PENDING, RequestStatus.QUEUED, RequestStatus.PREFILL
RUNNING, SUSPENDED = RequestStatus.RUNNING, RequestStatus.SUSPENDED
FINISHED, REFUSED = RequestStatus.FINISHED, RequestStatus.REFUSED


@dataclasses.dataclass
class StepPlan:
    """What one `step()` runs, decided by `schedule()` before the device runs (plain data).

    Fields: events: the kinds of the events run at its start; batch: step 0's padded rows (None:
    no row runs, an idle step); passed: the whole pass's rows (K > 1 only, else None); dec: the
    decode requests (batch rows, in order); counts: i32[len(dec)], the tokens each may decode in
    the pass (1 each in a single step); pres: each step's prefill chunks [[(request, tokens)]];
    started: (perf_counter seconds, scheduler syncs, executor syncs, facade calls) when the step
    began, for its record.
    """

    events: list
    batch: Optional[StepBatch]
    passed: Optional[PassBatch]
    dec: list
    counts: np.ndarray
    pres: list
    started: tuple


def hits_unwritten(block_size: int, context, prefilling) -> bool:
    """Would a prompt `context` hit, in the prefix cache, a full block that one of the
    `prefilling` requests (same salt) reserved but has not prefilled yet (K/V unwritten)?
    Admission hits at most (len - 1) // P leading blocks, along the chain from block 0."""
    p = block_size
    for o in prefilling:
        n = min((len(context) - 1) // p, len(o.context) // p) * p
        m = (o.prefilled // p + 1) * p  # it hits past o's written blocks iff these m match
        if m <= n and list(context[:m]) == list(o.context[:m]):  # only m ids copied
            return True
    return False


class Scheduler:
    """Continuous batching of many tenants' requests over one state (see the module docstring).

    Args: executor: a ModelExecutor or CostModelExecutor (its state_config is the state's);
    state: the state to serve (default: a fresh one; the scheduler owns it); policy: the default
    reclaim policy (a kvquota.reclaim preset name or ReclaimPolicy); token_budget: tokens per
    step, one per decode row and the rest for prefill chunks; max_admit: rows per admit call;
    steps_per_pass: steps per scheduling pass (> 1: the cost model only); events: Events, run
    at their steps; drift_every / check_every: every n steps (0: never) measure the ledger
    drift / run check_invariants (O(pool) host work); on_step / on_event: callables receiving
    each step / event record.

    Public fields: t (steps taken), clock (seconds: each step's executor seconds, measured or
    modelled, move it on; an idle scheduler jumps to the next arrival), requests (every
    submitted request, by id), live (admitted requests holding KV: prefilling, running or
    suspended), by_seq (slot -> live request), idle_of (slot -> session whose IDLE turn holds
    it), tenants (tenant -> {"group": share group, "expired": lease expired}), waiting (the
    `WaitQueue`: pending, queued, parked), timeline (the `EventTimeline`), records / event_log
    (each step's / event's JSON-ready record), counters (`metrics.Counters`), drift_max (the
    worst drift measured), syncs / facade_calls (device reads / allocator calls made so far),
    progressed (did the last step change anything: an event, an arrival, an admission or a
    refusal, a restore, a free, a row run? A step that did not, with nothing to arrive, is a
    stall).
    """

    def __init__(self, executor, *, state=None, policy="tiered", token_budget: int = 256,
                 max_admit: int = 4, steps_per_pass: int = 1, quiet_steps: int = 0,
                 events: Sequence[Event] = (), drift_every: int = 0, check_every: int = 0,
                 on_step=None, on_event=None):
        self.executor, self.config = executor, executor.state_config
        self.alloc = Allocator(self.config)
        self.state = self.alloc.init() if state is None else state
        self.policy = get_reclaim_policy(policy)
        if min(token_budget, max_admit) < 1 or min(drift_every, check_every) < 0:
            raise InvalidArgumentError("token_budget and max_admit must be >= 1, drift_every and "
                                       "check_every >= 0")
        if not (isinstance(steps_per_pass, int) and steps_per_pass >= 1) or \
                (steps_per_pass > 1 and not executor.cost_model):
            raise InvalidArgumentError(f"steps_per_pass must be an int >= 1 (> 1 only with the "
                                       f"cost model), got {steps_per_pass!r}")
        if not (isinstance(quiet_steps, int) and quiet_steps >= 0) or \
                (quiet_steps > 0 and not executor.cost_model):
            raise InvalidArgumentError(f"quiet_steps must be an int >= 0 (> 0 only with the "
                                       f"cost model), got {quiet_steps!r}")
        self.steps_per_pass, self.quiet_steps = steps_per_pass, quiet_steps
        self.quiet_passes = 0  # passes run as quiet windows (`_quiet_window`)
        self._pool0_free = None  # pool 0's free stack after the last step (None: stale)
        self.timeline = EventTimeline(events)
        self.token_budget, self.max_admit = int(token_budget), int(max_admit)
        self.drift_every, self.check_every = int(drift_every), int(check_every)
        self.on_step, self.on_event = on_step, on_event
        self.t = self.syncs = self.drift_max = self.facade_calls = 0
        self.clock = 0.0
        self.requests, self.live = [], []
        self.by_seq, self.idle_of, self.tenants = {}, {}, {}
        self.waiting = WaitQueue(self.max_admit)
        self.counters, self.event_log, self.records = metrics.Counters(), [], []
        self.progressed = False
        self._finished = []  # requests that ended at the last step: their slots are freed next
        self._admissions = 0  # admission order stamps handed out (`Request.admitted`)
        self.host_queue = 0  # bytes waiting for the host link (offloads, restores), FIFO
        self._reclaim = [0, 0]  # HBM bytes and plans of the reclaims since the last step
        self.m = HostMirror(self.state, self.config if executor.cost_model else None)
        self.quota = QuotaView(self.config)
        self._geometry = Geometry.of(self.config)  # of the refused appends' victims

    # ---- taking requests in --------------------------------------------------------------------
    def register_tenant(self, tenant: int, *, token_quota: int, byte_quota: int,
                        share_group: Optional[int] = None, lease_expiry: int = INT32_MAX):
        report = self._op("register_tenant", tenant, token_quota=token_quota, byte_quota=byte_quota,
                          share_group=share_group, lease_expiry=lease_expiry)
        self.tenants[int(tenant)] = dict(group=share_group, expired=False)
        return report

    def submit(self, request: Request) -> Request:
        """Queue a request for its arrival step; bad input raises a typed error, nothing queued."""
        prompt = check_request(self.config, request)
        if request.tenant not in self.tenants and not self.timeline.registers(request.tenant):
            raise UnknownTenantError(f"tenant {request.tenant} is not registered (nor by an event)")
        request.id, request.status = len(self.requests), PENDING
        request.prompt, request.context = prompt, list(prompt)
        self.requests.append(request)
        self.waiting.add(request)
        return request

    def submit_session(self, session: Session) -> Session:
        """A multi-turn session: its first turn is submitted now, each next one when the turn
        before finishes (`release_finished`)."""
        if not session.turns:
            raise InvalidArgumentError("a session needs at least one turn")
        self._submit_turn(session, 0, list(session.turns[0]), session.arrival, session.arrival_s)
        self.waiting.add_session(session)
        return session

    def _submit_turn(self, s: Session, k: int, prompt, arrival: int, arrival_s=None):
        s.requests.append(self.submit(s.turn_request(k, prompt, arrival, arrival_s)))

    def add_event(self, event: Event):
        """An event to run at its step (at or after the events added so far)."""
        self.timeline.add(event)

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """A client gives up on a request that holds no KV: pending, or queued (never admitted,
        or preempted and waiting to be re-admitted). It leaves its queue, refused with
        `reason` at this clock and step (finish_s, finished_step), and its session ends: the
        sequence its previous turn left IDLE is freed. Any other request raises
        InvalidArgumentError, nothing changed (one being prefilled may not be freed before its
        K/V are written: `Allocator.free`)."""
        if not (0 <= request.id < len(self.requests) and self.requests[request.id] is request):
            raise InvalidArgumentError(f"cancel: request {request.id} is not this scheduler's")
        if request.status not in (PENDING, QUEUED):
            raise InvalidArgumentError(f"cancel: request {request.id} is {request.status}; only "
                                       "a pending or queued one (holding no KV) can be cancelled")
        self.waiting.withdraw(request)
        self._refuse(request, reason)
        request.finish_s, request.finished_step = self.clock, self.t  # when the client left
        s = request.session
        if s is not None and s.idle_seq != INVALID:
            self._free_idle([s])

    # ---- what the caller may ask ---------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Nothing pending, queued, live, to free, or to happen."""
        return not (self.waiting.pending or self.live or self._finished or self.timeline.left
                    or self.waiting.queued)

    @property
    def has_pending(self) -> bool:
        """Are submitted requests still to arrive?"""
        return bool(self.waiting.pending)

    @property
    def next_arrival_s(self) -> float:
        """The earliest arrival_s (on the clock) of the requests still to arrive (inf: none)."""
        return self.waiting.due_s

    def advance_clock(self, to_s: float):
        """Nothing runs until `to_s` (the caller's next appointment): the clock moves on to it
        (never back)."""
        self.clock = max(self.clock, to_s)

    # ---- the step ------------------------------------------------------------------------------
    def run(self, max_steps: Optional[int] = None, progress: bool = False) -> dict:
        """Step until every request is done, nothing can change any more, or max_steps; a tqdm
        progress bar on stderr with `progress`. Returns the summary."""
        from tqdm import tqdm

        bar = tqdm(total=max_steps, disable=not progress, unit="step", leave=False)
        while not self.done and (max_steps is None or self.t < max_steps):
            rec = self.step(None if max_steps is None else max_steps - self.t)
            bar.update(1)
            bar.set_postfix(running=rec["running"], queued=sum(rec["queue"].values()),
                            preempted=rec["preemptions_total"], refresh=False)
            if not (self.progressed or self.waiting.pending or self.timeline.left):
                break  # stalled: nothing ran, arrives or happens any more
        bar.close()
        self.release_finished()
        return self.summary()

    def step(self, max_steps: Optional[int] = None, *, wake_s: float = INF) -> dict:
        """One step, or a pass of up to steps_per_pass (at most max_steps) steps: `schedule`,
        execute, `update`. wake_s: the caller's next appointment on the clock (an idle
        scheduler jumps to it or to the next arrival, whichever comes first). Returns the last
        step's record (`records` holds them all)."""
        plan = self.schedule(max_steps, wake_s)
        return self.update(plan, self._execute(plan))

    def schedule(self, max_steps: Optional[int] = None, wake_s: float = INF) -> StepPlan:
        """The host work before the device runs (module docstring, (1)-(4)) -> its StepPlan."""
        started = (time.perf_counter(), self.syncs, self.executor.syncs, self.facade_calls)
        self.progressed = bool(self._finished)
        self.release_finished()
        w = self.waiting
        if not (self.live or w.queued) and w.due_step > self.t and \
                self.clock < min(w.due_s, wake_s) < INF:
            self.clock = min(w.due_s, wake_s)  # idle until something arrives
        # An event waits for in-flight prefills (admissions held meanwhile): a reclaim must not
        # compress, evict or drop (into the prefix cache) blocks whose K/V are not written yet.
        hold = self.timeline.due(self.t) and any(r.status == PREFILL for r in self.live)
        kinds = []
        while not hold and (ev := self.timeline.pop_due(self.t)) is not None:
            kinds.append(self._run_event(ev))
        self._arrivals()
        self._restore_suspended()
        if not hold:
            self._admit()
        k = self.steps_per_pass
        limit = min(k, max(1, max_steps or k))
        quiet = self._quiet_window(hold, limit, max_steps, wake_s)
        limit = max(limit, quiet)
        # the host link moves at most its share of the pass's steps (charged to step 0)
        moved = min(self.host_queue, limit * getattr(self.executor, "host_step_bytes", INF))
        batch, dec, counts, pres = compose_pass(self.executor, self.live, self.token_budget,
                                                self.m, int(moved), limit)
        if batch is not None:  # the step runs: it carries the reclaim work and host transfers
            self.host_queue -= int(moved)
            batch.hbm_bytes, batch.plans = self._reclaim
            self._reclaim = [0, 0]
        passed = None
        if batch is not None and (k > 1 or quiet):
            self.quiet_passes += bool(quiet)
            steps = bucket(quiet, self.quiet_steps, floor=min(16, self.quiet_steps)) if quiet \
                else k
            passed = pass_batch(batch, counts, pres, self.m, steps)
        return StepPlan(kinds, batch, passed, dec, counts, pres, started)

    def _quiet_window(self, hold: bool, limit: int, max_steps, wake_s: float) -> int:
        """Steps (> limit) that this pass may run as one scan because none of them could do
        anything but decode the running rows (exact quiet-step skipping), else 0. Quiet means:
        no prefill, no stop ids, no decode row left out (max_batch), no admission possible (every
        queued head's tenant parked), no restore possible (none suspended, or its restore
        parked), the host link idle after step 0, no event, no arrival (the scheduler's
        pending requests, and `wake_s`: the caller's) before the last step starts, no row
        ending before the last step (a free at step j < last would unpark), and room for every
        append of the window under each tenant's token and byte quota and in pool 0 (no
        refusal). Then each step between would have scheduled nothing new, so the window's
        step and request records are those of its steps run one at a time (tested). The clock
        bound is an upper one: every step of the window is priced at its last step's KV
        read."""
        ex, w, c, tl = self.executor, self.waiting, self.config, self.timeline
        event_step = tl.events[tl.next].step if tl.left else INT32_MAX
        q = min(self.quiet_steps, max_steps or self.quiet_steps, w.due_step - self.t,
                event_step - self.t)
        if q <= limit or hold or self.host_queue > getattr(ex, "host_step_bytes", INF):
            return 0
        parked = w.parked.tenants()
        if any(r.tenant not in parked for r in w.heads()):
            return 0
        if not w.unrestored.tenants() and (self.m.status == SEQ_SUSPENDED).any():
            return 0
        dec = [r for r in self.live if r.status != SUSPENDED]
        if not dec or len(dec) > ex.max_batch or \
                any(r.status != RUNNING or r.stop_ids for r in dec):
            return 0
        seqs = np.fromiter((r.seq for r in dec), np.int64, len(dec))
        length = self.m.length[seqs].astype(np.int64)
        left = np.minimum(np.minimum(c.max_tokens_per_seq - length,
                                     c.model.max_context - self.m.position[seqs]),
                          [r.max_new_tokens - len(r.tokens) for r in dec])
        q = min(q, int(left.min()))
        tokens, units, reads = self.quota.room(self.state)
        self.syncs += reads
        tenants = np.fromiter((r.tenant for r in dec), np.int64, len(dec))
        rows_per_tenant = np.bincount(tenants, minlength=len(tokens))
        other = self.m.pools[seqs, 1:]  # entries outside pool 0 (read at their pools' bytes)
        other_reads, other_rows = other.sum(axis=0), other.sum(axis=1)
        p, horizon, pool0 = c.block_size, min(wake_s, w.due_s), None
        extra = ex.reclaim_seconds(self._reclaim[0], self._reclaim[1], self.host_queue)
        while q > limit:
            entries = -(-(length + q) // p)  # each row's table entries after the window
            blocks = entries - (-(-length // p))  # pool-0 blocks the window takes
            need_units = np.bincount(tenants, blocks, minlength=len(units)) * self._geometry.unit0
            slowest = ex.modelled_seconds([int((entries - other_rows).sum()), *other_reads], 0,
                                          0, len(dec))
            if (rows_per_tenant * q <= tokens).all() and (need_units <= units).all() and \
                    self.clock + extra + (q - 1) * slowest < horizon:
                # pool 0: its free stack after the last step, else (stale, or the cold blocks
                # are needed) one read of its allocatable blocks
                need = int(blocks.sum())
                if self._pool0_free is not None and need <= self._pool0_free:
                    return q
                if pool0 is None:
                    pool0, self.syncs = int(self.alloc.allocatable_blocks(self.state)[0]), \
                        self.syncs + 1
                if need <= pool0:
                    return q
            q //= 2
        return 0

    def _execute(self, plan: StepPlan) -> list:
        """Run the plan on the executor (donates the state) -> one StepOutput per step with
        rows ([] for an idle step)."""
        if plan.batch is None:
            return []
        if plan.passed is None:
            self.state, out = self.executor.step(self.state, plan.batch)
            return [out]
        self.state, outs = self.executor.run_pass(self.state, plan.passed)
        return outs

    def update(self, plan: StepPlan, outs: list) -> dict:
        """Absorb the executed plan step by step: each step's tokens, finishes and completed
        prefills at its own step and clock, then its record; the appends refused are handled at
        the end (in the last step), where preemption may make room. Returns the last record."""
        if not outs:  # an idle step: nothing ran
            charged = self._read(self.state.tenants.charged_blocks)
            return self._record(None, [], [], charged, plan.events, plan.started)
        self.progressed, m, dec, counts = True, self.m, plan.dec, plan.counts
        self._pool0_free = int(outs[-1].free_blocks[0])
        self.quota.stepped(outs[-1].charged, outs[-1].used_tokens)
        nd, t0 = len(dec), self.t
        clocks = np.cumsum([self.clock] + [o.seconds for o in outs])[1:]  # as steps one by one
        appended = np.stack([o.appended[:nd] for o in outs])  # [steps, rows]
        got = appended.sum(axis=0)
        seqs = np.fromiter((r.seq for r in dec), np.int64, nd)
        m.length[seqs] += got
        m.position[seqs] += got
        sampled = np.stack([o.dec_next[:nd] for o in outs], axis=1).tolist()
        ends, refused = [[] for _ in outs], []
        for i, (r, n, a) in enumerate(zip(dec, counts.tolist(), got.tolist())):
            r.tokens.extend(sampled[i][:a])
            if a < n:  # refused at step a
                refused.append((r, int(outs[a].reason[i])))
            elif why := self._why(r, sampled[i][a - 1]):
                ends[a - 1].append((r, why))
        rows, last, started = np.arange(nd), len(outs) - 1, plan.started
        for j, out in enumerate(outs):
            self.t, self.clock = t0 + j, float(clocks[j])
            for r, why in ends[j]:
                self._finish(r, why)
            self.counters.add("generated_tokens", int(appended[j].sum()))
            for i, (r, n) in enumerate(plan.pres[j]):
                self._prefilled(r, n, int(out.pre_next[i]))
            decoding = [dec[i] for i in rows[(counts > j) & (got >= j)]]
            charged = out.charged
            if j == last and self._refused_appends(refused):
                charged = self._read(self.state.tenants.charged_blocks)  # preempted: stale
            b = plan.batch
            reclaim_s = self.executor.reclaim_seconds(b.hbm_bytes, b.plans, b.host_bytes) \
                if j == 0 and self.executor.cost_model else 0.0
            rec = self._record(out, decoding, plan.pres[j], charged,
                               plan.events if j == 0 else [], started, reclaim_s)
            started = (time.perf_counter(), self.syncs, self.executor.syncs, self.facade_calls)
        return rec

    def _record(self, out, dec, pre, charged, kinds, started, reclaim_s: float = 0.0) -> dict:
        """Record step t (its ledger drift and invariants checked when due), then move to t+1.
        reclaim_s: of its modelled seconds, the reclaim work it carried (cost model)."""
        start, syncs0, exec0, calls0 = started
        drift = None
        if self.drift_every and self.t % self.drift_every == 0:
            drift = metrics.ledger_drift(self.config, self.state)
            self.drift_max = max(self.drift_max, drift["bytes"], drift["tokens"])
        if self.check_every and self.t % self.check_every == 0:
            self.alloc.check(self.state)
        rec = metrics.record_step(
            self.config, step=self.t, kinds=kinds, out=out, dec=dec, pre=pre, charged=charged,
            queues=self.waiting.queues, live=self.live, idle_sessions=len(self.idle_of),
            counters=self.counters, step_syncs=self.executor.syncs - exec0,
            host_syncs=self.syncs - syncs0, facade_calls=self.facade_calls - calls0,
            drift=drift, clock_s=self.clock, wall_s=time.perf_counter() - start)
        rec["reclaim_s"], rec["host_queue_bytes"] = reclaim_s, self.host_queue
        self.counters.new_step()  # what happens before the next step (a cancel) counts in it
        self.records.append(rec)
        if self.on_step is not None:
            self.on_step(rec)
        self.t += 1
        return rec

    def _op(self, name: str, *args, **kwargs):
        """One facade call on the state, donated; returns its report (counted per step)."""
        self.facade_calls += 1
        self.quota.changed(name)
        self._pool0_free = None
        self.waiting.op(name, args, self.m.tenant)
        self.state, report = getattr(self.alloc, name)(self.state, *args, donate=True, **kwargs)
        return report

    def _read(self, tree):
        self.syncs += 1
        return jax.device_get(tree)

    # ---- letting requests go -------------------------------------------------------------------
    def release_finished(self):
        """Free the sequences of the requests that finished at the last step; a session's turn
        goes IDLE instead and its next turn is submitted (it arrives `gap` steps, or think_s
        seconds, later). `step` does it first; call it once more after the last step."""
        done, self._finished = self._finished, []
        idle = [r for r in done if self._next_turn_comes(r)]
        free = [r.seq for r in done if r not in idle]
        if free:
            self._op("free", np.asarray(free, np.int32))
            self.m.set(free)
        if idle:
            self._op("set_idle", np.asarray([r.seq for r in idle], np.int32))
        for r in idle:
            s = r.session
            s.idle_seq, self.m.status[r.seq], self.idle_of[r.seq] = r.seq, SEQ_IDLE, s
            try:
                k = r.turn + 1
                self._submit_turn(s, k, r.prompt + r.tokens + list(s.turns[k]), self.t + s.gap,
                                  s.turn_arrival_s(k, self.clock))
            except KVQuotaError:  # the conversation outgrew the table or the context
                s.ended = True
        for r in done:
            self.by_seq.pop(r.seq, None)
            r.seq = INVALID

    def _next_turn_comes(self, r: Request) -> bool:
        """Whether finished `r`'s session sends another turn; one that would arrive after the
        session's `end_s` ends it instead."""
        s = r.session
        if s is None or s.ended or r.turn + 1 >= len(s.turns):
            return False
        at = s.turn_arrival_s(r.turn + 1, self.clock)
        if at is not None and s.end_s is not None and at > s.end_s:
            s.ended = True
            return False
        return True

    def _free_idle(self, sessions):
        """Free the sequences these sessions' previous turns left IDLE (the next turn took its
        prefix hits, or will never come)."""
        seqs = [s.idle_seq for s in sessions]
        if seqs:
            self._op("free", np.asarray(seqs, np.int32))
            self.m.set(seqs)
        for s in sessions:
            self.idle_of.pop(s.idle_seq)
            s.idle_seq = INVALID

    def _refuse(self, r: Request, reason: str):
        r.status, r.finish = REFUSED, reason
        self.counters.refused_named(reason)
        if r.session is not None:
            r.session.ended = True

    def _finish(self, r: Request, why: str):
        r.status, r.finish, r.finished_step, r.finish_s = FINISHED, why, self.t, self.clock
        self.counters.add("finished")
        self.live.remove(r)
        self._finished.append(r)

    # ---- events --------------------------------------------------------------------------------
    def _run_event(self, ev: Event) -> str:
        """Run one event (module docstring, (2)); its record goes to event_log. Returns its
        kind."""
        self.progressed = True
        self.waiting.unrestored.clear()  # `_hopeless` reads the events to come
        rec = {"step": self.t, "scheduled": ev.step, "kind": ev.kind, "tenant": ev.tenant,
               "seq_requests": {str(q): r.id for q, r in self.by_seq.items()},
               "ledger_before": metrics.ledger_table(self.alloc.ledger(self.state))}
        if ev.kind == "new_tenant":
            self.register_tenant(ev.tenant, token_quota=ev.token_quota or INT32_MAX,
                                 byte_quota=ev.byte_quota or 0, share_group=ev.share_group)
        elif ev.kind == "burst" and (ev.byte_quota is not None or ev.token_quota is not None):
            self._op("set_quota", ev.tenant, byte_quota=ev.byte_quota,
                     token_quota=ev.token_quota)
        request = ev.reclaim_request()
        if request is not None:
            policy = self.policy if ev.policy is None else get_reclaim_policy(ev.policy)
            plan = self.alloc.plan_reclaim(self.state, request, policy, now=self.t)
            report = self._op("apply_plan", plan)
            rec.update(plan=plan.summary(), plan_text=str(plan), report=report.summary())
            if self.executor.cost_model:  # what the reclaim costs the device (`reclaim_work`)
                host, hbm = self.executor.reclaim_work(report)
                self.host_queue += host
                self._reclaim = [self._reclaim[0] + hbm, self._reclaim[1] + 1]
                rec["work"] = {"host_bytes": host, "hbm_bytes": hbm, "plans": 1}
            self._apply_fates(report, ev)
        for r in ev.requests:
            r.arrival = self.t
            self.submit(r)
        rec["ledger_after"] = metrics.ledger_table(self.alloc.ledger(self.state))
        self.event_log.append(rec)
        if self.on_event is not None:
            self.on_event(rec)
        return ev.kind

    def _apply_fates(self, report, ev: Event):
        """Apply a reclaim's fates (`events.request_fates`) to the requests and sessions whose
        sequences it touched; recycle the slots it preempted; a lease expiry refuses its
        tenant's queue and ends its sessions."""
        self.syncs += 1
        self.m.refresh(self.state)
        for f in request_fates(report, self.by_seq, self.idle_of):
            r, s = f.request, f.session
            if r is not None and f.fate == FATE_PREEMPTED:
                self._requeue(r, f.archive)
                r.planned_resume_tokens += f.resume_tokens
                self.counters.add("planned_resume_tokens", f.resume_tokens)
            elif r is not None and f.fate == FATE_SUSPENDED:
                r.was, r.status, r.suspensions = r.status, SUSPENDED, r.suspensions + 1
                r.planned_resume_bytes += f.resume_bytes
                self.counters.add("suspensions")
                self.counters.add("planned_resume_bytes", f.resume_bytes)
            elif r is not None and f.fate == FATE_RELEASED:
                self.live.remove(r)
                self.by_seq.pop(f.seq)
                r.seq, r.status, r.finish, r.finished_step = (INVALID, FINISHED,
                                                              f"released: {ev.kind}", self.t)
                r.finish_s = self.clock
            elif r is not None and f.fate in (FATE_COMPRESSED, FATE_EVICTED):
                r.lossy = True
            elif s is not None and f.fate in (FATE_PREEMPTED, FATE_RELEASED):
                s.idle_seq, s.ended = INVALID, s.ended or f.fate == FATE_RELEASED
                self.idle_of.pop(f.seq)  # the next turn recomputes (or the session ended)
        left = np.flatnonzero(self.m.status == SEQ_PREEMPTED).astype(np.int32)
        if len(left):  # slots the plan did not recycle (a policy without rebalance)
            self._op("rebalance", seq_ids=left)
            self.m.set(left)
        if ev.kind == "lease_expiry":
            self.tenants[ev.tenant]["expired"] = True
            for r in self.waiting.drain(ev.tenant):
                self._refuse(r, "lease expired")
            self.waiting.end_sessions_of(ev.tenant)

    def _requeue(self, r: Request, archived):
        """A preempted request: its archive must be what the scheduler sent to the cache; it
        goes to the front of its tenant's queue, to be re-admitted with prompt + tokens."""
        r.check_archive(archived)
        self.live.remove(r)
        self.by_seq.pop(r.seq)
        r.seq, r.status, r.prefilled, r.resuming = INVALID, QUEUED, 0, True
        r.context, r.preemptions = r.prompt + r.tokens, r.preemptions + 1
        self.counters.add("preemptions")
        self.waiting.requeue(r)

    def _hopeless(self, r: Request, mine: bool) -> bool:
        """Could nothing ever make room for r? No event to come that might, and nothing on the
        device (of r's tenant, when `mine`) that will be freed."""
        if self.timeline.may_make_room(r.tenant):
            return False
        return not any(o is not r and getattr(o, "status", "") != SUSPENDED and
                       (not mine or o.tenant == r.tenant)
                       for o in (*self.live, *self.idle_of.values()))

    # ---- arrivals, restores, admission ---------------------------------------------------------
    def _arrivals(self):
        """The requests that arrived join their tenants' queues (or are refused: their tenant
        is unknown or its lease expired)."""
        for r in self.waiting.take_arrived(self.t, self.clock):
            info = self.tenants.get(r.tenant)
            if info is None or info["expired"]:
                self._refuse(r, "lease expired" if info else "unknown tenant")
            else:
                self.progressed = True
                self.waiting.queue(r)

    def _restore(self, seq: int, r: Request, idle: bool = False):
        """Bring a suspended sequence back from host (an IDLE one stays IDLE) if pool 0 and
        the quota have room: True, else what is short (REFUSED_POOL_FULL / _BYTE_QUOTA)."""
        try:
            rep = self._op("restore", np.asarray([seq], np.int32))
        except (PoolFullError, QuotaExceededError) as e:
            return REFUSED_POOL_FULL if isinstance(e, PoolFullError) else REFUSED_BYTE_QUOTA
        if idle:
            self._op("set_idle", np.asarray([seq], np.int32))
        moved = int(self._read(rep.moved_blocks).sum()) * self.config.pool_bytes[0]
        r.paid_resume_bytes += moved
        self.host_queue += moved
        self.counters.add("paid_resume_bytes", moved)
        self.m.status[seq], self.progressed = SEQ_IDLE if idle else SEQ_RUNNING, True
        self.m.restored(seq)
        return True

    def _restore_suspended(self):
        """Restore suspended requests (if the host mirror has any), oldest first. One refused
        is parked (`waiting.unrestored`) until a free, a quota change or an event: else refused
        again at every step."""
        if self.waiting.unrestored.tenants() or not (self.m.status == SEQ_SUSPENDED).any():
            return
        for r in [q for q in self.live if q.status == SUSPENDED]:
            got = self._restore(r.seq, r)
            if got is True:
                r.status = r.was
            elif self._hopeless(r, got == REFUSED_BYTE_QUOTA):
                if r.session is not None:  # its KV never comes back: no next turn on it
                    r.session.ended = True
                self._finish(r, f"suspended: {REASONS[got]}, never restorable")
            else:
                self.waiting.unrestored.refused(r.tenant, got)
                break  # FIFO: nothing overtakes the oldest suspended request

    def _admit(self):
        """One admit call for up to max_admit queued requests (`WaitQueue.heads`: per-tenant
        FIFO, resumes and a session's next turn first). A tenant refused is parked until
        something may make room for it (`waiting.Parking`); a request that would hit a block
        another request has not written yet waits (its tenant is skipped this step). Rows the
        device would surely refuse for quota are refused without it (`quota_view`)."""
        rows, blocked = [], self.waiting.parked.tenants()
        prefilling = [o for o in self.live if o.status == PREFILL]
        for r in self.waiting.heads():
            if len(rows) == self.max_admit or r.tenant in blocked:
                continue
            g = self.tenants[r.tenant]["group"]  # same salt: same tenant or share group
            if hits_unwritten(self.config.block_size, r.context, [
                    o for o in prefilling if o.tenant == r.tenant or (
                        g is not None and self.tenants[o.tenant]["group"] == g)]):
                blocked.add(r.tenant)
                self.counters.add("deferred")
                continue
            s = r.session  # a suspended IDLE turn comes back from host, so the turn hits it
            if s is not None and s.idle_seq != INVALID and \
                    self.m.status[s.idle_seq] == SEQ_SUSPENDED:
                self._restore(s.idle_seq, r, idle=True)
            rows.append(r)
        if not rows:
            return
        idle = []
        for r, (reason, q, cached) in zip(rows, self._admission_call(rows)):
            if r.session is not None and r.session.idle_seq != INVALID:
                idle.append(r.session)  # its IDLE turn goes: hits taken, or making way
            if reason != OK:
                self._admit_refused(r, reason)
                continue
            n, self.progressed = len(r.context), True
            self.waiting.admitted(r)
            r.seq, r.status, r.base = q, PREFILL, len(r.tokens)
            r.prefilled = r.cached_tokens = cached
            r.admitted, self._admissions = self._admissions, self._admissions + 1
            r.admitted_step = self.t if r.admitted_step < 0 else r.admitted_step
            if r.resuming:
                r.resuming, r.paid_resume_tokens = False, r.paid_resume_tokens + n - r.prefilled
                self.counters.add("paid_resume_tokens", n - r.prefilled)
            self.m.set([q], length=n, status=SEQ_RUNNING, tenant=r.tenant)
            self.by_seq[q] = r
            self.live.append(r)
        self._free_idle(idle)  # with keep_cold_blocks their full blocks stay cached

    def _admission_call(self, rows) -> list:
        """(reason, sequence slot, cached tokens) for each admission row, in order: the sure
        refusals from the quota view without a device call, the rest from one admit call
        (padded to 4..max_admit rows and a power of two of tokens), its report read back. A
        row the device refused leaves its missing blocks for its next try; an admitted one
        drops them (a preempted request comes back with another context)."""
        view = self.quota
        self.syncs += view.read(self.state)
        sure = view.sure_refusals(rows)
        at = [i for i in range(len(rows)) if i not in sure]  # the call's rows
        out = {i: (reason, INVALID, 0) for i, reason in sure.items()}
        if at:
            b = bucket(len(at), self.max_admit, floor=4)
            ten, lens = np.full(b, INVALID, np.int32), np.zeros(b, np.int32)
            tok = np.zeros((b, bucket(max(len(rows[i].context) for i in at),
                                      self.config.max_tokens_per_seq)), np.int32)
            for j, i in enumerate(at):
                r = rows[i]
                ten[j], lens[j], tok[j, : len(r.context)] = r.tenant, len(r.context), \
                    r.context_ids()
            rep = self._read(self._op("admit", ten, tok, lens))
            for j, i in enumerate(at):
                out[i] = (int(rep.reason[j]), int(rep.seq_id[j]), int(rep.cached_tokens[j]))
                if rep.admitted[j]:
                    view.least.pop(rows[i], None)
                else:
                    view.least[rows[i]] = int(rep.missing_blocks[j])
        return [out[i] for i in range(len(rows))]

    def _admit_refused(self, r: Request, reason: int):
        """Count the refusal; the request waits, unless nothing could ever make room for it."""
        name = REASONS[reason]
        self.counters.refused(reason)
        r.refusals[name] = r.refusals.get(name, 0) + 1
        r.first_refused = self.t if r.first_refused < 0 else r.first_refused
        self.waiting.parked.refused(r.tenant, reason)
        self.progressed = True  # the next step tries the tenants not parked
        # (quota refusals wait on the tenant's own holdings, pool or slots on anyone's; a
        # session's own IDLE turn counts: it is freed to make way first)
        if self._hopeless(r, reason in QUOTA_REFUSALS):
            self.waiting.give_up(r)
            self._refuse(r, name)

    # ---- absorbing a step's rows ---------------------------------------------------------------
    def _prefilled(self, r: Request, n: int, token: int):
        """A chunk of n tokens of r's context was prefilled; the last one samples `token`."""
        r.prefilled += n
        self.counters.add("prefill_tokens", n)
        if r.prefilled == len(r.context):
            r.status = RUNNING
            if r.pin_blocks and not r.preemptions and not r.turn:  # pinned once, written
                self._op("pin_prefix", r.seq, r.pin_blocks)
            self._took(r, token)
            self.counters.add("generated_tokens")

    def _took(self, r: Request, token: int):
        """r sampled `token` (the caller counts the generated tokens); it may end here."""
        if not r.tokens:
            r.first_token_s = self.clock
        r.tokens.append(token)
        if why := self._why(r, token):
            self._finish(r, why)

    def _why(self, r: Request, token: int) -> str:  # why r ends after `token` ("": it goes on)
        return ("stop" if token in r.stop_ids else "length" if len(r.tokens) >= r.max_new_tokens
                else "table full" if self.m.length[r.seq] >= self.config.max_tokens_per_seq
                else "context" if self.m.position[r.seq] >= self.config.model.max_context else "")

    # ---- appends refused: preemption -----------------------------------------------------------
    def _refused_appends(self, refused) -> bool:
        """Appends refused ([(request, reason)]): a full table ends its request; for the rest,
        rounds of preemption until they would fit (`preemption`: the youngest running request
        of the tenant, of anyone's for the pool), then their tenants, and the victims' tenants,
        are parked: the room is for the running rows to grow. Returns whether it preempted."""
        rows, victims_of, preempted = [], set(), False  # victims_of: the victims' tenants
        for r, reason in refused:
            self.counters.refused(reason)
            if reason == REFUSED_SEQ_FULL:
                self._finish(r, "table full")
            else:
                rows.append((r, reason))
        while rows:
            short = shortfalls(rows, self._room(rows), self.m.length, self._geometry)
            if not short:
                break
            victims, alone = choose_victims(short, rows, [q for q in self.live
                                                          if q.status == RUNNING],
                                            self.m.length, self._geometry)
            for r in alone:  # nothing of its own to give up
                self._finish(r, f"append refused: {REASONS[dict(rows)[r]]}")
            if victims:
                self._preempt(victims)
                preempted = True
                victims_of.update(q.tenant for q in victims)
            elif not alone:
                break
            rows = [(r, reason) for r, reason in rows if r.status == RUNNING]
        for r, reason in refused:
            self.waiting.parked.refused(r.tenant, reason)
        for t in victims_of - {r.tenant for r, _ in refused}:  # another tenant's room, for the
            self.waiting.parked.refused(t, REFUSED_POOL_FULL)  # pool: not to be re-admitted into
        return preempted

    def _room(self, rows) -> Room:
        """The refused appends' room now: the tenants' (a device read if stale) and, only when
        a row was refused for the pool, pool 0's (one more)."""
        tokens, units, reads = self.quota.room(self.state)
        pool0 = 0
        if any(group_of(r.tenant, reason) == POOL for r, reason in rows):
            pool0, reads = int(self.alloc.allocatable_blocks(self.state)[0]), reads + 1
        self.syncs += reads
        return Room(token_room=tokens, unit_room=units, pool0=pool0)

    def _preempt(self, reqs):
        """Preempt running requests (the scheduler's choice: an append ran out of room)."""
        seqs = np.asarray([r.seq for r in reqs], np.int32)
        report, self.syncs = self._op("preempt", seqs), self.syncs + 1
        archived = {seq: tok for seq, _, tok, _ in report.archives()}
        for r in sorted(reqs, key=lambda q: -q.admitted):  # the oldest ends up in front
            self._requeue(r, archived[r.seq])
        self._op("rebalance", seq_ids=seqs)
        self.m.set(seqs)

    # ---- records -------------------------------------------------------------------------------
    def summary(self) -> dict:
        return metrics.run_summary(self.requests, self.records, self.counters, steps=self.t,
                                   drift_max=self.drift_max, events=len(self.event_log))
