"""The serving scheduler's records: what drives it (`Request`, `Session`, `Event`: plain
dataclasses it fills in as requests live), what it observes (bytes per tenant per tier, ledger
drift, refusals by reason, preemptions, resume costs) and the JSON-ready step records and summary
(DESIGN.md §1: preemptions observable from the first).

The per-step figures come from the step's one readback (`StepOutput.charged`: blocks charged per
tenant and pool), so recording them costs no extra device sync. The drift check is the one
exception, and is optional (`Scheduler(drift_every=...)`): it reads the state's metadata (never
the pages) and recomputes every tenant's charges from the block tables with the independent NumPy
code of `kvquota.invariants.recompute` — O(pool) host work, meant for tests and demos, not for the
2^20-block cost-model runs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pathlib
import time
from typing import Optional, Sequence

import jax
import numpy as np

from kvquota.codes import REASONS
from kvquota.errors import (ContextTooLongError, InvalidArgumentError, InvariantError,
                            SequenceTooLongError, TokenIdError)
from kvquota.invariants import recompute
from kvquota.sentinel import INVALID
from kvquota.state import StateConfig

EVENT_KINDS = ("quota_cut", "lease_expiry", "new_tenant", "burst")
# A resume's cost as the reclaim plan said it (its fates' figures, which assume the prefix
# cache still holds the blocks it counted) and as paid when the request came back.
RESUME_FIELDS = ("planned_resume_tokens", "paid_resume_tokens", "planned_resume_bytes",
                 "paid_resume_bytes")


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request; the fields after `name` are the scheduler's record of its life.

    status: pending (not arrived) -> queued -> prefill -> running -> finished, or refused; a
    reclaim may make it suspended (until restored) or queue it again (preempted). `context`: the
    tokens its next admission prefills (the prompt, or prompt + generated tokens on a resume);
    `tokens`: every token generated so far; sampling keys are (id, token index), so a replay
    draws what the first run drew.
    """

    tenant: int
    prompt: Sequence[int]
    max_new_tokens: int
    arrival: int = 0
    stop_ids: tuple = ()
    pin_blocks: int = 0  # pin the first blocks once prefilled (a shared system prompt)
    arrival_s: Optional[float] = None  # arrival on the scheduler's clock (seconds; None: step)
    name: str = ""
    id: int = -1
    status: str = "pending"
    tokens: list = dataclasses.field(default_factory=list)
    finish: str = ""
    seq: int = INVALID
    context: list = dataclasses.field(default_factory=list)
    prefilled: int = 0  # tokens of context whose K/V are in the cache
    base: int = 0  # len(tokens) when admitted: the cache holds context + tokens[base:-1]
    cached_tokens: int = 0
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
    refusals: dict = dataclasses.field(default_factory=dict)
    session: Optional["Session"] = dataclasses.field(default=None, repr=False)
    turn: int = 0
    was: str = ""
    resuming: bool = False
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

    def summary(self) -> dict:
        keys = ("id", "name", "tenant", "status", "finish", "tokens", "preemptions",
                "suspensions", "planned_resume_tokens", "paid_resume_tokens",
                "planned_resume_bytes", "paid_resume_bytes", "cached_tokens", "refusals",
                "admitted_step", "first_refused", "finished_step", "arrival_s",
                "first_token_s", "finish_s")
        return {k: getattr(self, k) for k in keys} | {"prompt_tokens": len(self.prompt)}


@dataclasses.dataclass(eq=False)
class Session:
    """A multi-turn conversation: turn k+1's prompt is turn k's prompt + answer + turns[k+1];
    between turns its sequence is IDLE (KV kept; the next turn hits it in the prefix cache).
    Turn k+1 arrives `gap` steps after turn k finished, or, on the scheduler's clock, think_s[k+1]
    seconds after (with `arrival_s` set: turn 0's arrival in seconds); turn k generates
    turn_new_tokens[k] tokens at most (default max_new_tokens)."""

    tenant: int
    turns: Sequence[Sequence[int]]
    max_new_tokens: int
    gap: int = 1
    arrival: int = 0
    stop_ids: tuple = ()
    name: str = ""
    arrival_s: Optional[float] = None
    think_s: Sequence[float] = ()
    turn_new_tokens: Sequence[int] = ()
    requests: list = dataclasses.field(default_factory=list)
    idle_seq: int = INVALID
    ended: bool = False


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


