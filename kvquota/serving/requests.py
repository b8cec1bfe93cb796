"""What drives the serving scheduler: a `Request` (with its `RequestStatus`), a multi-turn
`Session` and an `Event` (a quota cut, lease expiry, new tenant or burst at a step): plain
dataclasses that the scheduler fills in as requests live, and `check_request`, the typed check
of a request against the state's shapes before anything is queued.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence

import numpy as np

from kvquota.errors import (ContextTooLongError, InvalidArgumentError, InvariantError,
                            SequenceTooLongError, TokenIdError)
from kvquota.sentinel import INVALID
from kvquota.state import StateConfig

EVENT_KINDS = ("quota_cut", "lease_expiry", "new_tenant", "burst")


class RequestStatus(enum.StrEnum):
    """Where a request is in its life (`Request.status`). The values are the strings the step
    and request records have always carried (JSON lines, summaries), and a member hashes and
    compares as its value, so {"running": n} tables and string comparisons keep working. These
    are a request's states, not a sequence slot's (`kvquota.codes.SEQ_*`: the state's integer
    codes of the slot a request holds once admitted)."""

    PENDING = "pending"  # submitted, its arrival not reached yet
    QUEUED = "queued"  # arrived (or preempted), waiting in its tenant's queue for admission
    PREFILL = "prefill"  # admitted: its context is being prefilled in chunks
    RUNNING = "running"  # decoding one token per step
    SUSPENDED = "suspended"  # its KV is on host (a reclaim's fate) until restored
    FINISHED = "finished"  # ended; `Request.finish` says why
    REFUSED = "refused"  # never (again) admitted; `Request.finish` says why

    __hash__ = str.__hash__  # Enum hashes the member name; a member is used as its value


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request; the fields after `name` are the scheduler's record of its life.

    status (`RequestStatus`): pending (not arrived) -> queued -> prefill -> running -> finished,
    or refused; a reclaim may make it suspended (until restored) or queue it again (preempted).
    `context`: the tokens its next admission prefills (the prompt, or prompt + generated tokens
    on a resume); `tokens`: every token generated so far; sampling keys are (id, token index),
    so a replay draws what the first run drew.
    """

    tenant: int
    prompt: Sequence[int]  # token ids
    max_new_tokens: int  # it ends ("length") after this many generated tokens
    arrival: int = 0  # the step it arrives at (when arrival_s is None)
    stop_ids: tuple = ()  # token ids that end it ("stop")
    pin_blocks: int = 0  # pin the first blocks once prefilled (a shared system prompt)
    arrival_s: Optional[float] = None  # arrival on the scheduler's clock (seconds; None: step)
    name: str = ""  # the caller's label (the load test: the trace's request id)
    id: int = -1  # its index in the scheduler's `requests` (set by submit)
    status: RequestStatus = RequestStatus.PENDING
    tokens: list = dataclasses.field(default_factory=list)  # generated so far
    finish: str = ""  # why it ended ("length", "stop", "released: quota_cut", a refusal...)
    seq: int = INVALID  # the sequence slot it holds (INVALID: none)
    context: list = dataclasses.field(default_factory=list)  # what its next admission prefills
    prefilled: int = 0  # tokens of context whose K/V are in the cache
    base: int = 0  # len(tokens) when admitted: the cache holds context + tokens[base:-1]
    cached_tokens: int = 0  # tokens of its context the prefix cache held at its last admission
    admitted: int = -1  # admission order stamp
    admitted_step: int = -1  # step of the first admission; first_refused: of the first refusal
    first_refused: int = -1
    finished_step: int = -1
    first_token_s: float = -1.0  # the scheduler's clock when the first token / the last came
    finish_s: float = -1.0
    preemptions: int = 0
    suspensions: int = 0
    planned_resume_tokens: int = 0  # recompute the reclaim plans said a resume would cost
    planned_resume_bytes: int = 0  # host bytes the plans said a restore would bring back
    paid_resume_tokens: int = 0  # recompute paid on re-admission
    paid_resume_bytes: int = 0  # host bytes restored
    lossy: bool = False  # compressed or evicted by a reclaim
    refusals: dict = dataclasses.field(default_factory=dict)  # admission refusals by reason
    session: Optional["Session"] = dataclasses.field(default=None, repr=False)  # its session
    turn: int = 0  # its turn in `session` (0: the first, or no session)
    was: Optional[RequestStatus] = None  # the status a suspension interrupted (restored to it)
    resuming: bool = False  # preempted and queued again: its next admission recomputes
    _ids: Optional[tuple] = dataclasses.field(default=None, repr=False)  # (context, i32 copy)

    def context_ids(self) -> np.ndarray:
        """`context` as i32[len], converted once per context (it is replaced, never changed in
        place): a queued request is retried at every step that frees room, and converting its
        2K-token list each time was ~14 % of a loaded step's wall at 10^5 requests (py-spy)."""
        if self._ids is None or self._ids[0] is not self.context:
            self._ids = (self.context, np.asarray(self.context, np.int32))
        return self._ids[1]

    def compact(self) -> None:
        """Token ids as int32 arrays, not Python ints (a 2K-token prompt: ~90 KB -> ~9 KB), once
        the scheduler is done with the request (the load test keeps 10^5 of them)."""
        self.prompt = np.asarray(self.prompt, np.int32)
        self.tokens = np.asarray(self.tokens, np.int32)
        self.context, self._ids = self.prompt[:0], None  # no next admission

    def check_archive(self, archived) -> None:
        """A preempted request's archive must be exactly the tokens the scheduler sent to its
        cache: its context, plus (once prefilled) the tokens decoded since, bar the pending
        one. (A compressed or evicted cache is not compared: eviction drops tokens.)"""
        want = self.context if self.status == RequestStatus.PREFILL else \
            self.context + self.tokens[self.base:-1]
        if not self.lossy and not np.array_equal(np.asarray(archived), np.asarray(want)):
            raise InvariantError([f"request {self.id}: the preemption archive differs from the "
                                  "tokens the scheduler sent to its cache"])

    def summary(self) -> dict:
        keys = ("id", "name", "tenant", "status", "finish", "tokens", "preemptions",
                "suspensions", "planned_resume_tokens", "paid_resume_tokens",
                "planned_resume_bytes", "paid_resume_bytes", "cached_tokens", "refusals",
                "admitted_step", "first_refused", "finished_step", "arrival_s",
                "first_token_s", "finish_s")
        return {k: getattr(self, k) for k in keys} | {"status": str(self.status),
                                                      "prompt_tokens": len(self.prompt)}


