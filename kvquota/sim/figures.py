"""The load test's figures per policy, overall and per tenant (`summarize`), from a finished
`kvquota.sim.loadtest.Replay` and its request records, in modelled seconds.

  ttft: first token's clock - arrival (a later turn's arrival: previous turn's end + think_s);
  tpot: (last token's clock - first token's clock) / (tokens - 1), requests of >= 2 tokens;
  step jitter: |step_s - median of the previous `jitter_window` steps' step_s| over the steps
    that ran a batch (a step far from the recent ones: a stall a user sees mid-stream);
  goodput: output tokens of requests that ended normally (length / stop) with ttft <= slo_ttft_s
    and tpot <= slo_tpot_s, per modelled second of the whole run;
  fragmentation: bytes of unused token slots in the blocks held by the step's running rows
    (table entries x block size - cached tokens, at pool 0's bytes per token; the executor's
    `slack_tokens`): capacity the ledger counts as used that holds no token. (Free but not
    allocatable pool capacity is nil by construction: cold blocks count as free and are reused.)
  Requests that never got a first token (refused, timed out) have no ttft: the percentiles are
  over the requests served, and goodput counts what the others lost.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from kvquota.serving import metrics

if TYPE_CHECKING:
    from kvquota.sim.loadtest import LoadConfig, Replay

DONE = ("length", "stop")  # finishes that count toward goodput


def _pct(x, q) -> Optional[float]:
    return float(np.percentile(x, q)) if len(x) else None


def jitter(step_s: Sequence[float], window: int) -> np.ndarray:
    """|step_s[i] - median(step_s[i - window: i])| for each step after the first."""
    x = np.asarray(step_s, float)
    return np.asarray([abs(x[i] - np.median(x[max(0, i - window): i]))
                       for i in range(1, len(x))])


def latency_figures(reqs: list[dict], cfg: LoadConfig, seconds: float) -> dict:
    ttft = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in reqs if r["tpot_s"] is not None]
    good = sum(r["output_tokens"] for r in reqs if r["finish"] in DONE and
               r["ttft_s"] is not None and r["ttft_s"] <= cfg.slo_ttft_s and
               (r["tpot_s"] or 0.0) <= cfg.slo_tpot_s)
    refused = collections.Counter(r["finish"] for r in reqs if r["status"] == "refused")
    return {"requests": len(reqs), "finished": sum(r["status"] == "finished" for r in reqs),
            "completed": sum(r["finish"] in DONE for r in reqs),
            "output_tokens": sum(r["output_tokens"] for r in reqs),
            "p50_ttft_s": _pct(ttft, 50), "p99_ttft_s": _pct(ttft, 99),
            "p50_tpot_s": _pct(tpot, 50), "p99_tpot_s": _pct(tpot, 99),
            "preemptions": sum(r["preemptions"] for r in reqs),
            "suspensions": sum(r["suspensions"] for r in reqs),
            "refused_requests": dict(refused),
            "goodput": good / seconds if seconds > 0 else 0.0, "good_tokens": good}


def merged_summary(scheds) -> dict:
    """The replicas' scheduler summaries added up (counts and dicts of counts)."""
    out = {}
    for s in scheds:
        for name, v in s.summary().items():
            if isinstance(v, dict):
                acc = out.setdefault(name, collections.Counter())
                acc.update(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name] = out.get(name, 0) + v
    return {k: dict(v) if isinstance(v, collections.Counter) else v for k, v in out.items()}


def cause(p: dict) -> str:
    """What a busy step did beside decoding: "reclaim" (it carried reclaim work: a plan,
    compress or evict bytes, host-link transfers), else "prefill" (a prefill chunk), else
    "neither"."""
    return "reclaim" if p.get("reclaim_s", 0.0) > 0 else "prefill" if p["prefill_rows"] \
        else "neither"


