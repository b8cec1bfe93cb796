"""Every request the serving scheduler holds that holds no KV yet, in one `WaitQueue`: the pending
ones (submitted, their arrival not reached: single requests, and sessions' next turns, submitted
when the turn before finished), the per-tenant FIFO queues of the arrived and the preempted, the
tenants an admission skips until something may make room for them (`Parking`), and a client's
cancellation of a waiting request (vLLM's `abort_request`, for requests that hold no KV).

The queue decides nothing about KV: the `Scheduler` asks it for the admission candidates
(`heads`), admits some, and tells it what happened (`admitted`, `give_up`, `requeue`, and each
facade call through `op`, which may unpark tenants).
"""

from __future__ import annotations

import collections
from itertools import islice

import numpy as np

from kvquota.codes import INT32_MAX
from kvquota.serving.quota_view import QUOTA_OPS, QUOTA_REFUSALS
from kvquota.serving.requests import Request, RequestStatus, Session

FREEING_OPS = ("free", "preempt")  # ops that free sequences (args[0]: their slots)


class Parking:
    """The tenants whose queued requests an admission skips, each until something may make room.

    * Refused over a quota (tokens, bytes, growing): until a quota change or a reclaim
      (`QUOTA_OPS`), a free or preemption of one of its own sequences, or a new request among
      its queue heads. Nothing else lowers its use. (A prefix that another tenant of its group
      writes meanwhile can lower a row's need, since a hit on a held block is not charged; the
      next of those retries finds it.) Retrying at anyone's free instead lets a cut tenant's
      refused backlog, the oldest heads, fill most of each admission's rows at every step,
      ahead of the other tenants' newer requests.
    * Refused for the pool or the sequence slots: until anyone's free.
    * An append refused: parked the same way, after the preemption that made room for the
      tenant's running requests. That room is for them to grow into; a request re-admitted into
      it would be preempted again at the next block boundary. (vLLM's v0 scheduler likewise
      swaps nothing in at a step that preempted.)

    The `WaitQueue` holds two: `parked` for admissions, `unrestored` for the oldest suspended
    request's refused restore (only the same ops can make its room, and any event ends that
    park: what is hopeless depends on the events to come).
    """

    def __init__(self):
        self.on_quota = {}  # tenant -> parked on its own quota (False: on the pool or slots)

    def tenants(self) -> set:
        return set(self.on_quota)

    def refused(self, tenant: int, reason: int):
        """A row of `tenant` was refused for `reason` (a pool refusal outweighs a quota one)."""
        self.on_quota[tenant] = self.on_quota.get(tenant, True) and reason in QUOTA_REFUSALS

    def release(self, tenant: int):
        self.on_quota.pop(tenant, None)

    def clear(self):
        self.on_quota.clear()

    def arrived(self, tenant: int, among_heads: bool):
        """A request of `tenant` was queued; among the heads an admission tries, it may fit."""
        if among_heads:
            self.release(tenant)

    def op(self, name: str, args, seq_tenant):
        """A facade call `name(state, *args)` ran; seq_tenant: each slot's tenant (the host
        mirror's, before the call)."""
        if name in QUOTA_OPS:
            self.clear()
        elif name in FREEING_OPS:
            freed = set(np.asarray(seq_tenant)[np.asarray(args[0], np.int64)].tolist())
            self.on_quota = {t: q for t, q in self.on_quota.items() if q and t not in freed}