@dataclasses.dataclass(eq=False)
class Session:
    """A multi-turn conversation: turn k+1's prompt is turn k's prompt + answer + turns[k+1];
    between turns its sequence is IDLE (KV kept; the next turn hits it in the prefix cache).
    Turn k+1 arrives `gap` steps after turn k finished, or, on the scheduler's clock, think_s[k+1]
    seconds after (with `arrival_s` set: turn 0's arrival in seconds); turn k generates
    turn_new_tokens[k] tokens at most (default max_new_tokens). A turn that would arrive after
    `end_s` on the clock is never sent (the client stopped: a load test's end), ending it."""

    tenant: int
    turns: Sequence[Sequence[int]]  # each turn's new message (token ids)
    max_new_tokens: int
    gap: int = 1
    arrival: int = 0  # turn 0's arrival step (when arrival_s is None)
    stop_ids: tuple = ()
    name: str = ""  # turn k's request is named f"{name}.{k}"
    arrival_s: Optional[float] = None
    think_s: Sequence[float] = ()
    turn_new_tokens: Sequence[int] = ()
    end_s: Optional[float] = None
    requests: list = dataclasses.field(default_factory=list)  # its turns' requests so far
    idle_seq: int = INVALID  # the slot its last finished turn left IDLE (INVALID: none)
    ended: bool = False  # no next turn will come (refused, cancelled, released, outgrown)

    def turn_request(self, k: int, prompt, arrival: int, arrival_s: Optional[float]) -> Request:
        """Turn k's request: `prompt` (the conversation so far + turns[k]), arriving at step
        `arrival` or at `arrival_s` on the clock."""
        new = self.turn_new_tokens[k] if k < len(self.turn_new_tokens) else self.max_new_tokens
        return Request(self.tenant, prompt, new, arrival=arrival, arrival_s=arrival_s,
                       stop_ids=self.stop_ids, name=f"{self.name}.{k}", session=self, turn=k)

    def turn_arrival_s(self, k: int, clock: float) -> Optional[float]:
        """When turn k > 0 arrives on the clock, turn k - 1 having finished at `clock`: think_s[k]
        later (None: the session arrives by steps, `gap` steps later)."""
        if self.arrival_s is None:
            return None
        return clock + (self.think_s[k] if k < len(self.think_s) else 0.0)


