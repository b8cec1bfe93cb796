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


def summarize(replay: Replay, reqs: list[dict]) -> dict:
    """The policy's figures, overall and per tenant (see the module docstring)."""
    cfg, s, samples = replay.cfg, replay.sched, replay.samples
    seconds = s.clock
    ran = [p["step_s"] for p in samples if p["decode_rows"] or p["prefill_rows"]]
    jit = jitter(ran, cfg.jitter_window)
    summary = s.summary()
    out = latency_figures(reqs, cfg, seconds)
    out.update({
        "preemptions": summary["preemptions"], "suspensions": summary["suspensions"],
        "refusals": summary["refusals"],  # every refusal (an admission retried counts again)
        "p99_step_jitter_s": _pct(jit, 99), "p50_step_s": _pct(ran, 50),
        "p99_step_s": _pct(ran, 99), "steps": s.t, "busy_steps": len(ran),
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
    })
    by_tenant = collections.defaultdict(list)
    for r in reqs:
        by_tenant[str(r["tenant"])].append(r)
    out["tenants"] = {t: latency_figures(rs, cfg, seconds) for t, rs in sorted(by_tenant.items())}
    return out