class WaitQueue:
    """The requests that wait without KV, and whom an admission skips (module docstring).

    Fields: max_admit: the rows of one admission (an admission looks at that many heads of each
    tenant's queue); pending: submitted requests whose arrival (a step, or arrival_s on the
    clock) has not come; due_step / due_s: the earliest arrival step / arrival_s among them
    (INT32_MAX / inf: none), so a step with nothing due skips the scan; queues: tenant -> deque
    of its arrived or preempted requests, in admission order (a created entry stays, empty:
    the step records list every tenant ever queued for); parked / unrestored: `Parking` for
    admissions / for the oldest suspended request's restore; sessions: every submitted session
    (a lease expiry ends its tenant's).
    """

    def __init__(self, max_admit: int):
        self.max_admit = max_admit
        self.pending: list[Request] = []
        self.due_step, self.due_s = INT32_MAX, float("inf")
        self.queues = collections.defaultdict(collections.deque)
        self.parked, self.unrestored = Parking(), Parking()
        self.sessions: list[Session] = []

    # ---- pending: submitted, not arrived ------------------------------------------------------
    def add(self, r: Request):
        """A submitted request waits for its arrival (a step, or arrival_s on the clock)."""
        self.pending.append(r)
        if r.arrival_s is None:
            self.due_step = min(self.due_step, r.arrival)
        else:
            self.due_s = min(self.due_s, r.arrival_s)

    def add_session(self, s: Session):
        self.sessions.append(s)

    def any_due(self, t: int, clock: float) -> bool:
        """Has a pending request arrived by step t or by `clock` seconds?"""
        return bool(self.pending) and (self.due_step <= t or self.due_s <= clock)

    def take_arrived(self, t: int, clock: float) -> list[Request]:
        """The pending requests that arrived by step t / `clock` seconds, in submission order,
        out of `pending` (one scan of it, only when something is due: it holds every future
        turn)."""
        if not self.any_due(t, clock):
            return []
        arrived, waiting = [], []
        for r in self.pending:
            came = r.arrival <= t if r.arrival_s is None else r.arrival_s <= clock
            (arrived if came else waiting).append(r)
        self.pending = waiting
        self._pending_changed()
        return arrived

    def _pending_changed(self):
        self.due_step = min((r.arrival for r in self.pending if r.arrival_s is None),
                            default=INT32_MAX)
        self.due_s = min((r.arrival_s for r in self.pending if r.arrival_s is not None),
                         default=float("inf"))

    # ---- the per-tenant queues ----------------------------------------------------------------
    @property
    def queued(self) -> bool:
        """Is any request queued (arrived or preempted, not admitted)?"""
        return any(self.queues.values())

    def queue(self, r: Request):
        """An arrived request joins its tenant's queue: at the back, or at the front for a
        session's next turn, whose conversation's KV is held. Its tenant is unparked if it is
        among the heads an admission tries."""
        r.status = RequestStatus.QUEUED
        q = self.queues[r.tenant]
        self.parked.arrived(r.tenant, bool(r.turn) or len(q) < self.max_admit)
        q.appendleft(r) if r.turn else q.append(r)

    def requeue(self, r: Request):
        """A preempted request goes to the front of its tenant's queue."""
        self.queues[r.tenant].appendleft(r)

    def heads(self) -> list[Request]:
        """The admission candidates: the first max_admit of each tenant's queue, resumes and
        sessions' next turns (whose KV is held) first, then by arrival step and id."""
        return sorted((r for q in self.queues.values() for r in islice(q, self.max_admit)),
                      key=lambda r: (not (r.resuming or r.turn), r.arrival, r.id))

    def admitted(self, r: Request):
        self.queues[r.tenant].remove(r)

    def give_up(self, r: Request):
        """r leaves its queue for good (nothing could ever make room for it); the tenant's next
        request may fit, so the tenant is unparked."""
        self.queues[r.tenant].remove(r)
        self.parked.release(r.tenant)

    def drain(self, tenant: int) -> list[Request]:
        """Empty a tenant's queue (its lease expired), front first."""
        q, out = self.queues[tenant], []
        while q:
            out.append(q.popleft())
        return out

    def end_sessions_of(self, tenant: int):
        for s in self.sessions:
            s.ended = s.ended or s.tenant == tenant

    def withdraw(self, r: Request):
        """A client cancels r, pending or queued: it leaves the queue; a request that moves up
        among the heads unparks its tenant."""
        if r.status == RequestStatus.PENDING:
            self.pending.remove(r)
            self._pending_changed()
            return
        q = self.queues[r.tenant]
        at = q.index(r)
        del q[at]
        self.parked.arrived(r.tenant, at < self.max_admit <= len(q))  # a new head

    # ---- parking ------------------------------------------------------------------------------
    def op(self, name: str, args, seq_tenant):
        """A facade call ran (`Parking.op`): it may unpark tenants of either parking."""
        for parking in (self.parked, self.unrestored):
            parking.op(name, args, seq_tenant)
