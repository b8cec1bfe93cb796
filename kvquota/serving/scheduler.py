"""A multi-tenant serving scheduler: continuous batching over the functional state, with reclaim
events while requests decode (DESIGN.md §1.6, §2 "Life of a request"). Each `step()` (1) frees
last step's finished sequences (a session's turn goes IDLE, KV kept); (2) runs this step's events:
a quota cut / lease expiry is plan_reclaim -> apply_plan, whose fates reach the requests
(suspended ones are restored from host once room is back, preempted ones go to the front of their
tenant's queue and are re-admitted, prefix-cache hits first, the rest recomputed by chunked
prefill); a new tenant registers (and may make room), a burst submits requests (and may change
quotas: a top-up); (3) admits queued requests (per-tenant FIFO, resumes first) in one facade
call; (4) runs one executor step (one jitted call and one readback, checked against the host
mirror): running requests decode a token, prefilling ones get chunks under the token budget;
(5) records the step (serving.metrics). With `steps_per_pass` K > 1 (the cost model only) a
`step()` is a pass of K steps in one call (multi-step scheduling: `serving.passes`). Appends
refused for quota (pool) preempt the tenant's (anyone's) newest running requests until they
would fit, as vLLM does (`serving.preemption`); a request alone and still refused ends with
the reason. Every request ends finished (`finish` says why), refused (with the reason), or is
still queued. Facade calls donate the state.
"""

from __future__ import annotations

import collections
import time
from itertools import islice
from typing import Optional, Sequence

import jax
import numpy as np

from kvquota.allocator import Allocator
from kvquota.codes import (FATE_COMPRESSED, FATE_EVICTED, FATE_PREEMPTED, FATE_RELEASED,
                           FATE_SUSPENDED, INT32_MAX, OK, REASONS, REFUSED_BYTE_QUOTA,
                           REFUSED_POOL_FULL, SEQ_IDLE, SEQ_PREEMPTED, SEQ_RUNNING,
                           SEQ_SUSPENDED)
from kvquota.errors import (InvalidArgumentError, KVQuotaError, PoolFullError,
                            QuotaExceededError)
from kvquota.reclaim.plan import get_reclaim_policy
from kvquota.sentinel import INVALID
from kvquota.serving import metrics
from kvquota.serving.executors import HostMirror
from kvquota.serving.intake import Intake
from kvquota.serving.metrics import Event, Request
from kvquota.serving.passes import PassSteps
from kvquota.serving.planning import compose_step
from kvquota.serving.preemption import Geometry
from kvquota.serving.quota_view import QUOTA_REFUSALS, Parking, QuotaView, admit_batch

INF = float("inf")


