"""Where a load-test step's wall goes: every device call of the default trace's first STEPS steps
under POLICY, by core, waited for, and the rest of each step (the scheduler's host work).
Prints one JSON object; steps before and after the first quota cut are reported apart, each
phase's figures per step (mean over its steps; the first call of each shape, compiling or loading
it, included), and the floor of one device call on the state (`empty_call_ms`).

  python scripts/step_calls.py [STEPS [POLICY]]    # default: 11000 tiered

It wraps every jitted state core (`DonatingJit.__call__`), the ops' read-only queries and the cost
executor's step to wait for and time them; what the replay computes is unchanged, but waiting
for each call takes away the overlap of host work with the device's, so a step's wall here is an
upper bound of the load test's. Run it with the compilation cache of the CLIs
(~/.cache/kvquota/jax) warm."""

import collections
import dataclasses
import json
import sys
import time

import jax
import numpy as np

import kvquota.sim.loadtest as lt
from kvquota.core import compress, evict, release, tenants, tiers
from kvquota.core.jit import DonatingJit
from kvquota.serving import executors
from kvquota.serving.scheduler import Scheduler

import default_trace  # scripts/default_trace.py

# The read-only jitted queries the validating ops make (module, attribute).
QUERIES = ((tenants, "ledger_view"), (compress, "_count"), (evict, "_fresh_count"),
           (evict, "_fresh_block_count"), (release, "_leaves_orphans"), (tiers, "own_count"))


def main():
    steps, policy = default_trace.steps_and_policy("step_calls.py")
    cfg, trace, first_cut = default_trace.default_run("step_calls.py")
    step_calls = collections.Counter()  # (name, "calls" | "s") -> total, this step
    phases = {p: {"wall_s": [], "calls": collections.Counter()}
              for p in ("before_cut", "after_cut")}

    def timed(name, fn):
        def call(*a, **kw):
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*a, **kw))
            step_calls[name, "calls"] += 1
            step_calls[name, "s"] += time.perf_counter() - start
            return out
        return call

    original_call = DonatingJit.__call__
    DonatingJit.__call__ = lambda op, *a, **kw: timed(op.name, original_call)(op, *a, **kw)
    for module, name in QUERIES:
        setattr(module, name, timed(name, getattr(module, name)))
    executors._cost_step = timed("cost_step", executors._cost_step)
    original_step = Scheduler.step

    def step(sched, *args, **kwargs):
        phase = phases["after_cut" if sched.clock >= first_cut else "before_cut"]
        step_calls.clear()
        start = time.perf_counter()
        out = original_step(sched, *args, **kwargs)
        phase["wall_s"].append(time.perf_counter() - start)
        phase["calls"].update(step_calls)
        return out

    Scheduler.step = step
    replay = lt.Replay(dataclasses.replace(cfg, max_steps=steps), trace, policy)
    replay.run()
    out = {"command": " ".join(["python", "scripts/step_calls.py"] + sys.argv[1:]),
           "policy": policy,
           "steps": replay.sched.t, "first_cut_s": first_cut}
    for name, phase in phases.items():
        n = len(phase["wall_s"])
        if not n:
            continue
        wall = np.array(phase["wall_s"])
        calls = phase["calls"]
        names = sorted({k for k, _ in calls}, key=lambda k: -calls[k, "s"])
        device_ms = 1e3 * sum(calls[k, "s"] for k in names) / n
        out[name] = {
            "steps": n, "wall_ms_per_step": {"mean": round(1e3 * wall.mean(), 2),
                                             "median": round(1e3 * float(np.median(wall)), 2)},
            "device_calls_ms_per_step": round(device_ms, 2),
            "host_ms_per_step": round(1e3 * wall.mean() - device_ms, 2),
            "by_call": {k: {"calls_per_step": round(calls[k, "calls"] / n, 2),
                            "ms_per_step": round(1e3 * calls[k, "s"] / n, 3)} for k in names},
        }
    out["empty_call_ms"] = round(empty_call_ms(replay.sched.state), 3)
    print(json.dumps(out))


def empty_call_ms(state, calls=200):
    """The floor of any device call on the state: a donated identity (dispatch, every buffer of the
    state's pytree in and out), after the replay (the state is not used again)."""
    identity = jax.jit(lambda s: s, donate_argnums=0)
    state = jax.block_until_ready(identity(state))
    start = time.perf_counter()
    for _ in range(calls):
        state = identity(state)
    jax.block_until_ready(state)
    return 1e3 * (time.perf_counter() - start) / calls


if __name__ == "__main__":
    main()
