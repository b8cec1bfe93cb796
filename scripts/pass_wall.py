"""What multi-step scheduling (`--steps_per_pass`) buys on the load test's default trace: one
policy's replay for 2 x WARM steps at each STEPS_PER_PASS value, side by side in one process. Per
value: the wall per step over steps WARM..2 x WARM (the first WARM steps, which compile or load
their programs, are timed apart), and what the passes change in the replay by step 2 x WARM
(modelled clock, tokens generated, requests admitted, median modelled TTFT of the requests with
a first token). Prints one JSON object.

  python scripts/pass_wall.py [WARM [POLICY [STEPS_PER_PASS ...]]]   # default: 2000 tiered 1 4 16

Run it with the compilation cache of the CLIs (~/.cache/kvquota/jax) warm."""

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np

import kvquota.sim.loadtest as lt

import default_trace  # scripts/default_trace.py


def measure(cfg, trace, policy: str, warm: int, k: int) -> dict:
    stamps = {}  # step -> wall clock when its sample came

    def on_step(sample):
        stamps[sample["step"]] = time.perf_counter()

    start = time.perf_counter()
    rp = lt.Replay(dataclasses.replace(cfg, max_steps=2 * warm, steps_per_pass=k), trace, policy,
                   on_step=on_step)
    rp.run()
    s, last = rp.sched, max(stamps)
    ttft = [r.first_token_s - r.arrival_s for r in s.requests if r.first_token_s >= 0]
    return {"steps_per_pass": k, "first_steps_wall_s": round(stamps[warm - 1] - start, 1),
            "ms_per_step": round(1e3 * (stamps[last] - stamps[warm - 1]) / (last - warm + 1), 2),
            "steps": s.t, "clock_s": round(s.clock, 2),
            "generated_tokens": int(s.counters.total["generated_tokens"]),
            "admitted": sum(1 for r in s.requests if r.admitted >= 0),
            "p50_ttft_s": round(float(np.median(ttft)), 4)}


def main():
    args = sys.argv[1:]
    if (args and not args[0].isdigit()) or any(not a.isdigit() for a in args[2:]):
        sys.exit("usage: pass_wall.py [WARM [POLICY [STEPS_PER_PASS ...]]]")
    warm = int(args[0]) if args else 2000
    policy = args[1] if len(args) > 1 else "tiered"
    values = [int(a) for a in args[2:]] or [1, 4, 16]
    cfg, trace, _ = default_trace.default_run("pass_wall.py")
    rows = [measure(cfg, trace, policy, warm, k) for k in values]
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    print(json.dumps({
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": "python scripts/pass_wall.py " + " ".join(args), "revision": revision,
        "policy": policy, "warm_steps": warm, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
