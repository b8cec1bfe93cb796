"""The small real case: does the cost model rank the reclaim policies as measured step times do?

A small trace (64 requests, short prompts, a pool under pressure, quota cuts and a lease
expiry) is replayed under every policy through the same scheduler and replay
(`kvquota.sim.loadtest.Replay`): with the `ModelExecutor` running SmolLM2-135M on its paged
cache (f32 pages, on the CPU here; each step's wall time measured) and with the
`CostModelExecutor` on the same state shape without pages. Arrivals and events go by step count
(`step_clock`), not by either clock, and the cost model's stand-in tokens never stop early while
the model's greedy tokens may only stop at max_new_tokens (no stop ids): both runs make the same
scheduling decisions (checked: `same_schedule`), so they differ only in what a step costs.

Two cost models are compared with the measurement, both the executor's formula
(`CostModelExecutor.modelled_seconds`: overhead + KV bytes read / bandwidth + prefill tokens /
rate + host bytes / host bandwidth):

* `h200`: the load test's H200 constants. On a 135M model a step there is almost all weights,
  so it ranks the policies by their numbers of steps and little else, on another machine's
  balance: reported beside the calibrated one, not relied on.
* `calibrated`: the same formula with its constants fitted to this CPU (non-negative least
  squares of measured step seconds on the terms) on a *different* trace (`CALIBRATION_SEED`)
  under every policy, then used unchanged on the checked trace: a check of the model's form
  (which costs matter), out of sample. The model executor moves host pages in the reclaim call,
  not in the step, so the host term is fitted like the others (0 if the steps do not pay it).

Timing noise: every measured replay runs `repeats` times (the schedule is the same each time:
checked) and a step's time is its minimum over the repeats; every policy runs once untimed first
(compiles). Per policy: the busy seconds (sum of the step times: the same work, priced), the mean
step time and the mean TTFT (recomputed on each clock from the steps of arrival and first token),
measured and under each model; the rankings (fastest first) and Kendall's tau between the
measured ranking and each model's.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
from scipy.optimize import nnls

from kvquota.sim import loadtest as lt
from kvquota.sim.traces import TraceConfig, generate_trace

MODEL = "smollm2-135m"
STEP_CLOCK = 0.02  # trace seconds per scheduler step
CHECK_SEED, CALIBRATION_SEED = 0, 1
KEYS = ("busy_s", "mean_step_s", "mean_ttft_s")  # what the policies are ranked by


def small_trace(seed: int = CHECK_SEED, requests: int = 64, **overrides):
    """Three tenants on a 40-block pool: ~8 rows of ~150 tokens want more than its 640 token
    slots, and four cuts to half a share take KV back from tenants that keep running (a cut
    that leaves a tenant nothing ends its work for good, the same under every policy)."""
    return generate_trace(TraceConfig(**{**dict(
        seed=seed, requests=requests, tenants=3, groups=1, system_prompt_tokens=48,
        rate_per_s=25.0, prompt_mean=112, prompt_max=224, output_mean=16, output_max=32,
        followup_mean=24, followup_sigma=0.5, session_fraction=0.4, turns_mean=2.5,
        think_time_mean_s=0.1, context_max=400, vocab_size=49152, quota_cuts=4, cut_to=0.5,
        lease_expiries=1), **overrides}))


def configs(config):
    """The paged state (f32 pages) and the load config both executors run under."""
    import kvquota as kq

    sc = kq.StateConfig(config, num_blocks=40, block_size=16, max_seqs=8,
                        max_blocks_per_seq=26, num_tenants=4, kv_format="f32",
                        compressed_pools=(("int8", 16),), host_blocks=64,
                        keep_cold_blocks=True)
    load = lt.LoadConfig(model=MODEL, kv_format="f32", blocks=sc.num_blocks, max_seqs=8,
                         max_blocks_per_seq=26, num_tenants=4, token_budget=72, max_admit=4,
                         prefill_rows=1, chunk_size=64, drift_every=25, max_steps=4000,
                         tp=1, replicas=1, cost=lt.CostConstants(
                             step_overhead_s=0.0, plan_s=0.0, host_step_s=float("inf")))
    return sc, load


def _logged(ex):
    """Wraps ex.step to log, per call, the cost model's terms (block reads per pool: cost model
    only, prefill tokens, host bytes) and the step's seconds. Returns ex; ex.log is the list."""
    step = ex.step
    ex.log = []

    def logged(state, batch):
        state, out = step(state, batch)
        ex.log.append((np.asarray(out.block_reads, np.int64).copy(), int(batch.prefill_tokens),
                       int(batch.host_bytes), float(out.seconds)))
        return state, out

    ex.step = logged
    return ex


