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
    # progress on stderr (--noprogress: none), the summary alone on stdout
    assert "reclaim_demo: the run with events" in proc.stderr
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
    # Each step's record carries every request's lane state; B's requests are released at the
    # lease step, and say so instead of an agreement.
    lease = out["setup"]["lease_step"]
    names = {a["name"] for a in out["answers"]}
    assert all(set(p["requests"]) == names for p in points)
    for a in out["answers"]:
        lane = [p["requests"][a["name"]] for p in points]
        if a["name"].startswith("B"):
            assert a["released_step"] == lease and a["agreement"] is None
            assert lane[lease:] == ["released"] * (len(points) - lease)
            assert 0 <= a["tokens_as_reference"] <= len(a["tokens"])
        else:
            assert a["released_step"] is None and a["agreement"] == 1.0
            assert lane[-1] == "finished" and "released" not in lane


def test_replay_shows_the_run_and_measuring_again_makes_a_new_one(demo, tmp_path):
    """`make demo` twice measures twice; --replay shows the newest run instead (same code)."""
    out, runs, ckpt = demo
    args = [f"--model={TINY_MODEL}", f"--weights={ckpt}", "--max_new_tokens=8", "--json",
            f"--runs_dir={runs}"]
    shown = run_cli("reclaim_demo", *args, "--replay", "--noprogress", timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stderr.startswith("note: --replay: showing") and shown.stderr.count("\n") == 1
    assert json.loads(shown.stdout.splitlines()[-1]) == out
    assert len(list(runs.glob("reclaim_demo-*"))) == 1
    again = run_cli("reclaim_demo", *args, "--noprogress", timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reclaim_demo:" not in again.stderr  # --noprogress
    second = json.loads(again.stdout.splitlines()[-1])
    assert second["run_dir"] != out["run_dir"] and len(list(runs.glob("reclaim_demo-*"))) == 2
    assert second["fates"] == out["fates"]  # the same measurement, measured again


def test_event_labels_never_overlap():
    """Labels of events one step apart, or at the same step, or at the right edge, go to rows
    where no two overlap, and stay inside the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.reclaim_demo import place_labels

    fig, ax = plt.subplots(figsize=(6, 2))
    ax.set_xlim(0, 40)
    items = [(5, "5: C tops up (a request, a higher quota)"), (6, "6: A's byte quota cut"),
             (6, "6: lease of B ends"), (7, "7: burst"), (30, "30: a long label at the edge"),
             (39, "39: the last one")]
    texts = place_labels(ax, items)
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in texts]
    for i, a in enumerate(boxes):
        assert fig.bbox.x0 <= a.x0 and a.x1 <= fig.bbox.x1, texts[i].get_text()
        for b in boxes[:i]:
            assert not a.overlaps(b)
    assert len({t.get_position()[1] for t in texts}) >= 4  # 5, 6, 6 and 7 share no row
    plt.close(fig)


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
