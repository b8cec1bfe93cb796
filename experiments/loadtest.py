r"""The load test: a multi-tenant trace replayed under each reclaim policy at Qwen2.5-72B scale.

  python -m experiments.loadtest --json                      # 2x10^4 requests, all five policies
  python -m experiments.loadtest --blocks=4096 --requests=200 --max_seqs=64   # a quick one
  python -m experiments.loadtest --trace=my_trace.jsonl      # bring your own trace
  python -m experiments.loadtest --preset=full --policies=tiered --jobs=1 --json   # 10^5, one job

The serving scheduler (`kq.serving.Scheduler`) with the cost-model executor over metadata-only
states (`kq.sim.loadtest`): --replicas replicas (default 2) of --tp H200s each (default 8,
tensor-parallel: KV heads and weights split, two all-reduces per layer over NVLink), each with
its own state, scheduler and clock; requests go to the least-loaded replica, a session's turns
stay on its replica, and each tenant's quota is split evenly over the replicas. Per replica:
pool 0 of --blocks blocks of 16 tokens of Qwen2.5-72B bf16 KV (5 MiB each; default: what the
replica's usable HBM holds beside the weights, 155,996 blocks), a compressed int8 pool and a
host pool. `blocks` in the JSON is the total over replicas. Every reclaim means is priced
(docs/loadtest.md: the cost model, every constant a flag recorded in config.json). A trace
(`kq.sim.traces`, generated from the flags or --trace) is replayed on the modelled clock under
every policy of --policies, each as if on a fresh state (the steps before the trace's first
event, where no policy has acted yet, are replayed once per worker and copied for each policy).
The run directory (experiments/runs.py) holds the trace (trace.jsonl: replay it with --trace),
one JSON line per step and replica (points.jsonl) and per request (requests.jsonl),
metrics.json (each policy's figures, and `event_plans`: each event's plan, what it reclaimed,
its fates by kind, planned and paid resume costs, its device work), summary.md (the table) and
the plots latency_cdf.png and bytes_timeline.png, drawn from those files only. Progress goes to
stderr per policy every ~10 s (steps, modelled time, requests ended; --noprogress: none).
The policies run in --jobs worker processes (default: one per CPU core), with the same files.
--patience_s=S models clients that give up: a request not admitted within S seconds of its
arrival is cancelled and counted as refused "timed out" (default 60; 0: clients wait for ever,
so a tenant cut below its arrival rate builds a queue without bound). Clients send nothing
after the trace's last arrival (a session's later turn due after it is never sent), so the
run ends with the trace; --nosessions_end_with_trace lets every session run to its last turn.
The ledger drift must be 0 at every check (every event, every --drift_every steps, the end):
otherwise the run is written and the program exits with status 1. A quota cut whose target,
summed over replicas, is 0 bytes counts in `zero_target_events` and is flagged on stderr.
--real_check also runs the small real case (`kq.sim.realcheck`: SmolLM2-135M on CPU, measured
step times against the cost model's ranking of the policies, H200 and CPU-calibrated; ~6
minutes here, so off by default); --real_check_only runs just that, into its own run directory
(loadtest_real-<key>):

  python -m experiments.loadtest --real_check_only

The programs go to jax's persistent cache (`experiments.cli.compilation_cache`:
~/.cache/kvquota/jax, KVQUOTA_JAX_CACHE= turns it off), so a rerun on the same machine loads
them (tracing and lowering still run in each process), and metrics.json names the cache
(`compilation_cache`) beside wall_seconds and cpu_seconds. Each policy's entry says how much of
its wall_s went to jax tracing, lowering and compiling (or loading from the cache): compile_s,
of compiled_programs programs (shared_compile_s of it before the first event), and its cpu_s.

Policies can also run as separate jobs (one --policies each, same flags) and be merged into one
run directory, files, table and plots as one run of them all would have written:

  python -m experiments.loadtest --merge=runs/loadtest-aaaa,runs/loadtest-bbbb --json

(the runs must come from the same commit, load config and trace; `merged_from` in metrics.json
names them, with their commands and wall times).

Step jitter is |step_s - median of the previous --jitter_window busy steps' step_s|; goodput is
the output tokens of requests that ended normally within --slo_ttft_s and --slo_tpot_s, per
modelled second; fragmentation is the unused token slots of the running rows' blocks, in bytes.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # wall_seconds: the whole process, imports included

import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
from absl import flags  # noqa: E402

import kvquota as kq  # noqa: E402
from experiments import cli, runs  # noqa: E402

FLAGS = flags.FLAGS
MEASUREMENT_FLAGS = set()  # the flags that decide a measurement (filled by define_flags)
PLOT_POLICY_COLORS = ("C0", "C1", "C2", "C3", "C4")


def define_flags():
    f = flags
    before = set(FLAGS)
    f.DEFINE_string("trace", None, "A trace JSONL file to replay (default: generate one).")
    f.DEFINE_integer("requests", 20_000, "Requests of the generated trace.", lower_bound=1)
    f.DEFINE_integer("seed", 0, "Seed of the generated trace.", lower_bound=0)
    f.DEFINE_integer("tenants", 8, "Tenants of the generated trace.", lower_bound=1,
                     upper_bound=64)
    f.DEFINE_integer("groups", 2, "Tenant groups sharing a system prompt.", lower_bound=0)
    f.DEFINE_float("rate", 30.0, "Requests per second of the generated trace.", lower_bound=1e-6)
    f.DEFINE_enum("arrival", "poisson", ["poisson", "bursty"], "Arrival process.")
    f.DEFINE_float("oversubscription", 2.5, "Sum of the tenants' quota shares (x weights).",
                   lower_bound=0.01)
    f.DEFINE_float("session_fraction", 0.3, "Share of requests in multi-turn sessions.",
                   lower_bound=0, upper_bound=1)
    f.DEFINE_integer("quota_cuts", 4, "Quota cuts in the generated trace.", lower_bound=0)
    f.DEFINE_float("cut_to", 0.05, "A cut leaves this share of the tenant's quota (deep: at "
                   "this geometry prefill, not the pool, bounds the load).", lower_bound=0,
                   upper_bound=1)
    f.DEFINE_integer("lease_expiries", 1, "Lease expiries in the generated trace.",
                     lower_bound=0)
    f.DEFINE_boolean("expire_lightest", True, "Leases expire for the tenants of the smallest "
                     "quota shares (--noexpire_lightest: seeded tenants, maybe the largest).")
    f.DEFINE_integer("context_max", 32768, "Longest conversation of the generated trace.",
                     lower_bound=64)
    f.DEFINE_float("prompt_mean", 3072.0, "Mean first prompt (system prompt included), tokens.",
                   lower_bound=1)
    f.DEFINE_integer("prompt_max", 16384, "Longest prompt part, tokens.", lower_bound=1)
    f.DEFINE_float("output_mean", 1024.0, "Mean output (max_new_tokens).", lower_bound=1)
    f.DEFINE_integer("output_max", 4096, "Longest output.", lower_bound=1)
    f.DEFINE_float("followup_mean", 256.0, "Mean new user message of a later turn, tokens.",
                   lower_bound=1)
    f.DEFINE_integer("system_prompt_tokens", 512, "System prompt per group, tokens.",
                     lower_bound=0)
    f.DEFINE_float("think_time_s", 20.0, "Mean think time between turns (s).", lower_bound=0)
    f.DEFINE_list("policies", list(kq.RECLAIM_PRESETS), "Reclaim policy presets compared.")
    f.register_validator("policies", lambda v: bool(v) and set(v) <= set(kq.RECLAIM_PRESETS)
                         and len(set(v)) == len(v),
                         f"distinct presets of: {', '.join(kq.RECLAIM_PRESETS)}")
    f.DEFINE_integer("blocks", 0, "Blocks of pool 0 per replica (0: what the replica's HBM "
                     "holds beside the weights and the compressed pool).", lower_bound=0,
                     upper_bound=1 << 24)
    f.DEFINE_integer("tp", 8, "Tensor-parallel H200s per replica (KV heads and weights split "
                     "over them; two all-reduces per layer over NVLink).", lower_bound=1,
                     upper_bound=64)
    f.DEFINE_integer("replicas", 2, "Replicas, each with its own pool, scheduler and clock; "
                     "requests routed to the least loaded, quotas split evenly.", lower_bound=1,
                     upper_bound=64)
    f.DEFINE_integer("max_seqs", 4096, "Sequence slots (and decode rows per step at most).",
                     lower_bound=1, upper_bound=65536)
    f.DEFINE_integer("token_budget", 8192, "Tokens per step (decode rows + prefill chunks).",
                     lower_bound=1)
    f.DEFINE_integer("max_admit", 64, "Requests per admit call.", lower_bound=1,
                     upper_bound=1024)
    f.DEFINE_integer("steps_per_pass", 8, "Steps per scheduling pass (multi-step "
                     "scheduling, vLLM's num_scheduler_steps: admissions, frees and events "
                     "between passes only; 1: single steps).", lower_bound=1,
                     upper_bound=64)
    f.DEFINE_integer("quiet_steps", 64, "Longest quiet window: steps that can only decode "
                     "(no arrival, event, admission, restore, host transfer, finish or refusal "
                     "possible) run as one pass, exactly as one at a time (0: off).",
                     lower_bound=0, upper_bound=1024)
    f.DEFINE_integer("prefill_rows", 16, "Prefill rows per step.", lower_bound=1,
                     upper_bound=256)
    f.DEFINE_integer("chunk_size", 2048, "Longest prefill chunk (tokens).", lower_bound=16,
                     upper_bound=65536)
    f.DEFINE_float("compressed_fraction", 0.125, "Compressed (int8) pool, x --blocks.",
                   lower_bound=0, upper_bound=1)
    f.DEFINE_float("host_fraction", 0.5, "Host pool, x --blocks.", lower_bound=0, upper_bound=4)
    f.DEFINE_float("slo_ttft_s", 30.0, "Goodput SLO on time to first token (s).",
                   lower_bound=1e-9)
    f.DEFINE_float("slo_tpot_s", 0.25, "Goodput SLO on time per output token (s).",
                   lower_bound=1e-9)
    f.DEFINE_integer("jitter_window", 32, "Steps of the median that jitter is measured from.",
                     lower_bound=1)
    f.DEFINE_integer("drift_every", 1000, "Ledger drift checked every n steps (and at events, "
                     "at the end).", lower_bound=1)
    f.DEFINE_integer("max_steps", 1_000_000, "Steps per policy at most.", lower_bound=1)
    f.DEFINE_float("patience_s", 60.0, "A client cancels a request not admitted within this many "
                   "seconds of its arrival (refused 'timed out'; 0: clients wait for ever).",
                   lower_bound=0)
    f.DEFINE_boolean("sessions_end_with_trace", True, "Clients send nothing after the trace's "
                     "last arrival: a session's later turn due after it is never sent (so the "
                     "run ends with the trace, not with its longest session).")
    # the cost model (H200 SXM defaults)
    f.DEFINE_float("hbm_bandwidth", 4.8e12, "HBM bytes/s per device.", lower_bound=1)
    f.DEFINE_float("hbm_bytes", 141e9, "HBM bytes per device.", lower_bound=1)
    f.DEFINE_float("hbm_usable", 0.9, "Share of HBM for weights and KV.", lower_bound=1e-3,
                   upper_bound=1)
    f.DEFINE_float("host_bandwidth", 50e9, "Host link bytes/s per device.", lower_bound=1)
    f.DEFINE_float("peak_flops", 989e12, "Dense bf16 FLOP/s per device.", lower_bound=1)
    f.DEFINE_float("mfu", 0.5, "Share of peak FLOP/s prefill reaches.", lower_bound=1e-3,
                   upper_bound=1)
    f.DEFINE_float("step_overhead_s", 0.005, "Fixed seconds per step (scheduling, "
                   "sampling, launches).", lower_bound=0)
    f.DEFINE_integer("weight_bytes", 0, "Model weight bytes (0: bf16 of the model).",
                     lower_bound=0)
    f.DEFINE_float("prefill_tokens_per_s", 0.0, "Prefill tokens/s per device (0: from "
                   "peak_flops x mfu).", lower_bound=0)
    f.DEFINE_float("nvlink_bandwidth", 450e9, "NVLink bytes/s per device and direction.",
                   lower_bound=1)
    f.DEFINE_float("allreduce_latency_s", 10e-6, "Fixed seconds per all-reduce (two per "
                   "layer per step under tensor parallelism).", lower_bound=0)
    f.DEFINE_float("host_step_s", 0.02, "Seconds of host-link transfer one step carries at "
                   "most (a larger transfer spills into the next steps).", lower_bound=1e-9)
    f.DEFINE_float("plan_s", 0.0169, "Modelled seconds of one reclaim plan (a constant: runs "
                   "stay deterministic).", lower_bound=0)
    f.DEFINE_enum("preset", "default", ["default", "full"], "default: the 2x10^4-request "
                  "trace; full: the 10^5-request trace (client patience 60 s), meant to run "
                  "one --policies per job and be merged with --merge.")
    f.DEFINE_integer("jobs", 0, "Worker processes the policies run in (0: one per CPU core).",
                     lower_bound=0, upper_bound=64)
    f.DEFINE_boolean("real_check", False, "Also run the small real case (SmolLM2 on CPU).")
    f.DEFINE_boolean("real_check_only", False, "Run only the small real case (its own run "
                     "directory, loadtest_real-<key>).")
    MEASUREMENT_FLAGS.update(set(FLAGS) - before)  # what --merge takes from its runs instead
    f.DEFINE_integer("devices", None, "Removed: the deployment is --tp x --replicas.")
    f.DEFINE_boolean("progress", True, "A progress line per policy on stderr every ~10 s "
                     "(--noprogress: none).")
    f.DEFINE_list("merge", [], "Run directories of load tests of disjoint policies (same commit, "
                  "config and trace) to merge into one run directory, instead of measuring.")
    runs.define_flags()


# --preset=full: the flags whose value differs from the default preset (unless given).
FULL_PRESET = {"requests": 100_000, "rate": 100.0, "prompt_mean": 2048.0, "output_mean": 256.0,
               "token_budget": 32768, "chunk_size": 4096}


def apply_preset():
    """--preset=full sets FULL_PRESET's flags that the command line did not give."""
    if FLAGS.devices is not None:
        raise cli.BadInput("--devices is gone: the deployment is --tp (devices per replica, "
                           "default 8) x --replicas (default 2)")
    if FLAGS.preset == "full":
        for name, value in FULL_PRESET.items():
            if not FLAGS[name].present:
                FLAGS[name].value = value