@dataclasses.dataclass(frozen=True)
class Event:
    """Something that happens at `step`: quota_cut (byte_quota), lease_expiry, new_tenant
    (quotas, share_group, optional bytes_needed: make room), burst (requests, optional new
    quotas: a top-up). `policy`: the reclaim policy (None: the scheduler's)."""

    step: int
    kind: str
    tenant: int
    byte_quota: Optional[int] = None
    token_quota: Optional[int] = None
    share_group: Optional[int] = None
    bytes_needed: Optional[int] = None
    requests: tuple = ()
    policy: object = None

    def reclaim_request(self):
        """The ReclaimRequest this event makes, or None (a burst; a new tenant without
        bytes_needed)."""
        from kvquota.reclaim.plan import ReclaimRequest

        if self.kind == "quota_cut":
            return ReclaimRequest.quota_cut(self.tenant, self.byte_quota)
        if self.kind == "lease_expiry":
            return ReclaimRequest.lease_expiry(self.tenant)
        if self.kind == "new_tenant" and self.bytes_needed:
            return ReclaimRequest.make_room(self.tenant, self.bytes_needed)
        return None

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise InvalidArgumentError(f"unknown event kind {self.kind!r}; known: "
                                       f"{', '.join(EVENT_KINDS)}")
        if not isinstance(self.step, int) or self.step < 0:
            raise InvalidArgumentError(f"event step must be an int >= 0, got {self.step!r}")
        if self.kind == "quota_cut" and self.byte_quota is None:
            raise InvalidArgumentError("a quota_cut event needs byte_quota")


def check_request(config: StateConfig, r: Request) -> list[int]:
    """The prompt as a list of ints, after checking the request against the state's shapes
    (typed errors; nothing is changed)."""
    if not isinstance(r, Request):
        raise InvalidArgumentError(f"expected a Request, got {type(r).__name__}")
    ids = np.asarray(list(r.prompt))
    if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or \
            ((ids < 0) | (ids >= config.model.vocab_size)).any():
        raise TokenIdError(f"a prompt is 1+ token ids in [0, {config.model.vocab_size})")
    if len(ids) > config.max_tokens_per_seq:
        raise SequenceTooLongError(f"prompt of {len(ids)} tokens; a sequence holds "
                                   f"{config.max_tokens_per_seq}")
    if len(ids) >= config.model.max_context:
        raise ContextTooLongError(f"prompt of {len(ids)} tokens leaves no room in "
                                  f"{config.model.name}'s context of {config.model.max_context}")
    if r.max_new_tokens < 1 or r.arrival < 0 or not \
            0 <= r.pin_blocks <= len(ids) // config.block_size:
        raise InvalidArgumentError("need max_new_tokens >= 1, arrival >= 0 and pin_blocks "
                                   "within the prompt's full blocks")
    if r.arrival_s is not None and not (isinstance(r.arrival_s, (int, float)) and
                                        0 <= r.arrival_s < float("inf")):
        raise InvalidArgumentError(f"arrival_s must be a finite number >= 0, got {r.arrival_s!r}")
    return ids.astype(np.int64).tolist()  # Python ints
