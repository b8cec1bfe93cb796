"""experiments.loadtest: the --json contract at tiny sizes (all five policies, drift 0), the run
directory (trace, per-step and per-request lines, plots), an exact replay of the saved trace,
flag errors (one line, exit 2, before any heavy work), and --merge of policies run as separate
jobs (the joint run's files and figures; runs that do not fit refused, nothing written)."""

import json
import os
import shutil

import pytest

import kvquota as kq

from tests.experiments.common import run_cli

TINY = ("--blocks=512", "--requests=40", "--max_seqs=8", "--token_budget=256",
        "--max_admit=4", "--prefill_rows=2", "--chunk_size=128", "--tenants=3", "--groups=1",
        "--prompt_mean=96", "--prompt_max=256", "--output_mean=24", "--output_max=64",
        "--system_prompt_tokens=32", "--followup_mean=24", "--context_max=640", "--rate=200", "--think_time_s=0.05",
        "--drift_every=50")
POLICIES = ("tiered", "preempt-all", "swap-all", "evict-first", "grow-no-admit")
KEYS = ("p50_ttft_s", "p99_ttft_s", "p99_tpot_s", "p99_step_jitter_s", "preemptions",
        "suspensions", "refusals", "goodput", "ledger_drift_bytes_max",
        "fragmentation_bytes_max", "pool0_above_80_share", "reclaim")
RECLAIM_KEYS = ("events", "target_bytes", "reclaimed_bytes", "shortfall_bytes",
                "zero_target_events")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    elsewhere = tmp_path_factory.mktemp("cwd")  # runs from any working directory
    proc = run_cli("loadtest", *TINY, "--json", f"--runs_dir={runs}", cwd=elsewhere,
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), runs


def test_json_contract(tiny):
    out, _ = tiny
    assert out["requests"] == 40 and out["blocks"] == 2 * 512  # the total over 2 replicas
    assert type(out["wall_seconds"]) is float and out["wall_seconds"] > 0
    assert type(out["cpu_seconds"]) is float and out["cpu_seconds"] > 0
    assert out["compilation_cache"] == (os.environ["KVQUOTA_JAX_CACHE"] or None)  # the suite's
    assert tuple(out["policies"]) == POLICIES
    for name, p in out["policies"].items():
        assert set(KEYS) <= set(p), name
        assert set(RECLAIM_KEYS) <= set(p["reclaim"]), name
        assert 0 <= p["pool0_above_80_share"] <= 1
        assert p["ledger_drift_bytes_max"] == 0 and p["drift_checks"] >= 2
        assert type(p["preemptions"]) is int and isinstance(p["refusals"], dict)
        assert p["p50_ttft_s"] <= p["p99_ttft_s"] and p["goodput"] >= 0
        assert p["fragmentation_bytes_max"] >= 0 and p["p99_step_jitter_s"] >= 0
    assert out["setup"]["devices"] == 16 and out["setup"]["tp"] == 8  # 2 replicas x TP 8
    cost = out["config"]["load"]["cost"]
    assert cost["hbm_bandwidth"] == 4.8e12 and cost["mfu"] == 0.5


