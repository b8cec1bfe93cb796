"""The serving scheduler's events (DESIGN.md §1.6): when they run, and what a reclaim's fates do
to the requests.

An `Event` (`serving.requests`) happens at a step: a quota cut or lease expiry is a reclaim
(`plan_reclaim` -> `apply_plan` under the event's policy), a new tenant registers (and may make
room: a reclaim for it), a burst submits requests (and may change quotas: a top-up). The
`EventTimeline` holds them in step order and answers what the events still to come may do (a
suspended or refused request is hopeless only when none of them can make room for it).

`request_fates` turns a reclaim's report into data: for each fate that reaches a request or an
IDLE session, what it is and what it costs (`RequestFate`); the `Scheduler` applies them (a
preempted request goes back to the front of its queue, a suspended one waits to be restored from
host, a released one ends, a compressed or evicted one goes on lossy, an IDLE session whose
sequence went recomputes its next turn or ends).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from kvquota.errors import InvalidArgumentError
from kvquota.serving.requests import Event, Request, Session

RECLAIM_KINDS = ("quota_cut", "lease_expiry")  # events that take KV back from their tenant


class EventTimeline:
    """The events of a run in step order, and the next to run.

    Fields: events: every event, sorted by step (`add` appends at the end: an event added while
    the scheduler runs is due at or after the last one); next: the index of the first event not
    run yet.
    """

    def __init__(self, events: Sequence[Event] = ()):
        if not all(isinstance(e, Event) for e in events):
            raise InvalidArgumentError("events must be kvquota.serving.Event objects")
        self.events = sorted(events, key=lambda e: e.step)
        self.next = 0

    def add(self, event: Event):
        """An event due at or after every event added so far (a trace replayed on the clock)."""
        if not isinstance(event, Event):
            raise InvalidArgumentError("events must be kvquota.serving.Event objects")
        self.events.append(event)

    @property
    def left(self) -> bool:
        """Are events still to run?"""
        return self.next < len(self.events)

    def due(self, t: int) -> bool:
        """Is the next event due at step t?"""
        return self.left and self.events[self.next].step <= t

    def pop_due(self, t: int) -> Optional[Event]:
        """The next event if it is due at step t (then it counts as run), else None. One at a
        time: running an event may read the events still to come (`registers`)."""
        if not self.due(t):
            return None
        self.next += 1
        return self.events[self.next - 1]

    def registers(self, tenant: int) -> bool:
        """Will an event to come register `tenant`?"""
        return any(e.kind == "new_tenant" and e.tenant == tenant
                   for e in self.events[self.next:])

    def may_make_room(self, tenant: int) -> bool:
        """Might an event to come make room for `tenant`: one of its own (a top-up, a new
        quota), or any reclaim (it frees someone's KV)?"""
        return any(e.tenant == tenant or e.kind in RECLAIM_KINDS
                   for e in self.events[self.next:])


@dataclasses.dataclass(frozen=True)
class RequestFate:
    """One fate of a reclaim's report that reaches the scheduler's requests.

    Fields: fate: the `kvquota.codes` FATE_* code; seq: the sequence slot; request: the request
    running (or prefilling, or suspended) on it, or None; session: the session whose IDLE turn
    holds it, or None (exactly one of the two is set); archive: a preempted sequence's archived
    token ids (None otherwise); resume_tokens / resume_bytes: what the plan says resuming it
    costs (recompute tokens / host bytes to restore).
    """

    fate: int
    seq: int
    request: Optional[Request]
    session: Optional[Session]
    archive: Optional[Sequence[int]]
    resume_tokens: int
    resume_bytes: int


def request_fates(report, by_seq: dict, idle_of: dict) -> list[RequestFate]:
    """The fates of an `apply_plan` report that reach a request (by_seq: slot -> request) or an
    IDLE session (idle_of: slot -> session), in the report's order."""
    archives = {a.seq: a.token_ids for a in report.archives}
    out = []
    for f in report.fates:
        r, s = by_seq.get(f.seq), idle_of.get(f.seq)
        if r is None and s is None:
            continue
        out.append(RequestFate(f.fate, f.seq, r, None if r is not None else s,
                               archives.get(f.seq), f.resume_tokens, f.resume_bytes))
    return out