def load_config() -> "kq.sim.LoadConfig":
    cost = kq.sim.CostConstants(
        hbm_bandwidth=FLAGS.hbm_bandwidth, hbm_bytes=FLAGS.hbm_bytes,
        hbm_usable=FLAGS.hbm_usable, host_bandwidth=FLAGS.host_bandwidth,
        peak_flops=FLAGS.peak_flops, mfu=FLAGS.mfu, step_overhead_s=FLAGS.step_overhead_s,
        weight_bytes=FLAGS.weight_bytes or None,
        prefill_tokens_per_s=FLAGS.prefill_tokens_per_s or None,
        nvlink_bandwidth=FLAGS.nvlink_bandwidth, allreduce_latency_s=FLAGS.allreduce_latency_s,
        host_step_s=FLAGS.host_step_s, plan_s=FLAGS.plan_s)
    cfg = kq.sim.LoadConfig(
        blocks=FLAGS.blocks or None, tp=FLAGS.tp, replicas=FLAGS.replicas,
        max_seqs=FLAGS.max_seqs,
        max_blocks_per_seq=-(-(FLAGS.context_max + FLAGS.output_max) // 16),
        num_tenants=max(FLAGS.tenants, 8),
        compressed_fraction=FLAGS.compressed_fraction, host_fraction=FLAGS.host_fraction,
        token_budget=FLAGS.token_budget, max_admit=FLAGS.max_admit,
        steps_per_pass=FLAGS.steps_per_pass, quiet_steps=FLAGS.quiet_steps,
        prefill_rows=FLAGS.prefill_rows,
        chunk_size=FLAGS.chunk_size, slo_ttft_s=FLAGS.slo_ttft_s, slo_tpot_s=FLAGS.slo_tpot_s,
        jitter_window=FLAGS.jitter_window, drift_every=FLAGS.drift_every,
        max_steps=FLAGS.max_steps, patience_s=FLAGS.patience_s or None,
        sessions_end_with_trace=FLAGS.sessions_end_with_trace, cost=cost)
    kq.sim.loadtest.replica_blocks(cfg)  # --tp too small for the weights: a typed error here
    return cfg


def trace_config() -> "kq.sim.TraceConfig":
    return kq.sim.TraceConfig(
        seed=FLAGS.seed, requests=FLAGS.requests, tenants=FLAGS.tenants, groups=FLAGS.groups,
        arrival=FLAGS.arrival, rate_per_s=FLAGS.rate, oversubscription=FLAGS.oversubscription,
        session_fraction=FLAGS.session_fraction, quota_cuts=FLAGS.quota_cuts,
        cut_to=FLAGS.cut_to,
        lease_expiries=FLAGS.lease_expiries, expire_lightest=FLAGS.expire_lightest,
        context_max=FLAGS.context_max,
        prompt_mean=FLAGS.prompt_mean, prompt_max=FLAGS.prompt_max,
        output_mean=FLAGS.output_mean, output_max=FLAGS.output_max,
        system_prompt_tokens=FLAGS.system_prompt_tokens, followup_mean=FLAGS.followup_mean,
        think_time_mean_s=FLAGS.think_time_s)


def describe(m: dict) -> str:
    return m["table"] + f"\n\nwall {m['wall_seconds']:.0f} s"


def main(argv):
    del argv
    root = FLAGS.runs_dir
    if not FLAGS["runs_dir"].present:
        root = str(runs.REPO / runs.RUNS_DIR)  # the repo's runs/, from any working directory
    apply_preset()
    if FLAGS.merge:
        return merge(root)
    cfg = load_config()  # typed errors: one line, status 2, before any heavy work
    if FLAGS.trace is None:
        tc = trace_config()
    if FLAGS.trace is not None:
        path = pathlib.Path(FLAGS.trace).resolve()
        if not path.is_file():
            raise cli.BadInput(f"--trace={FLAGS.trace}: no such file")
        trace, source = kq.sim.load_trace(path), {"file": str(path)}
    else:
        trace, source = None, {"generated": kq.sim.loadtest_io.as_dict(tc)}
    if FLAGS.trace is not None and len(trace.tenants) > cfg.num_tenants:
        cfg = kq.sim.loadtest_io.with_tenants(cfg, len(trace.tenants))
    config = {"load": kq.sim.loadtest_io.as_dict(cfg), "trace": source,
              "policies": list(FLAGS.policies), "real_check": FLAGS.real_check}
    if FLAGS.trace is not None:
        config["trace_sha256"] = kq.sim.loadtest_io.file_sha256(path)
    if FLAGS.real_check_only:
        return real_check_only(root)
    run = runs.open_run("loadtest", "experiments.loadtest", config, seed=FLAGS.seed,
                        root=root, overwrite=FLAGS.overwrite)
    if run.complete:
        cli.note(f"{run.path} already holds this run; showing it again (--overwrite reruns it)")
        summary = run.stored_summary()
    else:
        if trace is None:
            trace = kq.sim.generate_trace(tc)
        summary = kq.sim.loadtest_io.measure(cfg, trace, FLAGS.policies, run, FLAGS.real_check,
                                             jobs=FLAGS.jobs or os.cpu_count() or 1,
                                             progress_s=10.0 if FLAGS.progress else None)
        summary["wall_seconds"] = time.perf_counter() - _T0
        summary["cpu_seconds"] = cpu_seconds()
        summary["compilation_cache"] = jax.config.jax_compilation_cache_dir  # speeds reruns
        summary = run.finish(summary, plot)
    report(summary, run)


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished workers (user + system)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def flagged(summary: dict) -> list[str]:
    """What makes a run fail its own checks: ledger drift, quota cuts that took nothing."""
    out = []
    for p, v in summary["policies"].items():
        if v["ledger_drift_bytes_max"]:
            out.append(f"{p}: ledger drift {v['ledger_drift_bytes_max']} B (must be 0)")
        zero = v.get("reclaim", {}).get("zero_target_events", 0)
        if zero:
            out.append(f"{p}: {zero} quota cut(s) with a target of 0 bytes (the cut took "
                       "nothing: no policy is measured by it)")
    return out


def report(summary: dict, run):
    """The summary to stdout (--json: one line) and --out; exit status 1 on ledger drift."""
    summary["wall_seconds"] = time.perf_counter() - _T0
    if "merged_from" not in summary:  # a merge's: the sum of its runs' (`merge_runs`)
        summary["cpu_seconds"] = cpu_seconds()
    if FLAGS.out:
        pathlib.Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(FLAGS.out).write_text(json.dumps(summary, indent=2) + "\n")
    bad = {p: v["ledger_drift_bytes_max"] for p, v in summary["policies"].items()
           if v["ledger_drift_bytes_max"]}
    for line in flagged(summary):
        print(f"warning: {line}", file=sys.stderr)
    if FLAGS.json:
        print(json.dumps(summary), flush=True)
    else:
        print(describe(summary))
        print(f"run directory: {run.path}")
    if bad:
        print(f"error: ledger drift is not 0: {bad} (run directory {run.path})", file=sys.stderr)
        sys.exit(1)


def merge(root: str):
    """--merge: the runs' files merged into a new run directory (nothing is measured)."""
    given = sorted(name for name in MEASUREMENT_FLAGS if FLAGS[name].present)
    if given:
        raise cli.BadInput(f"--merge takes every setting from its runs; drop --{given[0]}")
    sources = [pathlib.Path(d).resolve() for d in FLAGS.merge]
    checked = kq.sim.loadtest_io.mergeable(sources)  # before any directory is made
    configs = checked[0]
    config = {**configs[0]["config"], "policies": [p for c in configs
                                                    for p in c["config"]["policies"]],
              "merged_from": [d.name for d in sources]}
    run = runs.open_run("loadtest", "experiments.loadtest", config, seed=configs[0]["seed"],
                        root=root, overwrite=FLAGS.overwrite)
    if run.complete:
        cli.note(f"{run.path} already holds this merge; showing it again")
        summary = run.stored_summary()
    else:
        summary = kq.sim.loadtest_io.merge_runs(sources, run.path, checked)
        summary["wall_seconds"] = time.perf_counter() - _T0  # the merge's (merged_from: the runs')
        summary = run.finish(summary, plot)
    report(summary, run)


def real_check_only(root: str):
    run = runs.open_run("loadtest_real", "experiments.loadtest", {
        "policies": list(FLAGS.policies), "real_check": True}, seed=0, root=root,
        overwrite=FLAGS.overwrite)
    if run.complete:
        summary = run.stored_summary()
    else:
        realcheck = kq.sim.realcheck
        summary = run.finish({"real_check": realcheck.run_check(list(FLAGS.policies))})
        (run.path / "summary.md").write_text(realcheck.describe(summary["real_check"]) + "\n")
    summary["wall_seconds"] = time.perf_counter() - _T0
    if FLAGS.json:
        print(json.dumps(summary), flush=True)
    else:
        print(kq.sim.realcheck.describe(summary["real_check"]))
        print(f"run directory: {run.path}")


def plot(points, metrics, out_dir):
    return kq.sim.loadtest_io.plot(points, metrics, out_dir)


if __name__ == "__main__":
    cli.run(main, define_flags)
