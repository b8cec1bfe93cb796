"""The small real case: does the cost model rank the reclaim policies as measured step times do?

One small trace (tens of requests, short prompts, a quota cut and a lease expiry) is replayed
under every policy twice through the same scheduler and replay (`kvquota.sim.loadtest.Replay`):
once with the `ModelExecutor` running SmolLM2-135M on its paged cache (f32 pages, on the CPU
here: each step's wall time is measured), once with the `CostModelExecutor` on the same state
shape without pages (H200 figures). Arrivals and events go by step count (`step_clock`), not by
either clock, and the cost model's stand-in tokens never stop early while the model's greedy
tokens may only stop at max_new_tokens (no stop ids): both runs make the same scheduling
decisions, so they differ only in what a step costs. Every policy runs once untimed first
(compiles). Reported: per policy the mean and median step time and the mean TTFT, measured and
modelled, and the two rankings (fastest first) with Kendall's tau between them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from kvquota.sim import loadtest as lt
from kvquota.sim.traces import TraceConfig, generate_trace

MODEL = "smollm2-135m"
STEP_CLOCK = 0.02  # trace seconds per scheduler step


def small_trace(seed: int = 0, requests: int = 32):
    return generate_trace(TraceConfig(
        seed=seed, requests=requests, tenants=3, groups=1, system_prompt_tokens=48,
        rate_per_s=25.0, prompt_mean=112, prompt_max=224, output_mean=16, output_max=32,
        followup_mean=24, followup_sigma=0.5, session_fraction=0.4, turns_mean=2.5,
        think_time_mean_s=0.1, context_max=400, vocab_size=49152, quota_cuts=2, cut_to=0.3,
        lease_expiries=1))


def _configs():
    import kvquota as kq

    config, params = kq.load_pretrained(MODEL)
    sc = kq.StateConfig(config, num_blocks=40, block_size=16, max_seqs=8,
                        max_blocks_per_seq=26, num_tenants=4, kv_format="f32",
                        compressed_pools=(("int8", 16),), host_blocks=64,
                        keep_cold_blocks=True)
    load = lt.LoadConfig(model=MODEL, kv_format="f32", blocks=sc.num_blocks, max_seqs=8,
                         max_blocks_per_seq=26, num_tenants=4, token_budget=72, max_admit=4,
                         prefill_rows=1, chunk_size=64, drift_every=25, max_steps=4000,
                         cost=lt.CostConstants(step_overhead_s=0.0))  # only what varies
    return config, params, sc, load


def _replay(load, trace, policy, ex, vocab):
    rp = lt.Replay(load, trace, policy, ex=ex, vocab=vocab, step_clock=STEP_CLOCK)
    rp.run()
    reqs = rp.request_records()
    ran = [p["step_s"] for p in rp.samples if p["decode_rows"] or p["prefill_rows"]]
    ttft = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    return {"steps": len(ran), "mean_step_s": float(np.mean(ran)),
            "median_step_s": float(np.median(ran)), "mean_ttft_s": float(np.mean(ttft)),
            "preemptions": rp.sched.summary()["preemptions"],
            "suspensions": rp.sched.summary()["suspensions"],
            "drift_max": max(max(d["bytes"], d["tokens"]) for d in rp.drift),
            "schedule": [(p["decode_rows"], p["prefill_rows"]) for p in rp.samples]}


def kendall_tau(a: list, b: list) -> float:
    """Kendall's tau between two rankings of the same items (1: same order)."""
    pos_a, pos_b = {x: i for i, x in enumerate(a)}, {x: i for i, x in enumerate(b)}
    pairs = list(itertools.combinations(a, 2))
    s = sum(np.sign(pos_a[x] - pos_a[y]) * np.sign(pos_b[x] - pos_b[y]) for x, y in pairs)
    return float(s / len(pairs)) if pairs else 1.0


def run_check(policies, seed: int = 0) -> dict:
    import kvquota as kq

    config, params, sc, load = _configs()
    trace = small_trace(seed)
    vocab = config.vocab_size
    real_ex = kq.serving.ModelExecutor(config, params, sc, prefill_rows=1, chunk_size=64,
                                       chunk_floor=64)
    cost_ex = lt.executor(load, dataclasses.replace(sc, with_pages=False))
    start = time.perf_counter()
    for policy in policies:  # compiles every shape the timed runs meet
        _replay(load, trace, policy, real_ex, vocab)
    warm = time.perf_counter() - start
    out = {}
    for policy in policies:
        out[policy] = {"measured": _replay(load, trace, policy, real_ex, vocab),
                       "modelled": _replay(load, trace, policy, cost_ex, vocab)}
    same = all(v["measured"].pop("schedule") == v["modelled"].pop("schedule")
               for v in out.values())
    rank = {}
    for key in ("mean_step_s", "mean_ttft_s"):
        for side in ("measured", "modelled"):
            rank[f"{side}_{key}"] = sorted(policies, key=lambda p: out[p][side][key])
        rank[f"tau_{key}"] = kendall_tau(rank[f"measured_{key}"], rank[f"modelled_{key}"])
    return {"model": MODEL, "requests": len(trace.requests), "pool_blocks": sc.num_blocks,
            "step_clock_s": STEP_CLOCK, "same_schedule": same, "warmup_s": warm,
            "policies": out, "ranking": rank}


def describe(m: dict) -> str:
    r = m["ranking"]
    lines = [f"Small real case: {m['model']} on CPU, {m['requests']} requests, pool "
             f"{m['pool_blocks']} blocks; same schedule in both runs: {m['same_schedule']}",
             "| policy | steps | measured mean step s | modelled mean step s | measured mean "
             "TTFT s | modelled mean TTFT s | preemptions | suspensions |", "|" + "---|" * 8]
    for p, v in m["policies"].items():
        a, b = v["measured"], v["modelled"]
        lines.append(f"| {p} | {a['steps']} | {a['mean_step_s']:.4f} | {b['mean_step_s']:.2e} |"
                     f" {a['mean_ttft_s']:.3f} | {b['mean_ttft_s']:.2e} | {a['preemptions']} |"
                     f" {a['suspensions']} |")
    for key in ("mean_step_s", "mean_ttft_s"):
        lines.append(f"ranking by {key} (fastest first): measured {r['measured_' + key]}, "
                     f"modelled {r['modelled_' + key]}, Kendall tau {r['tau_' + key]:.2f}")
    return "\n".join(lines)
