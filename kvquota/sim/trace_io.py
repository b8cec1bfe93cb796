"""Traces as data on disk and in run records: `save_trace` / `load_trace` (JSONL, exact round
trip, every line validated) and `trace_summary` (the figures a load test's record carries).

The format (version 1), one JSON object per line, `kind` saying what the line is:

    {"kind": "header", "format": "kvquota-trace", "version": 1, "config": {...}}
    {"kind": "tenant", "tenant": 0, "group": 0, "quota_share": 0.4, "salt_group": 0}
    {"kind": "system", "group": 0, "prompt": [101, 7, ...]}
    {"kind": "request", "id": 0, "tenant": 0, "arrival_s": 0.5, "session": -1, "turn": 0,
     "think_s": 0.0, "system": 0, "prompt_tokens": 3, "output_tokens": 64, "prompt": [5, 6, 7]}
    {"kind": "event", "time_s": 30.0, "event": "quota_cut", "tenant": 0, "quota_share": 0.2}

* The header comes first, once. `config` is the generating `TraceConfig` (its fields as JSON) or
  any metadata of a user's trace ({} is fine). Its `requests`, where it is an integer (a
  generated trace's always is), is the number of request lines the file holds.
* Tenant lines: `group` -1 for none; `quota_share` the fraction of the pool's bytes (shares may
  sum to more than 1); `salt_group` the prefix-cache salt group (-1: private).
* System lines (optional): a group's system prompt as explicit token ids.
* Request lines (at least one): every field of `kvquota.sim.TraceRequest` (see there what each
  means). `arrival_s` is a number for turn 0 and null for a session's later turns (they arrive
  `think_s` after the turn before finished); `session` -1 for a single request; a session's turns
  appear in file order 0, 1, 2, ... `prompt` (optional) holds explicit ids, as many as
  `prompt_tokens`; without it the ids are regenerated from the header's `seed` and `vocab_size`
  (generated traces store no token ids: 10^5 prompts of 2K ids would be a gigabyte). `system` >= 0
  needs a system line for that group, or a generator config (`seed`, `vocab_size`, `groups`,
  `system_prompt_tokens`).
* Event lines: `event` is "quota_cut" (`quota_share`: the new share) or "lease_expiry"
  (`quota_share` null).

Loading puts tenants in id order, requests in the trace's order (by the arrival of their
session's turn 0, then id; a session's turns in order) and events by time, so a saved trace loads
back equal. Every problem raises `TraceFormatError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from kvquota.errors import InvalidArgumentError, TraceFormatError
from kvquota.sim.traces import (EVENT_KINDS, TenantSpec, Trace, TraceEvent, TraceRequest,
                                 system_prompt_ids)

FORMAT, VERSION = "kvquota-trace", 1


# Fields of each line kind: name -> (type, nullable, required). "int" excludes bools; "float"
# takes ints too (and stores floats); "ids" is a list of ints >= 0.
_REQ = {"id": ("int", False, True), "tenant": ("int", False, True),
        "arrival_s": ("float", True, True), "session": ("int", False, True),
        "turn": ("int", False, True), "think_s": ("float", False, True),
        "system": ("int", False, True), "prompt_tokens": ("int", False, True),
        "output_tokens": ("int", False, True), "prompt": ("ids", True, False)}
_SCHEMA = {
    "header": {"format": ("str", False, True), "version": ("int", False, True),
               "config": ("dict", False, True)},
    "tenant": {"tenant": ("int", False, True), "group": ("int", False, True),
               "quota_share": ("float", False, True), "salt_group": ("int", False, True)},
    "system": {"group": ("int", False, True), "prompt": ("ids", False, True)},
    "request": _REQ,
    "event": {"time_s": ("float", False, True), "event": ("str", False, True),
              "tenant": ("int", False, True), "quota_share": ("float", True, True)},
}
_LOWEST = {"tenant": 0, "group": -1, "salt_group": -1, "id": 0, "session": -1, "turn": 0,
           "system": -1, "prompt_tokens": 0, "output_tokens": 1, "arrival_s": 0,
           "think_s": 0, "time_s": 0, "quota_share": 0}

# JSON values only: `type(v) is int` keeps bools (and NumPy scalars) out.
_OK = {"int": lambda v: type(v) is int,
       "float": lambda v: type(v) in (int, float) and math.isfinite(v),
       "str": lambda v: type(v) is str, "dict": lambda v: type(v) is dict,
       "ids": lambda v: type(v) is list and all(type(x) is int and x >= 0 for x in v)}
_WANT = {"int": "an integer", "float": "a finite number", "str": "a string",
         "dict": "an object", "ids": "a list of token ids (ints >= 0)"}


class _Checker:
    """Validates records (line number, dict) in file order and builds the Trace."""

    def __init__(self, path):
        self.path = os.fspath(path)

    def fail(self, line: int, problem: str):
        raise TraceFormatError(f"{self.path}:{line}: {problem}")

    def fields(self, line: int, rec) -> tuple[str, dict]:
        if not isinstance(rec, dict):
            self.fail(line, f"expected a JSON object, got {type(rec).__name__}")
        kind = rec.get("kind")
        if kind not in _SCHEMA:
            self.fail(line, f"unknown kind {kind!r}; known: {', '.join(_SCHEMA)}")
        spec, out = _SCHEMA[kind], {}
        extra = sorted(set(rec) - set(spec) - {"kind"})
        if extra:
            self.fail(line, f"{kind} line has unexpected field(s) {extra}")
        for name, (typ, nullable, required) in spec.items():
            if name not in rec:
                if required:
                    self.fail(line, f"{kind} line lacks field {name!r}")
                out[name] = None
                continue
            v = rec[name]
            if v is None and nullable:
                out[name] = None
                continue
            out[name] = self.typed(line, kind, name, typ, v)
        return kind, out

    def typed(self, line, kind, name, typ, v):
        if not _OK[typ](v):
            self.fail(line, f"{kind} field {name!r} must be {_WANT[typ]}, got {v!r}"[:300])
        if name in _LOWEST and v < _LOWEST[name]:
            self.fail(line, f"{kind} field {name!r} must be >= {_LOWEST[name]}, got {v!r}")
        return float(v) if typ == "float" else tuple(v) if typ == "ids" else v

    def build(self, records) -> Trace:
        records = iter(records)
        first = next(records, None)
        if first is None:
            self.fail(1, "empty trace: no header line")
        kind, head = self.fields(*first)
        if kind != "header":
            self.fail(first[0], f"the first line must be the header, got a {kind} line")
        if head["format"] != FORMAT or head["version"] != VERSION:
            self.fail(first[0], f"not a {FORMAT} version {VERSION} file (format "
                                f"{head['format']!r}, version {head['version']!r})")
        config = head["config"]
        vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
        generated = all(isinstance(config.get(k), int) and not isinstance(config.get(k), bool)
                        for k in ("seed", "vocab_size"))
        tenants, systems, reqs, events, at = {}, {}, [], [], {}
        for line, rec in records:
            kind, f = self.fields(line, rec)
            if kind == "header":
                self.fail(line, "a second header line")
            if f.get("prompt") is not None and vocab is not None and \
                    any(x >= vocab for x in f["prompt"]):
                self.fail(line, f"a token id >= the header's vocab_size {vocab}")
            if kind == "tenant":
                if f["tenant"] in tenants:
                    self.fail(line, f"duplicate tenant {f['tenant']}")
                tenants[f["tenant"]] = TenantSpec(**f)
                at[("tenant", f["tenant"])] = line
            elif kind == "system":
                if f["group"] < 0 or f["group"] in systems:
                    self.fail(line, f"system group {f['group']} is negative or a duplicate")
                systems[f["group"]] = f["prompt"]
            elif kind == "request":
                reqs.append((line, self.request(line, f, generated)))
            else:
                events.append((line, self.event(line, f)))
        self.count(first[0], config, len(reqs))
        return self.finish(config, tenants, systems, reqs, events, generated)

    def count(self, line, config, n):
        """Refuses a trace without requests (a replay of it measures nothing) and one whose
        request lines are not as many as the header's `config.requests` says (a file cut short
        or added to); `line` is the header's."""
        claimed = config.get("requests") if type(config.get("requests")) is int else None
        if n == 0:
            self.fail(line, "no request lines: a trace needs at least one request" + (
                f" (the header's config says {claimed})" if claimed is not None else ""))
        if claimed is not None and n != claimed:
            self.fail(line, f"the header's config says {claimed} requests, the file has {n} "
                            "request lines")

    def request(self, line, f, generated) -> TraceRequest:
        r = TraceRequest(**f)
        if r.session < 0 and (r.turn != 0 or r.think_s != 0):
            self.fail(line, f"request {r.id}: a single request (session -1) has turn 0 and "
                            f"think_s 0, got turn {r.turn}, think_s {r.think_s}")
        if r.turn == 0 and (r.arrival_s is None or r.think_s != 0):
            self.fail(line, f"request {r.id}: turn 0 needs an arrival_s and think_s 0")
        if r.turn > 0 and (r.arrival_s is not None or r.system != -1):
            self.fail(line, f"request {r.id}: turn {r.turn} > 0 arrives think_s after the turn "
                            "before (arrival_s null) and has system -1")
        if r.turn == 0 and r.system < 0 and r.prompt_tokens < 1:
            self.fail(line, f"request {r.id}: an empty first prompt (no system prompt, "
                            "prompt_tokens 0)")
        if r.prompt is not None and len(r.prompt) != r.prompt_tokens:
            self.fail(line, f"request {r.id}: prompt has {len(r.prompt)} ids, prompt_tokens "
                            f"says {r.prompt_tokens}")
        if r.prompt is None and not generated:
            self.fail(line, f"request {r.id} has no prompt and the header's config no int seed "
                            "and vocab_size to regenerate it")
        return r

    def event(self, line, f) -> TraceEvent:
        kind, share = f["event"], f["quota_share"]
        if kind not in EVENT_KINDS:
            self.fail(line, f"unknown event {kind!r}; known: {', '.join(EVENT_KINDS)}")
        if kind == "quota_cut" and share is None:
            self.fail(line, "a quota_cut event needs a quota_share (the new share)")
        if kind == "lease_expiry" and share is not None:
            self.fail(line, f"a lease_expiry event has quota_share null, got {share!r}")
        return TraceEvent(f["time_s"], kind, f["tenant"], share)

    def finish(self, config, tenants, systems, reqs, events, generated) -> Trace:
        groups = config.get("groups", 0) if config.get("system_prompt_tokens", 0) else 0
        ids, last_turn, first_of = set(), {}, {}
        for line, r in reqs:
            if r.id in ids:
                self.fail(line, f"duplicate request id {r.id}")
            ids.add(r.id)
            if r.tenant not in tenants:
                self.fail(line, f"request {r.id}: unknown tenant {r.tenant}")
            if r.system >= 0 and r.system not in systems and not (
                    generated and isinstance(groups, int) and r.system < groups):
                self.fail(line, f"request {r.id}: no system prompt for group {r.system}")
            if r.session >= 0:
                want = last_turn.get(r.session, -1) + 1
                if r.turn != want:
                    self.fail(line, f"request {r.id}: session {r.session}'s turns out of order "
                                    f"(turn {r.turn} where turn {want} comes next)")
                if r.turn and r.tenant != first_of[r.session].tenant:
                    self.fail(line, f"request {r.id}: session {r.session} changes tenant")
                last_turn[r.session] = r.turn
                first_of.setdefault(r.session, r)
        for line, e in events:
            if e.tenant not in tenants:
                self.fail(line, f"event for unknown tenant {e.tenant}")

        def key(r):
            head = first_of[r.session] if r.session >= 0 else r
            return (head.arrival_s, head.id, r.turn)

        return Trace(config, [tenants[t] for t in sorted(tenants)],
                     sorted((r for _, r in reqs), key=key),
                     [e for _, e in sorted(events, key=lambda x: x[1].time_s)],
                     {g: systems[g] for g in sorted(systems)})


