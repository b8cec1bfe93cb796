"""How the serving scheduler takes requests in and lets them go before they hold KV: submission
(checked, typed errors, nothing queued on error), multi-turn sessions, arrivals into the
per-tenant queues, refusals with a reason, and a client's cancellation of a waiting request
(vLLM's `abort_request`, for requests that hold no KV yet). A mixin of `Scheduler`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvquota.codes import INT32_MAX
from kvquota.errors import InvalidArgumentError, UnknownTenantError
from kvquota.sentinel import INVALID
from kvquota.serving.metrics import Request, Session, check_request


class Intake:
    """How a Scheduler takes tenants and requests in: registration, submit (checked, typed
    errors, nothing queued on error), sessions (turn k+1 submitted when turn k finishes),
    arrivals into the per-tenant queues (a session's next turn, whose KV is held, at the
    front), refusals with a reason, cancellation of a request still waiting."""

    def register_tenant(self, tenant: int, *, token_quota: int, byte_quota: int,
                        share_group: Optional[int] = None, lease_expiry: int = INT32_MAX):
        report = self._op("register_tenant", tenant, token_quota=token_quota, byte_quota=byte_quota,
                          share_group=share_group, lease_expiry=lease_expiry)
        self.tenants[int(tenant)] = dict(group=share_group, expired=False)
        return report

    def submit(self, request: Request) -> Request:
        """Queue a request for its arrival step; bad input raises a typed error, nothing queued."""
        prompt = check_request(self.config, request)
        if request.tenant not in set(self.tenants) | {
                e.tenant for e in self.events[self._ev:] if e.kind == "new_tenant"}:
            raise UnknownTenantError(f"tenant {request.tenant} is not registered (nor by an event)")
        request.id, request.status = len(self.requests), "pending"
        request.prompt, request.context = prompt, list(prompt)
        self.requests.append(request)
        self.pending.append(request)
        a, b = self._due
        self._due = ((min(a, request.arrival), b) if request.arrival_s is None else
                     (a, min(b, request.arrival_s)))
        return request

    def submit_session(self, session: Session) -> Session:
        if not session.turns:
            raise InvalidArgumentError("a session needs at least one turn")
        self._turn(session, 0, list(session.turns[0]), session.arrival, session.arrival_s)
        self.sessions.append(session)
        return session

    def _turn(self, s: Session, k: int, prompt, arrival: int, arrival_s=None):
        new = s.turn_new_tokens[k] if k < len(s.turn_new_tokens) else s.max_new_tokens
        s.requests.append(self.submit(Request(s.tenant, prompt, new, arrival=arrival,
                                              arrival_s=arrival_s, stop_ids=s.stop_ids,
                                              name=f"{s.name}.{k}", session=s, turn=k)))

    def _arrived(self, r: Request) -> bool:
        return r.arrival <= self.t if r.arrival_s is None else r.arrival_s <= self.clock

    def _arrivals(self):
        due = self._due  # (earliest arrival step, earliest arrival_s) of the pending requests
        if not self.pending or (due[0] > self.t and due[1] > self.clock):
            return  # nothing due: no scan of the pending list
        arrived, waiting = [], []
        for r in self.pending:  # one pass: the pending list holds every future turn
            (arrived if self._arrived(r) else waiting).append(r)
        self.pending = waiting
        self._pending_changed()
        for r in arrived:
            info = self.tenants.get(r.tenant)
            if info is None or info["expired"]:
                self._refuse(r, "lease expired" if info else "unknown tenant")
            else:
                r.status, self._progress = "queued", True
                q = self.queues[r.tenant]
                self.parked.arrived(r.tenant, bool(r.turn) or len(q) < self.max_admit)
                q.appendleft(r) if r.turn else q.append(r)  # a held conversation goes first

    def _pending_changed(self):
        """(earliest arrival step, earliest arrival_s) of the pending requests."""
        self._due = (min((r.arrival for r in self.pending if r.arrival_s is None),
                         default=INT32_MAX),
                     min((r.arrival_s for r in self.pending if r.arrival_s is not None),
                         default=float("inf")))

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """A client gives up on a request that holds no KV: pending, or queued (never admitted,
        or preempted and waiting to be re-admitted). It leaves its queue, refused with
        `reason` at this clock and step (finish_s, finished_step), and its session ends: the
        sequence its previous turn left IDLE is freed. Any other request raises
        InvalidArgumentError, nothing changed (one being prefilled may not be freed before its
        K/V are written: `Allocator.free`)."""
        if not (0 <= request.id < len(self.requests) and self.requests[request.id] is request):
            raise InvalidArgumentError(f"cancel: request {request.id} is not this scheduler's")
        if request.status not in ("pending", "queued"):
            raise InvalidArgumentError(f"cancel: request {request.id} is {request.status}; only "
                                       "a pending or queued one (holding no KV) can be cancelled")
        if request.status == "pending":
            self.pending.remove(request)
            self._pending_changed()
        else:
            q = self.queues[request.tenant]
            at = q.index(request)
            del q[at]
            self.parked.arrived(request.tenant, at < self.max_admit <= len(q))  # a new head
        self._refuse(request, reason)
        request.finish_s, request.finished_step = self.clock, self.t  # when the client left
        s = request.session
        if s is not None and s.idle_seq != INVALID:
            self._free_idle([s])

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
        r.status, r.finish = "refused", reason
        self.counters.refused_named(reason)
        if r.session is not None:
            r.session.ended = True