def _replay(load, trace, policy, ex, vocab) -> dict:
    """One replay: its schedule, the executor's log, and each request's steps of arrival and
    first token (found on the replay's own clock), so a TTFT can be priced on any clock."""
    ex.log = []
    rp = lt.Replay(load, trace, policy, ex=ex, vocab=vocab, step_clock=STEP_CLOCK)
    rp.run()
    clock = np.asarray(rp.clock_at[0])  # clock_at[0][k]: the clock when step k began
    spans = []  # (arrival step, step the first token's clock is at the start of)
    for r in rp.sched.requests:
        if r.first_token_s >= 0:
            f = int(np.searchsorted(clock, r.first_token_s))
            assert clock[f] == r.first_token_s and r.arrival < f
            spans.append((r.arrival, f))
    busy = [k for k, p in enumerate(rp.samples) if p["decode_rows"] or p["prefill_rows"]]
    assert len(busy) == len(ex.log), "one executor call per busy step"
    return {"replay": rp, "schedule": [(p["decode_rows"], p["prefill_rows"])
                                       for p in rp.samples],
            "busy": busy, "log": list(ex.log), "spans": spans, "steps": len(rp.samples),
            "preemptions": rp.sched.summary()["preemptions"],
            "suspensions": rp.sched.summary()["suspensions"],
            "drift_max": max(max(d["bytes"], d["tokens"]) for d in rp.drift)}


def _terms(run: dict, pool_bytes) -> np.ndarray:
    """[busy steps, 4]: 1, KV bytes read, prefill tokens, host bytes (the formula's terms)."""
    return np.asarray([[1.0, float((reads * pool_bytes).sum()), pre, host]
                       for reads, pre, host, _ in run["log"]])


def fit_constants(terms: np.ndarray, seconds: np.ndarray) -> dict:
    """Non-negative least squares of step seconds on the terms, as the cost model's constants
    (a zero coefficient: that term costs nothing here, its bandwidth or rate infinite)."""
    scale = np.maximum(np.abs(terms).max(axis=0), 1.0)  # conditioning: bytes are ~1e6
    coef = nnls(terms / scale, seconds)[0] / scale
    inv = [float(1.0 / c) if c > 0 else None for c in coef[1:]]  # None: infinite
    return {"step_overhead_s": float(coef[0]), "hbm_bandwidth": inv[0],
            "prefill_tokens_per_s": inv[1], "host_bandwidth": inv[2], "weight_bytes": 0}


def _priced(run: dict, seconds) -> dict:
    """A policy's figures on the clock its busy steps' seconds make."""
    per_step = np.zeros(run["steps"])
    per_step[run["busy"]] = seconds
    clock = np.concatenate([[0.0], np.cumsum(per_step)])
    ttft = [clock[f] - clock[a] for a, f in run["spans"]]
    return {"busy_s": float(np.sum(seconds)), "mean_step_s": float(np.mean(seconds)),
            "mean_ttft_s": float(np.mean(ttft))}


def kendall_tau(a: list, b: list) -> float:
    """Kendall's tau between two rankings of the same items (1: same order)."""
    pos_a, pos_b = {x: i for i, x in enumerate(a)}, {x: i for i, x in enumerate(b)}
    pairs = list(itertools.combinations(a, 2))
    s = sum(np.sign(pos_a[x] - pos_a[y]) * np.sign(pos_b[x] - pos_b[y]) for x, y in pairs)
    return float(s / len(pairs)) if pairs else 1.0


def _measure(load, trace, policies, real_ex, vocab, repeats) -> dict:
    """Per policy: the replay, its step seconds the minimum over `repeats` timed runs."""
    out = {}
    for policy in policies:
        runs = [_replay(load, trace, policy, real_ex, vocab) for _ in range(repeats)]
        if any(r["schedule"] != runs[0]["schedule"] for r in runs):
            raise AssertionError(f"{policy}: the repeats made different schedules")
        runs[0]["seconds"] = np.min([[s for *_, s in r["log"]] for r in runs], axis=0)
        out[policy] = runs[0]
    return out