def _records(trace: Trace):
    """(line number, dict) of every line `save_trace` writes."""
    yield {"kind": "header", "format": FORMAT, "version": VERSION, "config": trace.config}
    for t in trace.tenants:
        yield {"kind": "tenant"} | dataclasses.asdict(t)
    for g, ids in trace.system_prompts.items():
        yield {"kind": "system", "group": g, "prompt": [int(x) for x in ids]}
    for r in trace.requests:
        d = {"kind": "request"} | {k: getattr(r, k) for k in _REQ}
        if r.prompt is None:
            del d["prompt"]
        else:
            d["prompt"] = [int(x) for x in r.prompt]
        yield d
    for e in trace.events:
        yield {"kind": "event", "time_s": e.time_s, "event": e.kind, "tenant": e.tenant,
               "quota_share": e.quota_share}


def save_trace(trace: Trace, path) -> None:
    """Write `trace` as JSONL at `path` (see the module docstring), after checking it with the
    loader's rules (TraceFormatError naming the line it would have been): what is saved loads."""
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(f"expected a Trace, got {type(trace).__name__}")
    records = list(_records(trace))
    try:
        lines = [json.dumps(r, separators=(",", ":"), allow_nan=False) for r in records]
    except (TypeError, ValueError) as e:
        raise TraceFormatError(f"{os.fspath(path)}: the trace is not JSON data ({e})") from e
    _Checker(path).build(enumerate((json.loads(s) for s in lines), 1))  # what the loader would see
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def load_trace(path) -> Trace:
    """The trace in the JSONL file at `path` (see the module docstring), every line validated
    (TraceFormatError naming the file, the line and the problem)."""
    checker = _Checker(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{checker.path}: cannot read the trace ({e})") from e

    def records():
        for n, raw in enumerate(text.splitlines(), 1):
            if not raw.strip():
                checker.fail(n, "blank line")
            try:
                rec = json.loads(raw, parse_constant=lambda c: checker.fail(n, f"not finite: {c}"))
            except json.JSONDecodeError as e:
                checker.fail(n, f"not JSON ({e.msg} at column {e.colno})")
            yield n, rec

    return checker.build(records())


# ---- summary -------------------------------------------------------------------------------------
def _stats(x) -> dict:
    x = np.asarray(x, np.float64)
    if not x.size:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p99": float(np.percentile(x, 99)), "max": float(x.max())}


def trace_summary(trace: Trace) -> dict:
    """JSON-ready figures of a trace (for a run record): counts, length statistics (new prompt
    tokens of every request; whole first prompts, system prompt included), sessions and turns,
    span, requests per tenant, events."""
    reqs = trace.requests
    sys_len = {g: len(system_prompt_ids(trace, g)) for g in {r.system for r in reqs} - {-1}}
    first = [r.prompt_tokens + sys_len.get(r.system, 0) for r in reqs if r.turn == 0]
    turns = {}
    for r in reqs:
        if r.session >= 0:
            turns[r.session] = turns.get(r.session, 0) + 1
    arrivals = [r.arrival_s for r in reqs if r.arrival_s is not None]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    per_tenant = {str(t.tenant): 0 for t in trace.tenants}
    for r in reqs:
        per_tenant[str(r.tenant)] = per_tenant.get(str(r.tenant), 0) + 1
    return {
        "requests": len(reqs), "tenants": len(trace.tenants),
        "single_requests": sum(r.session < 0 for r in reqs),
        "sessions": len(turns), "session_requests": sum(turns.values()),
        "turns": _stats(list(turns.values())),
        "think_s": _stats([r.think_s for r in reqs if r.turn > 0]),
        "prompt_tokens": _stats([r.prompt_tokens for r in reqs]),
        "first_prompt_tokens": _stats(first),
        "output_tokens": _stats([r.output_tokens for r in reqs]),
        "span_s": float(span), "arrival_rate_per_s": len(reqs) / span if span > 0 else 0.0,
        "requests_per_tenant": per_tenant,
        "events": [dataclasses.asdict(e) for e in trace.events],
        "events_by_kind": {k: sum(e.kind == k for e in trace.events) for k in EVENT_KINDS},
    }