@pytest.mark.slow  # ~25 s: a second CLI run (the default run's budget, issue #13)
def test_run_directory_and_an_exact_replay_of_its_trace_in_one_process(tiny, tmp_path):
    out, runs = tiny
    run = next(runs.glob("loadtest-*"))
    for name in ("config.json", "metrics.json", "trace.jsonl", "points.jsonl",
                 "requests.jsonl", "summary.md", "latency_cdf.png", "bytes_timeline.png"):
        assert (run / name).stat().st_size > 0, name
    points = [json.loads(x) for x in (run / "points.jsonl").read_text().splitlines()]
    assert {p["policy"] for p in points} == set(POLICIES)
    reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in reqs} == set(POLICIES)
    # One process this time (the fixture ran the policies in one worker per core): same figures.
    proc = run_cli("loadtest", *TINY, f"--trace={run / 'trace.jsonl'}", "--json", "--jobs=1",
                   f"--runs_dir={tmp_path}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in POLICIES:
        a, b = dict(out["policies"][name]), dict(again["policies"][name])
        for field in kq.sim.loadtest_io.PROCESS_FIELDS:  # wall and compile times
            a.pop(field), b.pop(field)
        assert a == b, name
    replayed = next(tmp_path.glob("loadtest-*"))
    assert (replayed / "requests.jsonl").read_text() == (run / "requests.jsonl").read_text()


@pytest.mark.parametrize("args, message", [
    (["--blocks=-1"], "blocks"),
    (["--devices=48"], "--tp"),
    (["--tp=1"], "do not hold the weights"),
    (["--replicas=0"], "replicas"),
    (["--policies=tiered,bogus"], "policies"),
    (["--rate=-1"], "rate"),
    (["--mfu=2"], "mfu"),
    (["--patience_s=-1"], "patience_s"),
    (["--patience_s=inf"], "patience_s"),
    (["--trace=/no/such/trace.jsonl"], "no such file"),
    (["extra"], "positional"),
])
def test_bad_flags_are_one_line_and_exit_2(args, message, tmp_path):
    proc = run_cli("loadtest", *args, f"--runs_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_a_trace_without_the_requests_its_header_claims_is_one_line_and_exit_2(tmp_path):
    """A trace whose header claims 300 requests and holds none (it gave an empty table, exit 0)
    is refused when read: one line naming the file, its header line and the count."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in (
        {"kind": "header", "format": "kvquota-trace", "version": 1,
         "config": {"seed": 0, "requests": 300, "vocab_size": 1000}},
        {"kind": "tenant", "tenant": 0, "group": -1, "quota_share": 1.0, "salt_group": -1},
    )) + "\n")
    runs = tmp_path / "runs"
    proc = run_cli("loadtest", f"--trace={trace}", f"--runs_dir={runs}", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: TraceFormatError: "), lines
    assert f"{trace.resolve()}:1: no request lines" in lines[0] and "says 300" in lines[0]
    assert proc.stdout == "" and not runs.exists()  # nothing measured, nothing written


@pytest.mark.slow
def test_a_larger_run(tmp_path):
    proc = run_cli("loadtest", "--blocks=65536", "--requests=3000", "--max_seqs=512",
                   "--rate=4", "--json", f"--runs_dir={tmp_path}", timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(p["ledger_drift_bytes_max"] == 0 for p in out["policies"].values())
    assert out["policies"]["preempt-all"]["preemptions"] > 0


def _split(run, parts, root):
    """The 5-policy run `run` cut into one fake run directory per part (its policies' lines
    and figures only), as separate jobs of those policies would have written them."""
    config, metrics = (json.loads((run / n).read_text()) for n in ("config.json", "metrics.json"))
    out = []
    for k, part in enumerate(parts):
        d = root / f"part{k}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(
            {**config, "config": {**config["config"], "policies": list(part)}}))
        (d / "metrics.json").write_text(json.dumps(
            {**metrics, "policies": {p: metrics["policies"][p] for p in part}}))
        for name in ("requests.jsonl", "points.jsonl"):
            lines = (run / name).read_text().splitlines(keepends=True)
            (d / name).write_text("".join(x for x in lines if json.loads(x)["policy"] in part))
        (d / "trace.jsonl").write_bytes((run / "trace.jsonl").read_bytes())
        out.append(d)
    return out


def test_merge_puts_separate_jobs_back_together(tiny, tmp_path):
    out, runs = tiny
    run = next(runs.glob("loadtest-*"))
    parts = _split(run, (POLICIES[:2], POLICIES[2:]), tmp_path)
    merged_root = tmp_path / "merged"
    proc = run_cli("loadtest", f"--merge={parts[0]},{parts[1]}", "--json",
                   f"--runs_dir={merged_root}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert merged["policies"] == out["policies"] and merged["table"] == out["table"]
    assert [m["policies"] for m in merged["merged_from"]] == [list(POLICIES[:2]),
                                                             list(POLICIES[2:])]
    assert merged["config"]["policies"] == list(POLICIES)
    d = next(merged_root.glob("loadtest-*"))
    assert json.loads((d / "metrics.json").read_text())["wall_seconds"] > 0  # the merge's
    for name in ("requests.jsonl", "points.jsonl", "trace.jsonl", "summary.md"):
        assert (d / name).read_bytes() == (run / name).read_bytes(), name
    assert (d / "latency_cdf.png").stat().st_size > 0


def test_merge_refuses_runs_that_do_not_fit(tiny, tmp_path):
    _, runs = tiny
    run = next(runs.glob("loadtest-*"))
    a, b, c, d = _split(run, (POLICIES[:2], POLICIES[1:3], POLICIES[3:4], POLICIES[4:]),
                        tmp_path)  # a and b share preempt-all
    config = json.loads((c / "config.json").read_text())
    config["config"]["load"]["patience_s"] = 5.0  # c: another config
    (c / "config.json").write_text(json.dumps(config))
    with open(d / "trace.jsonl", "a") as f:  # d: another trace
        f.write("\n")
    other, broken, cut_short = (tmp_path / name for name in ("other", "broken", "cut_short"))
    for path in (other, broken, cut_short):
        shutil.copytree(c, path)
    (other / "config.json").write_text(json.dumps({"experiment": "bench_prefix"}))
    (other / "metrics.json").write_text(json.dumps({"rows": []}))
    (broken / "metrics.json").write_text("{")
    (cut_short / "config.json").unlink()
    for sources, message in (((a, b), "share a policy"), ((a, c), "config differs"),
                             ((a, d), "trace.jsonl differs"), ((a,), "at least two"),
                             ((a, tmp_path / "none"), "no metrics.json"),
                             ((a, other), "not a load-test run"), ((a, broken), "not JSON"),
                             ((a, cut_short), "no config.json")):
        with pytest.raises(kq.InvalidArgumentError, match=message):
            kq.sim.loadtest_io.mergeable(sources)
    out_root = tmp_path / "merged"
    for args, message in (([f"--merge={a},{b}"], "share a policy"),
                          ([f"--merge={other},{a}"], "not a load-test run"),
                          ([f"--merge={a},{c}", "--requests=5"], "drop --requests")):
        proc = run_cli("loadtest", *args, f"--runs_dir={out_root}", timeout=120)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines
        assert not out_root.exists()  # nothing written


@pytest.mark.slow  # ~40 s: two more CLI runs
def test_policies_run_as_separate_jobs_and_merged_give_the_joint_runs_figures(tiny, tmp_path):
    out, runs = tiny
    joint = next(runs.glob("loadtest-*"))
    parts = []
    for policy in ("grow-no-admit", "tiered"):
        proc = run_cli("loadtest", *TINY, f"--policies={policy}", "--json",
                       f"--runs_dir={tmp_path / policy}", timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        parts.append(next((tmp_path / policy).glob("loadtest-*")))
    proc = run_cli("loadtest", f"--merge={parts[0]},{parts[1]}", "--json",
                   f"--runs_dir={tmp_path / 'merged'}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(merged["policies"]) == ["grow-no-admit", "tiered"]
    for name, figures in merged["policies"].items():
        a, b = dict(figures), dict(out["policies"][name])
        for field in kq.sim.loadtest_io.PROCESS_FIELDS:  # wall and compile times
            a.pop(field), b.pop(field)
        assert a == b, name
    lines = (joint / "requests.jsonl").read_text().splitlines()
    by_policy = {p: [x for x in lines if json.loads(x)["policy"] == p] for p in merged["policies"]}
    merged_dir = next((tmp_path / "merged").glob("loadtest-*"))
    assert (merged_dir / "requests.jsonl").read_text().splitlines() == \
        by_policy["grow-no-admit"] + by_policy["tiered"]


# A charge off by one block: after the first event's reclaim, tenant 0 is charged one more
# pool-0 block than its block tables hold (in-process: one worker, so the patch applies).
OFF_BY_ONE = """
import sys
import kvquota as kq
from experiments import cli, loadtest
check = kq.sim.loadtest.Replay._check_drift
def off_by_one(self, why, k):
    if why == "event" and not getattr(self, "broken", False):
        s = self.scheds[k]
        t = s.state.tenants
        s.state = s.state.replace(tenants=t.replace(
            charged_blocks=t.charged_blocks.at[0, 0].add(1)))
        self.broken = True
    return check(self, why, k)
kq.sim.loadtest.Replay._check_drift = off_by_one
sys.argv = ["loadtest", *sys.argv[1:]]
cli.run(loadtest.main, loadtest.define_flags)
"""


def test_a_charge_off_by_one_block_fails_the_run(tmp_path):
    """The drift check is not decoration: one block charged that no table holds makes the run
    exit 1 naming the drift (one block's bytes), after writing its run directory."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", OFF_BY_ONE, *TINY, "--policies=tiered",
                           "--jobs=1", "--json", "--noprogress", f"--runs_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=900, cwd=root, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    block = kq.StateConfig(kq.get_model_config("qwen2.5-72b"), num_blocks=8, block_size=16,
                           max_seqs=1, max_blocks_per_seq=1, num_tenants=1).pool_bytes[0]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["policies"]["tiered"]["ledger_drift_bytes_max"] == block
    assert f"ledger drift is not 0: {{'tiered': {block}}}" in proc.stderr
    assert (next(tmp_path.glob("loadtest-*")) / "metrics.json").is_file()