def run_check(policies, repeats: int = 2) -> dict:
    import kvquota as kq

    config, params = kq.load_pretrained(MODEL)
    sc, load = configs(config)
    vocab = config.vocab_size
    real_ex = _logged(kq.serving.ModelExecutor(config, params, sc, prefill_rows=1,
                                               chunk_size=64, chunk_floor=64))
    cost_ex = _logged(lt.executor(load, dataclasses.replace(sc, with_pages=False)))
    pool_bytes = np.asarray(cost_ex.state_config.pool_bytes, float)
    check, calib = small_trace(CHECK_SEED), small_trace(CALIBRATION_SEED)
    start = time.perf_counter()
    for policy in policies:  # compiles every shape the timed runs meet
        _replay(load, check, policy, real_ex, vocab)
    warm = time.perf_counter() - start

    def both(trace):
        measured = _measure(load, trace, policies, real_ex, vocab, repeats)
        modelled = {p: _replay(load, trace, p, cost_ex, vocab) for p in policies}
        same = all(measured[p]["schedule"] == modelled[p]["schedule"] for p in policies)
        return measured, modelled, same

    cal_measured, cal_modelled, cal_same = both(calib)
    terms = np.concatenate([_terms(cal_modelled[p], pool_bytes) for p in policies])
    seconds = np.concatenate([cal_measured[p]["seconds"] for p in policies])
    constants = fit_constants(terms, seconds)
    calibrated = kq.serving.CostModelExecutor(cost_ex.state_config, tp=1, **{
        k: float("inf") if v is None else v for k, v in constants.items()})
    measured, modelled, same = both(check)

    out, fit = {}, {"measured": [], "calibrated": []}
    for p in policies:
        m, c = measured[p], modelled[p]
        cal_s = [calibrated.modelled_seconds(reads, pre, host) for reads, pre, host, _ in c["log"]]
        fit["measured"] += list(m["seconds"])
        fit["calibrated"] += cal_s
        out[p] = {"steps": len(c["busy"]), "preemptions": c["preemptions"],
                  "suspensions": c["suspensions"], "drift_max": max(m["drift_max"],
                                                                    c["drift_max"]),
                  "measured": _priced(c, m["seconds"]),
                  "h200": _priced(c, [s for *_, s in c["log"]]),
                  "calibrated": _priced(c, cal_s)}
    rank = {}
    for key in KEYS:
        for side in ("measured", "h200", "calibrated"):
            rank[f"{side}_{key}"] = sorted(policies, key=lambda p: out[p][side][key])
        for side in ("h200", "calibrated"):
            rank[f"tau_{side}_{key}"] = kendall_tau(rank[f"measured_{key}"],
                                                    rank[f"{side}_{key}"])
    y, yhat = np.asarray(fit["measured"]), np.asarray(fit["calibrated"])
    r2 = 1.0 - float(np.sum((y - yhat) ** 2) / np.sum((y - y.mean()) ** 2))
    return {"model": MODEL, "requests": len(check.requests), "pool_blocks": sc.num_blocks,
            "step_clock_s": STEP_CLOCK, "repeats": repeats, "same_schedule": same and cal_same,
            "warmup_s": warm, "calibration_seed": CALIBRATION_SEED, "check_seed": CHECK_SEED,
            "calibration_steps": len(seconds), "constants_cpu": constants,
            "step_r2_out_of_sample": r2, "policies": out, "ranking": rank}


def _rate(v, scale: float, unit: str) -> str:
    return "free (fitted 0 s)" if v is None else f"{v / scale:.4g} {unit}"


def describe(m: dict) -> str:
    r, c = m["ranking"], m["constants_cpu"]
    lines = [f"Small real case: {m['model']} on CPU, {m['requests']} requests, pool "
             f"{m['pool_blocks']} blocks; same schedule in every run: {m['same_schedule']}",
             f"CPU constants fitted on trace seed {m['calibration_seed']} "
             f"({m['calibration_steps']} steps): overhead {c['step_overhead_s'] * 1e3:.2f} ms, "
             f"KV {_rate(c['hbm_bandwidth'], 1e9, 'GB/s')}, prefill "
             f"{_rate(c['prefill_tokens_per_s'], 1, 'tokens/s')}, host "
             f"{_rate(c['host_bandwidth'], 1e9, 'GB/s')}; per-step R^2 on the checked trace: "
             f"{m['step_r2_out_of_sample']:.3f}",
             "| policy | steps | preemptions | suspensions | busy s measured | busy s "
             "calibrated | busy s H200 | mean TTFT s measured | mean TTFT s calibrated | mean "
             "TTFT s H200 |", "|" + "---|" * 10]
    for p, v in m["policies"].items():
        a, b, h = v["measured"], v["calibrated"], v["h200"]
        lines.append(f"| {p} | {v['steps']} | {v['preemptions']} | {v['suspensions']} | "
                     f"{a['busy_s']:.3f} | {b['busy_s']:.3f} | {h['busy_s']:.3e} | "
                     f"{a['mean_ttft_s']:.3f} | {b['mean_ttft_s']:.3f} | "
                     f"{h['mean_ttft_s']:.3e} |")
    for key in KEYS:
        lines.append(f"ranking by {key} (fastest first): measured {r['measured_' + key]}, "
                     f"calibrated {r['calibrated_' + key]} (tau "
                     f"{r['tau_calibrated_' + key]:.2f}), H200 {r['h200_' + key]} (tau "
                     f"{r['tau_h200_' + key]:.2f})")
    return "\n".join(lines)
