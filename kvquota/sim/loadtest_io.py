"""The load test's run: every policy replayed on one trace, its files, table and plots.

`measure` writes into a run directory (experiments/runs.py): trace.jsonl (the replayed trace:
replay it exactly with --trace), points.jsonl (one compact sample per step and policy),
requests.jsonl (one record per request and policy), summary.md (the table), and returns the
summary that becomes metrics.json. `merge_runs` writes the same files from runs of disjoint
policies on one trace, made apart (one job per policy). `plot` draws latency_cdf.png and
bytes_timeline.png from those files only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import time
from typing import Optional

import jax
import numpy as np

from kvquota.errors import InvalidArgumentError
from kvquota.serving.metrics import read_json_lines
from kvquota.serving.requests import RequestStatus
from kvquota.sim import figures
from kvquota.sim import loadtest as lt
from kvquota.sim.trace_io import save_trace
from kvquota.sim.trace_io import trace_summary

REQUESTS, POINTS = "requests.jsonl", "points.jsonl"  # as experiments/runs.py names them
CONFIG, METRICS, TRACE = "config.json", "metrics.json", "trace.jsonl"


def as_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def with_tenants(cfg: lt.LoadConfig, n: int) -> lt.LoadConfig:
    return dataclasses.replace(cfg, num_tenants=n)


def file_sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def setup_figures(cfg: lt.LoadConfig) -> dict:
    """The modelled deployment (replicas x tp devices), bytes per replica, the cost constants
    resolved."""
    sc = lt.state_config(cfg)
    ex = lt.executor(cfg, sc)
    return {"replicas": cfg.replicas, "tp": ex.tp, "devices": cfg.replicas * ex.tp,
            "hbm_used_share": lt.hbm_needed(cfg),
            "device_pool_bytes_per_replica": lt.device_bytes(sc), "weight_bytes": ex.weight_bytes,
            "block_bytes": sc.pool_bytes[0], "pool_blocks": list(sc.pool_sizes),
            "pool_bytes_per_block": list(sc.pool_bytes),
            "prefill_tokens_per_s_per_device": ex.prefill_tokens_per_s,
            "hbm_bandwidth": ex.hbm_bandwidth, "host_bandwidth": ex.host_bandwidth,
            "nvlink_bandwidth": ex.nvlink_bandwidth,
            "allreduce_latency_s": ex.allreduce_latency_s, "host_step_s": ex.host_step_s,
            "host_step_bytes": ex.host_step_bytes, "plan_s": ex.plan_s,
            "allreduce_s_per_decode_token_step": ex.allreduce_seconds(1),
            "step_overhead_s": ex.step_overhead_s}


def _point_writer(points):
    return lambda p: points.write(json.dumps({**p, "load_average_1min": os.getloadavg()[0]})
                                  + "\n")


COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")  # the last: XLA, or a cache load
# Per-policy fields that measure the process, not the replay (they differ run to run).
PROCESS_FIELDS = ("wall_s", "shared_wall_s", "compile_s", "shared_compile_s", "compiled_programs",
                  "cpu_s", "program_cache_clears")
_compiling = {"seconds": 0.0, "programs": 0, "listening": False}  # this process's, so far


def _compile_totals() -> tuple[float, int]:
    """(seconds tracing, lowering and compiling, programs compiled) in this process so far, from
    jax.monitoring (a persistent-cache hit counts as a compile that took its load time)."""
    if not _compiling["listening"]:
        def on_duration(event, seconds, **_):
            if event in COMPILE_EVENTS:
                _compiling["seconds"] += seconds
                _compiling["programs"] += event == COMPILE_EVENTS[-1]

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        _compiling["listening"] = True
    return _compiling["seconds"], _compiling["programs"]


class ProgramMemoryGuard:
    """Keeps this process under the kernel's limit on memory mappings (`vm.max_map_count`, 65,530
    by default): XLA's CPU backend maps every compiled kernel's code and data separately
    (hundreds of mappings per load-test program: 41,000 after ~110 programs, measured), and a
    long replay keeps compiling new shapes, so a 2x10^4-request worker crashed past the limit
    ("LLVM compilation error: Cannot allocate memory", then a segfault). Every `every` calls it
    counts the mappings (Linux: /proc); past `share` of the limit it drops jax's compiled
    programs (`jax.clear_caches`), which unmaps them; the next calls reload them from the
    persistent cache. Results do not change: the same programs run. `clears` counts the drops."""

    def __init__(self, every: int = 2000, share: float = 0.6):
        self.every, self.share, self.calls, self.clears = every, share, 0, 0
        try:
            with open("/proc/sys/vm/max_map_count") as limit:
                self.limit = int(limit.read())
        except (OSError, ValueError):
            self.limit = None  # not Linux: nothing to watch

    def __call__(self, *_):
        self.calls += 1
        if self.limit is None or self.calls % self.every:
            return
        with open("/proc/self/maps") as maps:
            count = sum(1 for _ in maps)
        if count > self.share * self.limit:
            jax.clear_caches()
            self.clears += 1


class Progress:
    """One line on stderr every `every_s` seconds of wall per policy: steps, modelled time,
    requests ended (off: `every_s` None)."""

    def __init__(self, policy: str, replay, every_s: Optional[float]):
        self.policy, self.replay, self.every_s = policy, replay, every_s
        self.last = time.perf_counter()

    def __call__(self, force: bool = False):
        now = time.perf_counter()
        if self.every_s is None or not force and now - self.last < self.every_s:
            return
        self.last = now
        rp = self.replay
        ended = sum(1 for s in rp.scheds for r in s.requests if r.status in
                    (RequestStatus.FINISHED, RequestStatus.REFUSED))
        print(f"[loadtest {self.policy}] steps {sum(s.t for s in rp.scheds):,}, modelled "
              f"{rp.now():,.1f} s, requests ended {ended:,}/{len(rp.trace.requests):,}",
              file=sys.stderr, flush=True)


def replay_policies(cfg: lt.LoadConfig, trace, policies, points_paths,
                    progress_s: Optional[float] = None) -> list:
    """Each policy's replay: [(summary, request records)] in `policies` order. The stretch
    before the trace's first event is replayed once and forked per policy (`Replay.fork`: the
    same steps a fresh replay gives; the last policy goes on with that replay itself); each
    policy's step samples, that stretch's included, are appended to its `points_paths` file
    (JSONL). Top-level, so worker processes can run it."""
    start, (compile0, programs0) = time.perf_counter(), _compile_totals()
    cpu0 = time.process_time()
    base = lt.Replay(cfg, trace, policies[0], ex=lt.executor(cfg))  # one jit cache for all
    tick = Progress("+".join(policies) + " (before the first event)", base, progress_s)
    guard = ProgramMemoryGuard()
    base.on_step = lambda _: (tick(), guard())
    base.run(until_first_event=True)
    shared_s, shared_steps, out = time.perf_counter() - start, sum(s.t for s in base.scheds), []
    shared_cpu = time.process_time() - cpu0
    shared_compile = _compile_totals()
    for k, (policy, path) in enumerate(zip(policies, points_paths)):
        begin, (compile1, programs1) = time.perf_counter(), _compile_totals()
        cpu1, clears1 = time.process_time(), guard.clears
        with open(path, "a") as points:
            write = _point_writer(points)
            rp = base.fork(policy, copy=k + 1 < len(policies))  # the last: base
            tick = Progress(policy, rp, progress_s)
            rp.on_step = lambda p: (write(p), tick(), guard())
            for p in rp.samples:
                write(p)
            rp.run()
            tick(force=True)
        reqs, events = rp.request_records(), rp.event_records()
        result = figures.summarize(rp, reqs, events)
        result["event_plans"] = events
        result["cpu_s"] = shared_cpu + time.process_time() - cpu1
        result["drift_checks_log"] = rp.drift
        result["shared_steps"] = shared_steps  # steps before the first event, run once
        result["shared_wall_s"] = shared_s  # their wall, shared by `policies`
        result["wall_s"] = shared_s + time.perf_counter() - begin
        compile2, programs2 = _compile_totals()  # of wall_s: compiling (as shared_wall_s)
        result["shared_compile_s"] = shared_compile[0] - compile0
        result["compile_s"] = result["shared_compile_s"] + compile2 - compile1
        result["compiled_programs"] = shared_compile[1] - programs0 + programs2 - programs1
        result["program_cache_clears"] = guard.clears - clears1
        out.append((result, reqs))
    return out


def measure(cfg: lt.LoadConfig, trace, policies, run, real_check: bool = False,
            jobs: int = 1, progress_s: Optional[float] = None) -> dict:
    """Replays `trace` under each policy (as if on a fresh state and scheduler each: see
    `replay_policies`), writing the run directory's files; returns the summary (metrics.json).
    With `jobs` > 1 the policies are dealt round-robin to that many worker processes (each
    compiles once and replays the stretch before the first event once); files and figures are
    the same as one process gives, in policy order (only the load averages recorded with the
    points differ)."""
    out = pathlib.Path(run.path)
    save_trace(trace, out / "trace.jsonl")
    parts = [out / f".points-{i}.part" for i in range(len(policies))]
    for part in parts:
        part.unlink(missing_ok=True)
    n = min(jobs, len(policies))
    shares = [list(range(k, len(policies), n)) for k in range(n)]  # policy indices per worker
    if n > 1:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds XLA
        with concurrent.futures.ProcessPoolExecutor(n, ctx) as pool:
            futures = [pool.submit(replay_policies, cfg, trace, [policies[i] for i in share],
                                   [parts[i] for i in share], progress_s) for share in shares]
            got = [f.result() for f in futures]
    else:
        got = [replay_policies(cfg, trace, policies, parts, progress_s)]
    by_index = {i: r for share, rs in zip(shares, got) for i, r in zip(share, rs)}
    done = [by_index[i] for i in range(len(policies))]
    results = {}
    with open(out / REQUESTS, "w") as f:
        for policy, (result, reqs) in zip(policies, done):
            for r in reqs:
                f.write(json.dumps(r) + "\n")
            results[policy] = result
    with open(out / POINTS, "a") as f:
        for part in parts:
            with open(part) as src:
                shutil.copyfileobj(src, f)
            part.unlink()
    summary = {"requests": len(trace.requests), "blocks": lt.replica_blocks(cfg) * cfg.replicas,
               "setup": setup_figures(cfg), "trace_summary": trace_summary(trace),
               "slo": {"ttft_s": cfg.slo_ttft_s, "tpot_s": cfg.slo_tpot_s},
               "policies": results}
    summary["table"] = table(summary)
    if real_check:
        from kvquota.sim import realcheck

        summary["real_check"] = realcheck.run_check(list(policies))
        summary["table"] += "\n\n" + realcheck.describe(summary["real_check"])
    (out / "summary.md").write_text(summary["table"] + "\n")
    return summary


def mergeable(sources) -> tuple[list, list]:
    """(config.json, metrics.json) of each run directory in `sources`, if `merge_runs` can merge
    them: at least two complete load-test runs of disjoint policies, made at the same commit
    from the same load config and trace (byte for byte), without the real check. Else
    InvalidArgumentError naming the first run that cannot be merged and why."""
    sources = [pathlib.Path(s) for s in sources]
    if len(sources) < 2:
        raise InvalidArgumentError("merging needs at least two run directories")
    configs, summaries = zip(*(_read_run(src) for src in sources))
    configs, summaries = list(configs), list(summaries)
    policies = [p for s in summaries for p in s["policies"]]
    if len(set(policies)) != len(policies):
        raise InvalidArgumentError(f"the runs share a policy: {policies}")
    for src, c, s in zip(sources, configs, summaries):
        why = _unmergeable(c, s, configs[0], summaries[0])
        if why:
            raise InvalidArgumentError(f"cannot merge {src}: {why}")
    traces = [file_sha256(src / TRACE) for src in sources]  # each read once, the others fit
    for src, trace in zip(sources, traces):
        if trace != traces[0]:
            raise InvalidArgumentError(f"cannot merge {src}: its trace.jsonl differs")
    return configs, summaries


def _read_run(src: pathlib.Path) -> tuple[dict, dict]:
    """(config.json, metrics.json) of the finished load-test run in `src`, else
    InvalidArgumentError (another experiment's run, a run cut short, a file that is not JSON)."""
    for name in (METRICS, CONFIG, TRACE):
        if not (src / name).is_file():
            raise InvalidArgumentError(f"{src} holds no complete load-test run (no {name})")
    try:
        config, summary = (json.loads((src / name).read_text()) for name in (CONFIG, METRICS))
    except ValueError as error:
        raise InvalidArgumentError(f"cannot merge {src}: a file is not JSON ({error})") from None
    if not (isinstance(config, dict) and config.get("experiment") == "loadtest"
            and isinstance(summary, dict) and "policies" in summary):
        raise InvalidArgumentError(f"cannot merge {src}: it is not a load-test run")
    return config, summary


def _unmergeable(config: dict, summary: dict, first: dict, first_summary: dict) -> str:
    """Why a run (its config.json and metrics.json) cannot be merged with the first one ("" if
    it can; the traces are compared apart)."""
    def settings(c):  # everything that decides a measurement but the policies
        return {k: v for k, v in c["config"].items() if k != "policies"}

    if config["config"].get("real_check"):
        return "it ran the real check"
    if config["git_commit"] != first["git_commit"]:
        return f"commit {config['git_commit']} != {first['git_commit']}"
    if settings(config) != settings(first):
        return "its load or trace config differs"
    if any(summary[k] != first_summary[k] for k in ("setup", "trace_summary", "slo")):
        return "its setup figures differ"
    return ""


def merge_runs(sources, out_dir, checked=None) -> dict:
    """Merge the runs `sources` (`mergeable`) into `out_dir`, as one run of all their policies
    would have written it (a policy's replay never depends on the others, so its figures are
    the same): requests.jsonl and points.jsonl concatenated in `sources` order, the trace
    copied, the per-policy figures side by side, the table. Returns the summary (metrics.json's
    figures), which names the sources, their commands, commits and wall times
    (`merged_from`). checked: `mergeable(sources)`'s answer where the caller already has it
    (then the runs are not read and their traces not hashed again)."""
    configs, summaries = mergeable(sources) if checked is None else checked
    sources, first_summary = [pathlib.Path(s) for s in sources], summaries[0]
    out = pathlib.Path(out_dir)
    shutil.copyfile(sources[0] / TRACE, out / TRACE)
    for name in (REQUESTS, POINTS):
        with open(out / name, "w") as f:
            for src in sources:
                with open(src / name) as part:
                    shutil.copyfileobj(part, f)
    summary = {k: first_summary[k] for k in ("requests", "blocks", "setup", "trace_summary",
                                              "slo")}
    summary["policies"] = {p: v for s in summaries for p, v in s["policies"].items()}
    summary["merged_from"] = [{"run_dir": str(src), "policies": list(s["policies"]),
                               "command": c["command"], "git_commit": c["git_commit"],
                               "git_dirty": c["git_dirty"], "wall_seconds": s["wall_seconds"]}
                              for src, c, s in zip(sources, configs, summaries)]
    summary["cpu_seconds"] = sum(s.get("cpu_seconds", 0.0) for s in summaries)
    summary["table"] = table(summary)
    (out / "summary.md").write_text(summary["table"] + "\n")
    return summary


def _f(x, scale=1.0, digits=3):
    return "-" if x is None else f"{x * scale:.{digits}f}"


def table(summary: dict) -> str:
    """The per-policy table (markdown), then the per-tenant TTFT / TPOT rows."""
    lines = ["| policy | p50 TTFT s | p99 TTFT s | p50 TPOT s | p99 TPOT s | p99 jitter s | "
             "preemptions | suspensions | refusals (all tries) | refused requests | completed |"
             " goodput tok/s | drift B | frag max GiB | pool 0 > 80 % | reclaimed / target GB"
             " | zero-target cuts |", "|" + "---|" * 17]
    for p, v in summary["policies"].items():
        refusals = ", ".join(f"{k}: {n}" for k, n in sorted(v["refusals"].items())) or "0"
        refused = ", ".join(f"{k}: {n}" for k, n in sorted(v["refused_requests"].items())) or "0"
        lines.append(
            f"| {p} | {_f(v['p50_ttft_s'])} | {_f(v['p99_ttft_s'])} | {_f(v['p50_tpot_s'])} | "
            f"{_f(v['p99_tpot_s'])} | {_f(v['p99_step_jitter_s'])} | {v['preemptions']} | "
            f"{v['suspensions']} | {refusals} | {refused} | {v['completed']}/{v['requests']} | "
            f"{v['goodput']:,.0f} | {v['ledger_drift_bytes_max']} | "
            f"{v['fragmentation_bytes_max'] / 2**30:.2f} | {v['pool0_above_80_share']:.2f} | "
            f"{v['reclaim']['reclaimed_bytes'] / 1e9:,.1f} / "
            f"{v['reclaim']['target_bytes'] / 1e9:,.1f} | {v['reclaim']['zero_target_events']} |")
    lines += ["", "| policy | tenant | requests | completed | p50 TTFT s | p99 TTFT s | "
              "p99 TPOT s | preemptions | refused | goodput tok/s |", "|" + "---|" * 10]
    for p, v in summary["policies"].items():
        for t, row in v["tenants"].items():
            refused = sum(row["refused_requests"].values())
            lines.append(f"| {p} | {t} | {row['requests']} | {row['completed']} | "
                         f"{_f(row['p50_ttft_s'])} | {_f(row['p99_ttft_s'])} | "
                         f"{_f(row['p99_tpot_s'])} | {row['preemptions']} | {refused} | "
                         f"{row['goodput']:,.0f} |")
    return "\n".join(lines)


def plot(points, metrics, out_dir) -> list[str]:
    """latency_cdf.png (TTFT and TPOT CDFs per policy, log x) and bytes_timeline.png (device,
    compressed and host bytes over the modelled clock, one panel per policy)."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    policies = list(metrics["policies"])
    reqs = read_json_lines(out_dir / REQUESTS)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_s", "time to first token (s, modelled)"),
                           (axes[1], "tpot_s", "time per output token (s, modelled)")):
        for p in policies:
            x = np.sort([r[key] for r in reqs if r["policy"] == p and r[key] is not None])
            if len(x):
                ax.plot(np.maximum(x, 1e-6), np.arange(1, len(x) + 1) / len(x), label=p)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    setup = metrics["setup"]
    fig.suptitle(f"{metrics['requests']:,} requests, {metrics['blocks']:,} blocks, "
                 f"{setup.get('replicas', 1)} replicas x TP {setup.get('tp', setup['devices'])}")
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(policies), 1, figsize=(9, 1.9 * len(policies) + 0.6),
                             sharex=True, squeeze=False)
    for ax, p in zip(axes[:, 0], policies):
        pts = [q for q in points if q.get("policy") == p and q.get("replica", 0) == 0]
        if not pts:
            continue
        clock = [q["clock_s"] for q in pts]
        ys = [[q["bytes"][k] / 2**40 for q in pts] for k in ("device", "compressed", "host")]
        ax.stackplot(clock, ys, labels=["device (pool 0)", "compressed", "host"])
        pool0 = setup["pool_blocks"][0] * setup["block_bytes"] / 2**40
        ax.axhline(0.8 * pool0, color="r", lw=0.7, ls=":", label="80 % of pool 0")
        for q in pts:
            for kind in q["events"]:
                ax.axvline(q["clock_s"], color="k", lw=0.7, ls="--")
        ax.set_ylabel("TiB")
        ax.set_title(p, fontsize=9, loc="left")
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("modelled seconds, replica 0 (dashed: quota cuts and lease "
                           "expiries)")
    fig.tight_layout()
    fig.savefig(out_dir / "bytes_timeline.png", dpi=110)
    plt.close(fig)
    return ["latency_cdf.png", "bytes_timeline.png"]