TIERS = ("device", "compressed", "host")


def pool_tier_names(config: StateConfig) -> tuple[str, ...]:
    """The tier name of each pool: pool 0 "device", compressed pools "compressed", "host"."""
    names = ["device"] + ["compressed"] * len(config.compressed_pools)
    if config.host_pool is not None:
        names.append("host")
    return tuple(names)


@functools.lru_cache(maxsize=64)
def _tier_weights(config: StateConfig) -> np.ndarray:
    """i64[POOLS, TIERS]: bytes per block of each pool in its tier's column (cached: the
    config's pool_bytes is recomputed on every access)."""
    w = np.zeros((config.num_pools, len(TIERS)), np.int64)
    for pool, name in enumerate(pool_tier_names(config)):
        w[pool, TIERS.index(name)] = config.pool_bytes[pool]
    return w


def tier_bytes(config: StateConfig, charged) -> dict[str, dict[str, int]]:
    """{tenant: {tier: bytes}} from blocks charged per tenant and pool (i32[T, POOLS])."""
    by = (np.asarray(charged, np.int64) @ _tier_weights(config)).tolist()
    return {str(t): dict(zip(TIERS, row)) for t, row in enumerate(by)}


def ledger_drift(config: StateConfig, state) -> dict:
    """|ledger - recomputation| in bytes per tenant and tier, and in tokens per tenant.

    The recomputation (`kvquota.invariants.recompute`) rebuilds every block's references from
    the block tables and charges each held block to its payer; the ledger is what the state's
    counters say. Returns {"bytes": max over tenants and tiers, "tokens": max over tenants,
    "by_tenant": {tenant: {tier: bytes}} (non-zero entries only)}."""
    host = jax.device_get(state.replace(pages=()))  # metadata only: never the pages
    r = recompute(config, host)
    ledger = tier_bytes(config, host.tenants.charged_blocks)
    recomputed = tier_bytes(config, r["charged"])
    by_tenant = {}
    for t in ledger:
        diff = {tier: abs(ledger[t][tier] - recomputed[t][tier]) for tier in TIERS}
        if any(diff.values()):
            by_tenant[t] = diff
    tokens = np.abs(np.asarray(host.tenants.used_tokens, np.int64) - r["used"])
    worst = max((d for row in by_tenant.values() for d in row.values()), default=0)
    return {"bytes": int(worst), "tokens": int(tokens.max(initial=0)), "by_tenant": by_tenant}


def ledger_table(ledger) -> dict[str, dict]:
    """A kvquota Ledger as {tenant: {figure: value}} with string keys (JSON)."""
    return {str(t): row for t, row in ledger.summary().items()}


class Counters:
    """Per-step and running totals of what the scheduler did (refusals by reason name,
    preemptions, resume costs paid, generated tokens)."""

    FIELDS = ("preemptions", "suspensions", *RESUME_FIELDS,
              "generated_tokens", "prefill_tokens", "finished", "deferred")

    def __init__(self):
        self.total = collections.Counter()
        self.step = collections.Counter()
        self.refusals_total = collections.Counter()
        self.refusals_step = collections.Counter()

    def add(self, name: str, n: int = 1):
        self.step[name] += n
        self.total[name] += n

    def refused(self, reason_code: int, n: int = 1):
        name = REASONS.get(int(reason_code), str(reason_code))
        self.refusals_step[name] += n
        self.refusals_total[name] += n

    def refused_named(self, name: str, n: int = 1):
        self.refusals_step[name] += n
        self.refusals_total[name] += n

    def new_step(self):
        self.step.clear()
        self.refusals_step.clear()

    def step_record(self) -> dict:
        out = {name: int(self.step[name]) for name in self.FIELDS}
        out["preemptions_total"] = int(self.total["preemptions"])
        out["refusals"] = dict(self.refusals_step)
        return out


def step_record(config: StateConfig, *, step, kinds, out, dec, pre, charged, queues, live,
                idle_sessions, counters, step_syncs, host_syncs, facade_calls) -> dict:
    """One step as JSON-ready data: its latency, batch composition per tenant (decode and
    prefill rows), bytes per tenant per tier and used tokens after the step, queue lengths,
    running / suspended requests, and this step's counters (refusals by reason, preemptions,
    resume costs paid, tokens generated and prefilled)."""
    rows = {"decode": collections.Counter(r.tenant for r in dec),
            "prefill": collections.Counter(r.tenant for r, _ in pre)}
    batch = {str(t): {k: rows[k][t] for k in rows} for t in rows["decode"] | rows["prefill"]}
    statuses = collections.Counter(r.status for r in live)
    used = [] if out is None else out.used_tokens
    return {"step": step, "events": kinds, "step_s": out.seconds if out is not None else 0.0,
            "slack_tokens": out.slack_tokens if out is not None else 0,
            "decode_rows": len(dec), "prefill_rows": len(pre), "batch": batch,
            "bytes": tier_bytes(config, charged),
            "used_tokens": {str(t): int(v) for t, v in enumerate(used)},
            "queue": {str(t): len(q) for t, q in queues.items()},
            "running": statuses["running"], "suspended": statuses["suspended"],
            "idle_sessions": idle_sessions, **counters.step_record(),
            "step_syncs": step_syncs, "host_syncs": host_syncs, "facade_calls": facade_calls}


def record_step(sched, out, dec, pre, charged, kinds, marks) -> dict:
    """A Scheduler's step record, with the drift measured and the invariants checked when due
    (`drift_every`, `check_every`). marks: (start time, scheduler syncs, executor syncs, facade
    calls) when the step began."""
    start, syncs0, exec0, calls0 = marks
    rec = step_record(sched.config, step=sched.t, kinds=kinds, out=out, dec=dec, pre=pre,
                      charged=charged, queues=sched.queues, live=sched.live,
                      idle_sessions=len(sched.idle_of), counters=sched.counters,
                      step_syncs=sched.executor.syncs - exec0, host_syncs=sched.syncs - syncs0,
                      facade_calls=sched.facade_calls - calls0)
    if sched.drift_every and sched.t % sched.drift_every == 0:
        drift = ledger_drift(sched.config, sched.state)
        rec["drift_bytes"], rec["drift_tokens"] = drift["bytes"], drift["tokens"]
        sched.drift_max = max(sched.drift_max, drift["bytes"], drift["tokens"])
    if sched.check_every and sched.t % sched.check_every == 0:
        sched.alloc.check(sched.state)
    rec["clock_s"] = sched.clock
    rec["wall_s"] = time.perf_counter() - start
    return rec


def check_archive(r: Request, archived) -> None:
    """A preempted request's archive must be exactly the tokens the scheduler sent to its cache:
    its context, plus (once prefilled) the tokens decoded since, bar the pending one. (A
    compressed or evicted cache is not compared: eviction drops tokens.)"""
    want = r.context if r.status == "prefill" else r.context + r.tokens[r.base:-1]
    if not r.lossy and not np.array_equal(np.asarray(archived), np.asarray(want)):
        raise InvariantError([f"request {r.id}: the preemption archive differs from the tokens "
                              "the scheduler sent to its cache"])


def run_summary(requests, records, counters, *, steps: int, drift_max: int, events: int) -> dict:
    """The whole run: requests by status and finish, totals, the worst ledger drift, and host
    syncs per pure decode step (decode rows only, no facade call: the executor's readback plus
    the scheduler's own reads; the facade's own validation reads are not in it)."""
    decode = [r for r in records if r["decode_rows"] and not r["prefill_rows"] and
              not r["facade_calls"]]
    total = counters.total
    return {"steps": steps, "requests": dict(collections.Counter(r.status for r in requests)),
            "finishes": dict(collections.Counter(r.finish for r in requests if r.finish)),
            "preemptions": int(total["preemptions"]), "suspensions": int(total["suspensions"]),
            "refusals": dict(counters.refusals_total),
            **{name: int(total[name]) for name in RESUME_FIELDS},
            "generated_tokens": int(total["generated_tokens"]),
            "ledger_drift_max": int(drift_max), "events": events, "decode_steps": len(decode),
            "syncs_per_decode_step": (sum(r["step_syncs"] + r["host_syncs"] for r in decode)
                                      / len(decode)) if decode else None}


class JsonLines:
    """Appends one JSON object per line to a file (flushed each time, so a killed run keeps
    what it measured)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()

    def __call__(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_json_lines(path) -> list[dict]:
    """The records of a JSONL file written by JsonLines (none when it does not exist yet)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
