"""Who makes a cut tenant's TTFT tail: two load-test runs of one trace (e.g. two releases), side
by side, for the requests of TENANT that arrived after its quota cut (read from the run's
trace.jsonl). Per run: the TTFT of all the tenant's requests with a first token, and of those
after the cut split by prompt size (>= BIG tokens: "big"), how many wait over 5 and 10 s, the ten
longest waits (with the prompt size and how many later arrivals of the tenant got their first
token first), and the preemptions. Prints one JSON object.

  python scripts/tenant_tail.py RUN_DIR_A RUN_DIR_B TENANT [BIG]   # BIG default: 6000

Each RUN_DIR is a `python -m experiments.loadtest` run directory (requests.jsonl, trace.jsonl);
with several policies in a run, POLICY=<name> in the environment picks one (default: the
first)."""

import json
import os
import pathlib
import sys

import numpy as np

from kvquota.serving.metrics import read_json_lines
from kvquota.sim.trace_io import load_trace


def cut_time(run: pathlib.Path, tenant: int) -> float:
    cuts = [e.time_s for e in load_trace(run / "trace.jsonl").events
            if e.kind == "quota_cut" and e.tenant == tenant]
    if not cuts:
        sys.exit(f"tenant_tail.py: {run}/trace.jsonl has no quota cut of tenant {tenant}")
    return min(cuts)


def tail(run: pathlib.Path, tenant: int, big: int) -> dict:
    requests = read_json_lines(run / "requests.jsonl")
    policy = os.environ.get("POLICY", requests[0]["policy"] if requests else "")
    cut = cut_time(run, tenant)
    mine = [r for r in requests if r["policy"] == policy and r["tenant"] == tenant
            and r["ttft_s"] is not None and r["ttft_s"] >= 0]
    after = [r for r in mine if r["arrival_s"] >= cut]
    if not after:
        sys.exit(f"tenant_tail.py: no request of tenant {tenant} under {policy!r} with a first "
                 f"token arrived after its cut in {run}")
    first = {r["id"]: r["arrival_s"] + r["ttft_s"] for r in after}

    def ttft(rows) -> dict:
        t = np.array([r["ttft_s"] for r in rows])
        if not len(t):
            return {"n": 0}
        p50, p90, p99 = np.percentile(t, [50, 90, 99])
        return {"n": len(t), "mean_s": round(float(t.mean()), 3), "p50_s": round(p50, 3),
                "p90_s": round(p90, 3), "p99_s": round(p99, 3), "max_s": round(float(t.max()), 3)}

    longest = sorted(after, key=lambda r: -r["ttft_s"])[:10]
    return {
        "run": str(run), "policy": policy, "cut_s": round(cut, 3), "all": ttft(mine),
        "big": ttft([r for r in after if r["prompt_tokens"] >= big]),
        "small": ttft([r for r in after if r["prompt_tokens"] < big]),
        "over_5_s": sum(r["ttft_s"] > 5 for r in after),
        "over_10_s": sum(r["ttft_s"] > 10 for r in after),
        "longest": [{"id": r["id"], "prompt_tokens": r["prompt_tokens"],
                     "ttft_s": round(r["ttft_s"], 2), "preemptions": r["preemptions"],
                     "overtaken_by": sum(q["arrival_s"] > r["arrival_s"]
                                         and first[q["id"]] < first[r["id"]] for q in after)}
                    for r in longest],
        "preempted_requests": sum(r["preemptions"] > 0 for r in after),
        "preemptions": sum(r["preemptions"] for r in after),
        "tokens_recomputed": sum(r["paid_resume_tokens"] for r in after),
    }


def main():
    args = sys.argv[1:]
    if len(args) not in (3, 4) or not all(a.isdigit() for a in args[2:]):
        sys.exit("usage: tenant_tail.py RUN_DIR_A RUN_DIR_B TENANT [BIG]")
    runs = [pathlib.Path(a) for a in args[:2]]
    for run in runs:
        if not (run / "requests.jsonl").is_file() or not (run / "trace.jsonl").is_file():
            sys.exit(f"tenant_tail.py: {run} holds no requests.jsonl and trace.jsonl")
    tenant, big = int(args[2]), int(args[3]) if len(args) == 4 else 6000
    out = {"command": " ".join(["python", "scripts/tenant_tail.py"] + args), "tenant": tenant,
           "big_prompt_tokens": big, "runs": [tail(run, tenant, big) for run in runs]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