class Scheduler(Intake, PassSteps):
    """Continuous batching of many tenants' requests over one state (see the module docstring).

    Args: executor: a ModelExecutor or CostModelExecutor (its state_config is the state's);
    state: the state to serve (default: a fresh one; the scheduler owns it); policy: the default
    reclaim policy (a kvquota.reclaim preset name or ReclaimPolicy); token_budget: tokens per
    step, one per decode row and the rest for prefill chunks; max_admit: rows per admit call;
    steps_per_pass: steps per scheduling pass (> 1: the cost model only); events: Events, run
    at their steps; drift_every / check_every: every n steps (0: never) measure the ledger
    drift / run check_invariants (O(pool) host work); on_step / on_event: callables receiving
    each step / event record.
    """

    def __init__(self, executor, *, state=None, policy="tiered", token_budget: int = 256,
                 max_admit: int = 4, steps_per_pass: int = 1, events: Sequence[Event] = (),
                 drift_every: int = 0, check_every: int = 0, on_step=None, on_event=None):
        self.executor, self.config = executor, executor.state_config
        self.alloc = Allocator(self.config)
        self.state = self.alloc.init() if state is None else state
        self.policy = get_reclaim_policy(policy)
        if min(token_budget, max_admit) < 1 or min(drift_every, check_every) < 0:
            raise InvalidArgumentError("token_budget and max_admit must be >= 1, drift_every and "
                                       "check_every >= 0")
        self.steps_per_pass = self._steps_per_pass(executor, steps_per_pass)
        if not all(isinstance(e, Event) for e in events):
            raise InvalidArgumentError("events must be kvquota.serving.Event objects")
        self.token_budget, self.max_admit = int(token_budget), int(max_admit)
        self.drift_every, self.check_every = int(drift_every), int(check_every)
        self.on_step, self.on_event = on_step, on_event
        self.events = sorted(events, key=lambda e: e.step)
        self.t = self.syncs = self._ev = self._stamp = self.drift_max = self.facade_calls = 0
        self.requests, self.pending, self.live, self.sessions = [], [], [], []
        self.queues = collections.defaultdict(collections.deque)
        self.by_seq, self.idle_of, self.tenants = {}, {}, {}
        self.parked, self.unrestored = Parking(), Parking()  # refused: admissions, restores
        self.counters, self.event_log, self.records = metrics.Counters(), [], []
        self._release, self._dirty, self._progress, self._host_bytes = [], False, False, 0
        # The clock (seconds): each step's executor seconds (measured, or modelled by the cost
        # model) move it on; requests with arrival_s arrive when it passes them, and an idle
        # scheduler jumps to the next arrival (or to `wake_s`: the caller's next appointment).
        self.clock, self.wake_s, self._due = 0.0, INF, (INT32_MAX, INF)
        self.m = HostMirror(self.state, self.config if executor.cost_model else None)
        self.quota = QuotaView(self.config)
        self._geometry = Geometry.of(self.config)  # of the refused appends' victims

    # ---- the step ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:  # nothing pending, queued, live, to free, or to happen
        return not (self.pending or self.live or self._release or self._ev < len(self.events)
                    or any(self.queues.values()))

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
            if not (self._progress or self.pending or self._ev < len(self.events)):
                break  # stalled: nothing ran, arrives or happens any more
        bar.close()
        self._free_finished()
        return self.summary()

    def step(self, max_steps: Optional[int] = None) -> dict:
        """One step, or a pass of up to steps_per_pass (at most max_steps) steps; returns the
        last step's record (`records` holds them all)."""
        marks = (time.perf_counter(), self.syncs, self.executor.syncs, self.facade_calls)
        self._host_bytes, self._progress = 0, bool(self._release)
        self._free_finished()
        if not (self.live or self._release or any(self.queues.values())) and \
                self._due[0] > self.t and self.clock < min(self._due[1], self.wake_s) < INF:
            self.clock = min(self._due[1], self.wake_s)  # idle until something arrives
        # An event waits for in-flight prefills (admissions held meanwhile): a reclaim must not
        # compress, evict or drop (into the prefix cache) blocks whose K/V are not written yet.
        due = self._ev < len(self.events) and self.events[self._ev].step <= self.t
        hold, kinds = due and any(r.status == "prefill" for r in self.live), []
        while not hold and self._ev < len(self.events) and self.events[self._ev].step <= self.t:
            self._ev += 1
            kinds.append(self._event(self.events[self._ev - 1]))
        self._arrivals()
        self._restore_suspended()
        if not hold:
            self._admit()
        rec = self._pass(max_steps, kinds, marks) if self.steps_per_pass > 1 else None
        if rec is not None:
            return rec
        batch, dec, pre = compose_step(self.executor, self.live, self.token_budget, self.m,
                                       self._host_bytes)
        out, self._dirty = None, False
        if batch is not None:
            self.state, out = self.executor.step(self.state, batch)
            self.clock += out.seconds
            self._progress = True
            self.quota.stepped(out.charged, out.used_tokens)
            self._absorb(out, dec, pre)
        charged = out.charged if out is not None and not self._dirty else self._read(
            self.state.tenants.charged_blocks)
        return self._record(out, dec, pre, charged, kinds, marks)

    def _record(self, out, dec, pre, charged, kinds, marks) -> dict:
        rec = metrics.record_step(self, out, dec, pre, charged, kinds, marks)
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
        for parking in (self.parked, self.unrestored):
            parking.op(name, args, self.m.tenant)
        self.state, report = getattr(self.alloc, name)(self.state, *args, donate=True, **kwargs)
        return report

    def _read(self, tree):
        self.syncs += 1
        return jax.device_get(tree)

    def _free_finished(self):
        """Free last step's finished sequences; a session's turn goes IDLE and its next turn
        is submitted (it arrives `gap` steps later)."""
        done, self._release = self._release, []
        idle = [r for r in done if r.session is not None and not r.session.ended
                and r.turn + 1 < len(r.session.turns)]
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
                self._turn(s, k, r.prompt + r.tokens + list(s.turns[k]), self.t + s.gap,
                           None if s.arrival_s is None else
                           self.clock + (s.think_s[k] if k < len(s.think_s) else 0.0))
            except KVQuotaError:  # the conversation outgrew the table or the context
                s.ended = True
        for r in done:
            self.by_seq.pop(r.seq, None)
            r.seq = INVALID

    # ---- events ------------------------------------------------------------------------------
    def _event(self, ev: Event):
        self._progress = True
        self.unrestored.clear()  # `_hopeless` reads the events to come
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
            self._fates(report, ev)
        for r in ev.requests:
            r.arrival = self.t
            self.submit(r)
        rec["ledger_after"] = metrics.ledger_table(self.alloc.ledger(self.state))
        self.event_log.append(rec)
        if self.on_event is not None:
            self.on_event(rec)
        return ev.kind

    def _fates(self, report, ev: Event):
        """Apply a reclaim's fates to the requests and sessions whose sequences it touched."""
        self.syncs += 1
        self.m.refresh(self.state)
        archives = {a.seq: a.token_ids for a in report.archives}
        for f in report.fates:
            r, s = self.by_seq.get(f.seq), self.idle_of.get(f.seq)
            if r is not None and f.fate == FATE_PREEMPTED:
                self._requeue(r, archives[f.seq])
                r.planned_resume_tokens += f.resume_tokens
                self.counters.add("planned_resume_tokens", f.resume_tokens)
            elif r is not None and f.fate == FATE_SUSPENDED:
                r.was, r.status, r.suspensions = r.status, "suspended", r.suspensions + 1
                r.planned_resume_bytes += f.resume_bytes
                self.counters.add("suspensions")
                self.counters.add("planned_resume_bytes", f.resume_bytes)
            elif r is not None and f.fate == FATE_RELEASED:
                self.live.remove(r)
                self.by_seq.pop(f.seq)
                r.seq, r.status, r.finish, r.finished_step = (INVALID, "finished",
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
            while self.queues[ev.tenant]:
                self._refuse(self.queues[ev.tenant].popleft(), "lease expired")
            for s in self.sessions:
                s.ended = s.ended or s.tenant == ev.tenant

    def _requeue(self, r: Request, archived):
        """A preempted request: its archive must be what the scheduler sent to the cache; it
        goes to the front of its tenant's queue, to be re-admitted with prompt + tokens."""
        metrics.check_archive(r, archived)
        self.live.remove(r)
        self.by_seq.pop(r.seq)
        r.seq, r.status, r.prefilled, r.resuming = INVALID, "queued", 0, True
        r.context, r.preemptions = r.prompt + r.tokens, r.preemptions + 1
        self.counters.add("preemptions")
        self.queues[r.tenant].appendleft(r)

    def _preempt(self, reqs):
        """Preempt running requests (the scheduler's choice: an append ran out of room)."""
        seqs = np.asarray([r.seq for r in reqs], np.int32)
        report, self.syncs = self._op("preempt", seqs), self.syncs + 1
        archived = {seq: tok for seq, _, tok, _ in report.archives()}
        for r in sorted(reqs, key=lambda q: -q.admitted):  # the oldest ends up in front
            self._requeue(r, archived[r.seq])
        self._op("rebalance", seq_ids=seqs)
        self.m.set(seqs)
        self._dirty = True

    # ---- admission ---------------------------------------------------------------------------
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
        r.paid_resume_bytes, self._host_bytes = r.paid_resume_bytes + moved, self._host_bytes + moved
        self.counters.add("paid_resume_bytes", moved)
        self.m.status[seq], self._progress = SEQ_IDLE if idle else SEQ_RUNNING, True
        self.m.restored(seq)
        return True

    def _restore_suspended(self):
        """Restore suspended requests (if the host mirror has any), oldest first. One refused
        is parked (`Parking`) until a free, a quota change or an event: else refused again."""
        if self.unrestored.tenants() or not (self.m.status == SEQ_SUSPENDED).any():
            return
        for r in [q for q in self.live if q.status == "suspended"]:
            got = self._restore(r.seq, r)
            if got is True:
                r.status = r.was
            elif self._hopeless(r, got == REFUSED_BYTE_QUOTA):
                if r.session is not None:  # its KV never comes back: no next turn on it
                    r.session.ended = True
                self._finish(r, f"suspended: {REASONS[got]}, never restorable")
            else:
                self.unrestored.refused(r.tenant, got)
                break  # FIFO: nothing overtakes the oldest suspended request

    def _hopeless(self, r: Request, mine: bool) -> bool:
        """Could nothing ever make room for r? No event to come that might, and nothing on the
        device (of r's tenant, when `mine`) that will be freed."""
        if any(e.tenant == r.tenant or e.kind in ("quota_cut", "lease_expiry")
               for e in self.events[self._ev:]):
            return False
        return not any(o is not r and getattr(o, "status", "") != "suspended" and
                       (not mine or o.tenant == r.tenant)
                       for o in (*self.live, *self.idle_of.values()))

    def _admit(self):
        """One admit call for up to max_admit queued requests: per-tenant FIFO (resumes and a
        session's next turn, whose KV is held, at the front), tenants interleaved by (those
        first, arrival, id). A tenant refused is parked until something may make room for it
        (`quota_view.Parking`). Rows the device would surely refuse for quota are refused
        without it (`quota_view`)."""
        heads = sorted((r for q in self.queues.values() for r in islice(q, self.max_admit)),
                       key=lambda r: (not (r.resuming or r.turn), r.arrival, r.id))
        rows, blocked = [], self.parked.tenants()
        prefilling = [o for o in self.live if o.status == "prefill"]
        for r in heads:
            if len(rows) == self.max_admit or r.tenant in blocked:
                continue
            g = self.tenants[r.tenant]["group"]  # same salt: same tenant or share group
            if metrics.hits_unwritten(self.config.block_size, r.context, [
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
        for r, (reason, q, cached) in zip(rows, admit_batch(self, rows)):
            if r.session is not None and r.session.idle_seq != INVALID:
                idle.append(r.session)  # its IDLE turn goes: hits taken, or making way
            if reason != OK:
                self._admit_refused(r, reason)
                continue
            n, self._progress = len(r.context), True
            self.queues[r.tenant].remove(r)
            r.seq, r.status, r.base = q, "prefill", len(r.tokens)
            r.prefilled = r.cached_tokens = cached
            r.admitted, self._stamp = self._stamp, self._stamp + 1
            r.admitted_step = self.t if r.admitted_step < 0 else r.admitted_step
            if r.resuming:
                r.resuming, r.paid_resume_tokens = False, r.paid_resume_tokens + n - r.prefilled
                self.counters.add("paid_resume_tokens", n - r.prefilled)
            self.m.set([q], length=n, status=SEQ_RUNNING, tenant=r.tenant)
            self.by_seq[q] = r
            self.live.append(r)
        self._free_idle(idle)  # with keep_cold_blocks their full blocks stay cached

    def _admit_refused(self, r: Request, reason: int):
        """Count the refusal; the request waits, unless nothing could ever make room for it."""
        name = REASONS[reason]
        self.counters.refused(reason)
        r.refusals[name] = r.refusals.get(name, 0) + 1
        r.first_refused = self.t if r.first_refused < 0 else r.first_refused
        self.parked.refused(r.tenant, reason)
        self._progress = True  # the next step tries the tenants not parked
        # (quota refusals wait on the tenant's own holdings, pool or slots on anyone's; a
        # session's own IDLE turn counts: it is freed to make way first)
        if self._hopeless(r, reason in QUOTA_REFUSALS):
            self.queues[r.tenant].remove(r)
            self.parked.release(r.tenant)  # its next request may fit
            self._refuse(r, name)

    # ---- the executor step -------------------------------------------------------------------
    def _absorb(self, out, dec, pre):
        rows, m, appended = len(dec), self.m, out.appended[: len(dec)]
        seqs = np.fromiter((r.seq for r in dec), np.int64, rows)  # unique slots
        grown = seqs[appended]
        m.length[grown], m.position[grown] = m.length[grown] + 1, m.position[grown] + 1
        tokens, reasons, refused = out.dec_next[:rows].tolist(), out.reason[:rows].tolist(), []
        c, clock = self.config, self.clock  # a row whose table or context is now full ends
        at_end = ((m.length[seqs] >= c.max_tokens_per_seq)
                  | (m.position[seqs] >= c.model.max_context)).tolist()
        for r, ok, token, reason, end in zip(dec, appended.tolist(), tokens, reasons, at_end):
            if not ok:
                refused.append((r, reason))
                continue
            got = r.tokens  # `_took`, inlined: this loop runs for every decode row
            if not got:
                r.first_token_s = clock
            got.append(token)
            if end or len(got) >= r.max_new_tokens or token in r.stop_ids:
                self._finish(r, self._why(r, token))
        self.counters.add("generated_tokens", len(grown))
        for j, (r, n) in enumerate(pre):
            self._prefilled(r, n, int(out.pre_next[j]))
        self._refused_appends(refused)

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

    def _finish(self, r: Request, why: str):
        r.status, r.finish, r.finished_step, r.finish_s = "finished", why, self.t, self.clock
        self.counters.add("finished")
        self.live.remove(r)
        self._release.append(r)

    # ---- records -----------------------------------------------------------------------------
    def summary(self) -> dict:
        return metrics.run_summary(self.requests, self.records, self.counters, steps=self.t,
                                   drift_max=self.drift_max, events=len(self.event_log))