def step_figures(samples: list[dict], cfg: LoadConfig, pool0_bytes: int) -> dict:
    """Per replica, in step order: jitter (attributed to each step's `cause`), the modelled
    time pool 0 spent above 80 % used (each step's interval, from the previous step's clock to
    its own, at the usage after it), and how long the steps took to come back after each event
    (`recovery_s`: from the start of the event's step to the start of the first step within
    10 % of the median of the `jitter_window` busy steps before it)."""
    by_replica = collections.defaultdict(list)
    for p in samples:
        by_replica[p.get("replica", 0)].append(p)
    jit, causes, above, total, recovery = [], [], 0.0, 0.0, []
    for rows in by_replica.values():
        busy = [p for p in rows if p["decode_rows"] or p["prefill_rows"]]
        jit.extend(jitter([p["step_s"] for p in busy], cfg.jitter_window))
        causes.extend(cause(p) for p in busy[1:])
        last = 0.0
        for p in rows:
            dt = max(0.0, p["clock_s"] - last)
            last = max(last, p["clock_s"])
            total += dt
            above += dt * (p["bytes"]["device"] > 0.8 * pool0_bytes)
        for i, p in enumerate(busy):
            if not p["events"]:
                continue
            before = [q["step_s"] for q in busy[max(0, i - cfg.jitter_window): i]]
            if not before:
                continue
            base = float(np.median(before))
            back = next((q for q in busy[i:] if abs(q["step_s"] - base) <= 0.1 * base), None)
            recovery.append(None if back is None else  # from the event step's start to the
                            back["clock_s"] - back["step_s"] - p["clock_s"] + p["step_s"])  # back one's
    jit, causes = np.asarray(jit), np.asarray(causes)
    by_cause = {c: {"steps": int((causes == c).sum()),
                    "p99_step_jitter_s": _pct(jit[causes == c], 99)}
                for c in ("reclaim", "prefill", "neither")}
    back = [r for r in recovery if r is not None]
    return {"p99_step_jitter_s": _pct(jit, 99), "jitter_by_cause": by_cause,
            "pool0_above_80_share": above / total if total > 0 else 0.0,
            "recovery_s_max": max(back) if back else None,
            "never_recovered_events": len(recovery) - len(back)}


def reclaim_figures(events: list[dict]) -> dict:
    """Every reclaim event's plan summed over replicas, and the quota cuts (not lease expiries)
    whose target, summed over replicas, was 0: `zero_target_events` (a cut that took nothing
    measures no policy)."""
    by_event = collections.defaultdict(collections.Counter)  # trace event -> sums
    for e in events:
        by_event[e["order"], e["kind"], e["tenant"]].update(
            {k: e[k] for k in ("target_bytes", "planned_bytes", "reclaimed_bytes",
                               "shortfall_bytes")})
    zero = [k for k, v in by_event.items() if k[1] == "quota_cut" and v["target_bytes"] == 0]
    return {"events": len(by_event),
            **{k: int(sum(v[k] for v in by_event.values()))
               for k in ("target_bytes", "reclaimed_bytes", "shortfall_bytes")},
            "planned_bytes": int(sum(v["planned_bytes"] for v in by_event.values())),
            "zero_target_events": len(zero)}


def summarize(replay: Replay, reqs: list[dict], events: list[dict]) -> dict:
    """The policy's figures, overall and per tenant (see the module docstring), summed over
    replicas."""
    cfg, scheds, samples = replay.cfg, replay.scheds, replay.samples
    seconds = max(s.clock for s in scheds)
    ran = [p["step_s"] for p in samples if p["decode_rows"] or p["prefill_rows"]]
    summary = merged_summary(scheds)
    out = latency_figures(reqs, cfg, seconds)
    out.update({
        "preemptions": summary["preemptions"], "suspensions": summary["suspensions"],
        "refusals": summary["refusals"],  # every refusal (an admission retried counts again)
        **step_figures(samples, cfg, replay.sc.pool_sizes[0] * replay.sc.pool_bytes[0]),
        "p50_step_s": _pct(ran, 50),
        "p99_step_s": _pct(ran, 99), "steps": sum(s.t for s in scheds), "busy_steps": len(ran),
        "modelled_seconds": seconds, "steps_capped": replay.steps_capped,
        "never_submitted": len(replay.trace.requests) - len(reqs),
        "ledger_drift_bytes_max": max(max(d["bytes"], d["tokens"]) for d in replay.drift),
        "drift_checks": len(replay.drift),
        "fragmentation_bytes_max": max((p["fragmentation_bytes"] for p in samples), default=0),
        "fragmentation_bytes_mean": (float(np.mean([p["fragmentation_bytes"] for p in samples]))
                                     if samples else 0.0),
        "bytes_max": {k: max((p["bytes"][k] for p in samples), default=0)
                      for k in metrics.TIERS},
        **{name: summary[name] for name in metrics.RESUME_FIELDS},
        "finishes": summary["finishes"], "events": summary["events"],
        "reclaim": reclaim_figures(events),
    })
    by_tenant = collections.defaultdict(list)
    for r in reqs:
        by_tenant[str(r["tenant"])].append(r)
    out["tenants"] = {t: latency_figures(rs, cfg, seconds) for t, rs in sorted(by_tenant.items())}
    return out
