"""Where the load test's admission time goes: every admit call of the default trace's first
STEPS steps under POLICY, with its padded shape, the rows sent to the device and the rows the
host refused for sure, the device's answers (and whether each refused row had been tried
before), the prompt block entries against the padded ones, and the call's wall (waited for).
Prints one JSON object; steps before and after the first quota cut are reported apart.

  python scripts/admission_rows.py [STEPS [POLICY]]    # default: 11000 tiered

It wraps the facade's admit and the quota view's sure refusals to observe them; what the
replay computes is unchanged. Run it with the compilation cache of the CLIs
(~/.cache/kvquota/jax) warm, or the first call of each shape counts its compile."""

import collections
import dataclasses
import json
import sys
import time

import jax
import numpy as np

import kvquota.sim.loadtest as lt
from kvquota.allocator import Allocator
from kvquota.codes import REASONS
from kvquota.serving import quota_view
from kvquota.serving.scheduler import Scheduler

import default_trace  # scripts/default_trace.py


def main():
    steps, policy = default_trace.steps_and_policy("admission_rows.py")
    cfg, trace, first_cut = default_trace.default_run("admission_rows.py")
    block = cfg.block_size
    calls, rows, seen = [], collections.Counter(), set()
    replay, context = None, {}

    def admit(self, state, tenants, tokens, lengths, **kw):
        jax.block_until_ready(state)
        start = time.perf_counter()
        out = original_admit(self, state, tenants, tokens, lengths, **kw)
        jax.block_until_ready(out)
        real = tenants >= 0
        shape = tokens.shape
        calls.append(dict(after_cut=replay.sched.clock >= first_cut, shape=shape,
                          first_of_shape=shape not in seen, rows=int(real.sum()),
                          entries=int(((lengths[real] + block - 1) // block).sum()),
                          padded_entries=shape[0] * -(-shape[1] // block),
                          ms=1e3 * (time.perf_counter() - start)))
        seen.add(shape)
        return out

    def sure_refusals(self, batch):
        context["tried"] = [r in self.least for r in batch]
        out = original_sure(self, batch)
        context["sure"] = set(out)
        return out

    def admission_call(sched, batch):
        out = original_call(sched, batch)
        phase = "after_cut" if sched.clock >= first_cut else "before_cut"
        for i, (reason, _, _) in enumerate(out):
            where = "host" if i in context["sure"] else "device"
            tried = "tried before" if context["tried"][i] else "first try"
            rows[f"{phase}: {where}: {REASONS[reason]}: {tried}"] += 1
        return out

    original_admit, Allocator.admit = Allocator.admit, admit
    original_sure, quota_view.QuotaView.sure_refusals = (quota_view.QuotaView.sure_refusals,
                                                         sure_refusals)
    original_call, Scheduler._admission_call = Scheduler._admission_call, admission_call
    replay = lt.Replay(dataclasses.replace(cfg, max_steps=steps), trace, policy)
    replay.run()
    out = {"command": " ".join(["python", "scripts/admission_rows.py"] + sys.argv[1:]),
           "policy": policy,
           "steps": replay.sched.t, "first_cut_s": first_cut, "rows": dict(sorted(rows.items()))}
    for phase, after in (("before_cut", False), ("after_cut", True)):
        mine = [c for c in calls if c["after_cut"] == after]
        warm = [c for c in mine if not c["first_of_shape"]]
        if len(warm) < 2:  # STEPS ended before the cut, or too few calls to fit
            continue
        x = np.array([c["padded_entries"] for c in warm], float)
        y = np.array([c["ms"] for c in warm])
        slope, fixed = np.linalg.lstsq(np.vstack([x, np.ones_like(x)]).T, y, rcond=None)[0]
        out[phase] = {
            "calls": len(mine), "shapes_first_seen": sum(c["first_of_shape"] for c in mine),
            "first_calls_s": round(sum(c["ms"] for c in mine if c["first_of_shape"]) / 1e3, 1),
            "other_calls_s": round(float(y.sum()) / 1e3, 1),
            "rows_per_call": round(float(np.mean([c["rows"] for c in mine])), 1),
            "entries": sum(c["entries"] for c in mine),
            "padded_entries": sum(c["padded_entries"] for c in mine),
            "fit_ms": {"per_padded_entry": round(float(slope), 6), "fixed": round(float(fixed), 2)},
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
