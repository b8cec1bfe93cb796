"""The serving scheduler's records: what it observes (bytes per tenant per tier, ledger drift,
refusals by reason, preemptions, resume costs) as JSON-ready step records and a run summary
(DESIGN.md §1: preemptions observable from the first). Every function here is given the figures
it records; none reads or changes the scheduler. (What drives the scheduler, `Request`, `Session`
and `Event`, is in `serving.requests`.)

The per-step figures come from the step's one readback (`StepOutput.charged`: blocks charged per
tenant and pool), so recording them costs no extra device sync. The drift check is the one
exception, and is optional (`Scheduler(drift_every=...)`): it reads the state's metadata (never
the pages) and recomputes every tenant's charges from the block tables with the independent NumPy
code of `kvquota.invariants.recompute` — O(pool) host work, meant for tests and demos, not for the
2^20-block cost-model runs.
"""

from __future__ import annotations

import collections
import functools
import json
import pathlib
from typing import Optional

import jax
import numpy as np

from kvquota.codes import REASONS
from kvquota.invariants import recompute
from kvquota.state import StateConfig

# A resume's cost as the reclaim plan said it (its fates' figures, which assume the prefix
# cache still holds the blocks it counted) and as paid when the request came back.
RESUME_FIELDS = ("planned_resume_tokens", "paid_resume_tokens", "planned_resume_bytes",
                 "paid_resume_bytes")
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


def record_step(config: StateConfig, *, step, kinds, out, dec, pre, charged, queues, live,
                idle_sessions, counters, step_syncs, host_syncs, facade_calls,
                drift: Optional[dict], clock_s: float, wall_s: float) -> dict:
    """A scheduler step's full record: `step_record`, then the ledger drift when it was measured
    at this step (`ledger_drift`'s dict, or None), the clock after the step and the step's wall
    seconds."""
    rec = step_record(config, step=step, kinds=kinds, out=out, dec=dec, pre=pre,
                      charged=charged, queues=queues, live=live, idle_sessions=idle_sessions,
                      counters=counters, step_syncs=step_syncs, host_syncs=host_syncs,
                      facade_calls=facade_calls)
    if drift is not None:
        rec["drift_bytes"], rec["drift_tokens"] = drift["bytes"], drift["tokens"]
    rec["clock_s"] = clock_s
    rec["wall_s"] = wall_s
    return rec


def run_summary(requests, records, counters, *, steps: int, drift_max: int, events: int) -> dict:
    """The whole run: requests by status and finish, totals, the worst ledger drift, and host
    syncs per pure decode step (decode rows only, no facade call: the executor's readback plus
    the scheduler's own reads; the facade's own validation reads are not in it)."""
    decode = [r for r in records if r["decode_rows"] and not r["prefill_rows"] and
              not r["facade_calls"]]
    total = counters.total
    return {"steps": steps,
            "requests": dict(collections.Counter(str(r.status) for r in requests)),
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
