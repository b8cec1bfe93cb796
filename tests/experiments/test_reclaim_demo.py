"""The main job (`make demo`, experiments.reclaim_demo): its --json contract on a tiny random
model (the keys and their types the issue lists), its run directory, and its flag errors."""

import json

import pytest

from tests.experiments.common import TINY_MODEL, run_cli, tiny_checkpoint

INT_KEYS = ("target_bytes", "shortfall_bytes", "pinned_bytes_held", "shared_bytes_held",
            "preemptions", "ledger_drift_bytes_max")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    runs = tmp_path_factory.mktemp("runs")
    proc = run_cli("reclaim_demo", f"--model={TINY_MODEL}", f"--weights={ckpt}",
                   "--max_new_tokens=8", "--json", f"--runs_dir={runs}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), runs, ckpt


def test_json_contract(demo):
    out, _, _ = demo
    for key in INT_KEYS:
        assert type(out[key]) is int, key
    assert out["ledger_drift_bytes_max"] == 0
    assert out["target_bytes"] > 0 and out["shortfall_bytes"] >= 0
    tiers = out["reclaimed_bytes_by_tier"]
    assert set(tiers) == {"free", "offload", "compress", "evict"}
    assert all(type(v) is int and v >= 0 for v in tiers.values())
    assert sum(tiers.values()) >= out["target_bytes"] - out["shortfall_bytes"]
    assert type(out["topup_ok"]) is bool and out["topup_ok"]  # sized so it holds
    resume = ("planned_resume_tokens", "planned_resume_bytes")
    assert out["fates"] and all({"seq", "tenant", "fate", *resume} <= set(f)
                                for f in out["fates"])
    assert all(type(f[k]) is int for f in out["fates"] for k in ("seq", "tenant", *resume))
    # Each answer records its resume costs as planned (the sum of its fates') and as paid.
    for a in out["answers"]:
        mine = [f for f in out["fates"] if f["request"] == a["name"]]
        for key in resume:
            assert a[key] == sum(f[key] for f in mine), (a["name"], key)
        assert type(a["paid_resume_tokens"]) is int and type(a["paid_resume_bytes"]) is int
    assert {f["fate"] for f in out["fates"]} >= {"released"}  # B's lease expiry
    agreement = out["token_agreement"]
    assert agreement and all(type(v) is float and v == 1.0 for v in agreement.values())


def test_run_directory_holds_metrics_events_and_the_timeline(demo):
    out, runs, _ = demo
    (run_dir,) = [p for p in runs.iterdir() if p.name.startswith("reclaim_demo-")]
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.json", "points.jsonl", "metrics.json", "events.jsonl",
            "timeline.png"} <= names
    points = [json.loads(line) for line in (run_dir / "points.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert len(points) == out["scheduler"]["steps"]
    assert [e["kind"] for e in events] == ["burst", "quota_cut", "lease_expiry"]
    assert all(p["drift_bytes"] == 0 for p in points)
    for key in ("planned_resume_tokens", "paid_resume_tokens", "planned_resume_bytes",
                "paid_resume_bytes"):  # per step, summing to the run's totals
        assert sum(p[key] for p in points) == out["scheduler"][key], key
    assert json.loads((run_dir / "metrics.json").read_text())["fates"] == out["fates"]


@pytest.mark.parametrize("args, message", [
    (["--policy=nope"], "policy"),
    (["--max_new_tokens=0"], "max_new_tokens"),
    (["extra"], "positional"),
    (["--model=qwen2.5-7b"], "weights"),
])
def test_bad_flags_are_one_line_and_exit_2(args, message, tmp_path):
    proc = run_cli("reclaim_demo", *args, f"--runs_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr
