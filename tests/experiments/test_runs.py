"""The run-directory writer (experiments/runs.py) and the benchmarks that write through it."""

import json
import re

import pytest

from experiments import bench_attention, bench_model, bench_reclaim, runs
from tests.experiments.common import run_cli


def _plot_one(points, metrics, out_dir):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([p["x"] for p in points], [p["y"] for p in points])
    ax.set_title(metrics["title"])
    fig.savefig(out_dir / "xy.png")
    plt.close(fig)
    return ["xy.png"]


def test_uncommitted_changes_are_part_of_the_run_key(tmp_path, monkeypatch):
    """An edit of a tracked file, a new untracked file, or new contents of one give another
    run directory; ignored files and a clean tree keep the key a clean tree always had."""
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True,  # noqa: E731
                                    capture_output=True)
    git("init", "-q")
    (repo / "policy.py").write_text("SCORE = 1\n")
    (repo / ".gitignore").write_text("runs/\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    monkeypatch.setattr(runs, "REPO", repo)

    def key():
        g = runs.git_state()
        return runs.run_key("toy", {"n": 1}, g["git_commit"], "cpu", g["git_changes"]), g

    clean, g = key()
    assert g["git_changes"] is None and g["git_dirty"] is False
    assert clean == runs.run_key("toy", {"n": 1}, g["git_commit"], "cpu")
    (repo / "runs").mkdir()
    (repo / "runs" / "old.json").write_text("{}")  # ignored: no change
    assert key()[0] == clean
    (repo / "policy.py").write_text("SCORE = 2\n")
    edited, g = key()
    assert edited != clean and g["git_dirty"] is True and g["git_changes"]
    (repo / "new_policy.py").write_text("A = 1\n")
    untracked, _ = key()
    (repo / "new_policy.py").write_text("A = 2\n")
    assert len({clean, edited, untracked, key()[0]}) == 4
    (repo / "policy.py").write_text("SCORE = 1\n")
    (repo / "new_policy.py").unlink()
    assert key()[0] == clean


def test_run_directory_lifecycle(tmp_path, capsys):
    config = {"size": 4, "sweep": [1, 2]}
    run = runs.open_run("toy", "experiments.bench_reclaim", config, seed=7, root=tmp_path)
    assert re.fullmatch(r"toy-[0-9a-f]{8}-\d{8}T\d{6}Z", run.path.name) and not run.complete
    recorded = runs.read_config(run.path)
    assert recorded["config"] == config and recorded["seed"] == 7
    for key in ("git_commit", "git_dirty", "git_changes", "versions", "device", "command",
                "time_utc"):
        assert key in recorded
    assert "load_average_1_5_15" in recorded["device"]
    run.add_point({"x": 0, "y": 1.0})
    run.add_point({"x": 1, "y": 3.0, "error": "RESOURCE_EXHAUSTED"})  # failures are data
    summary = run.finish({"title": "toy", "best": 1.0}, plot=_plot_one)
    points = runs.read_points(run.path)
    assert [p["x"] for p in points] == [0, 1] and all("load_average_1min" in p for p in points)
    assert runs.read_metrics(run.path) == summary
    assert summary["best"] == 1.0 and summary["config"] == config and summary["seed"] == 7
    assert summary["run_dir"] == str(run.path)
    assert (run.path / "xy.png").stat().st_size > 0

    # The same config again measures again, into a new directory (the same key, the time after
    # it, a counter within one second); the finished run is left as it was.
    again = runs.open_run("toy", "experiments.bench_reclaim", config, seed=7, root=tmp_path)
    assert again.path != run.path and not again.complete
    assert again.config["key"] == run.config["key"] == run.path.name.split("-")[1]
    assert runs.read_points(again.path) == [] and runs.read_metrics(run.path) == summary
    again.add_point({"x": 9, "y": 9.0})  # then interrupted: no metrics.json
    # Another config: another key.
    other = runs.open_run("toy", "experiments.bench_reclaim", {"size": 5, "sweep": [1, 2]},
                          seed=7, root=tmp_path)
    assert other.config["key"] != run.config["key"]
    assert runs.run_directories(tmp_path, "toy", run.config["key"]) == [run.path, again.path]

    # --replay: the newest complete run with the key (the interrupted one is not complete);
    # nothing is made. With --overwrite it measures anew after all.
    before = sorted(tmp_path.iterdir())
    shown = runs.open_run("toy", "experiments.bench_reclaim", config, seed=7, root=tmp_path,
                          replay=True)
    assert shown.path == run.path and shown.complete and shown.stored_summary() == summary
    assert sorted(tmp_path.iterdir()) == before
    fresh = runs.open_run("toy", "experiments.bench_reclaim", config, seed=7, root=tmp_path,
                          replay=True, overwrite=True)
    assert not fresh.complete and fresh.path not in before
    with pytest.raises(runs.cli.BadInput, match="no complete run"):
        runs.open_run("toy", "experiments.bench_reclaim", {"size": 6}, seed=7, root=tmp_path,
                      replay=True)
    assert [(p["x"], p["y"]) for p in runs.read_points(again.path)] == [(9, 9.0)]


def _fake_run(tmp_path, module, points, metrics):
    run = runs.open_run(module.__name__.split(".")[-1], module.__name__, {}, seed=0,
                        root=tmp_path)
    for point in points:
        run.add_point(point)
    run.finish(metrics)
    return run.path


def test_each_benchmark_plots_from_its_files_alone(tmp_path):
    release = dict(kind="release", blocks=1 << 13, tenant=62, shared_prefix=False, seconds=1e-3,
                   loop_seconds=2e-3, blocks_returned=10, transferred_blocks=0)
    reclaim = _fake_run(tmp_path, bench_reclaim, [
        release, dict(release, tenant=0, shared_prefix=True),
        dict(kind="scaling", blocks=1 << 13, sequences=64, seconds=1e-3),
        dict(kind="scaling", blocks=1 << 14, sequences=128, seconds=2e-3)], {"speedup": 2.0})
    cpu = dict(kind="cpu", batch=1, context=256, dense_ms=1.0, paged_ms=1.5, ratio=1.5,
               naive_paged_ms=2.0, naive_ratio=2.0, max_abs_diff=0.0)
    rate = dict(ms=1.0, bytes=1, tb_s=1.0, of_copy=0.5, of_peak=0.2)
    gpu = dict(kind="gpu", model="qwen2.5-7b", batch=32, context=32768, copy=rate,
               ours_bf16=rate, peer_bf16=rate, ours_int8=rate)
    attention = _fake_run(tmp_path, bench_attention, [cpu, dict(cpu, context=512), gpu],
                          {"cpu": {"model": "smollm2-135m"}, "gpu": {"dry_run": True}})
    point = dict(batch=1, context=64, decode_step_ms=dict(dense=1.0, paged=1.1),
                 prefill_tokens_per_s=dict(dense=100.0, paged=90.0))
    model = _fake_run(tmp_path, bench_model, [point, dict(point, context=128),
                                              dict(batch=8, context=128, error="MemoryError")],
                      {"model": "smollm2-135m", "kv_format": "f32"})
    assert runs.replot(reclaim) == ["release_times.png", "scaling.png"]
    assert runs.replot(attention) == ["cpu_ratio.png", "gpu_bandwidth.png"]
    assert runs.replot(model) == ["decode_step.png", "prefill.png"]
    for run_dir in (reclaim, attention, model):
        assert all(p.stat().st_size > 0 for p in run_dir.glob("*.png"))


def test_bench_reclaim_json_contract_and_run_directory(tmp_path):
    args = ["--log2_blocks=13", "--scaling=13", "--repeats=2", "--json",
            f"--runs_dir={tmp_path / 'runs'}", f"--out={tmp_path / 'results' / 'r.json'}"]
    result = run_cli("bench_reclaim", *args)
    assert result.returncode == 0, result.stderr
    assert "Unable to initialize backend" not in result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["blocks"] == 1 << 13 and summary["results_match"] is True
    assert summary["speedup"] == pytest.approx(summary["loop_seconds"] / summary["seconds"])
    assert [p["blocks"] for p in summary["scaling"]] == [1 << 13]
    assert summary["config"] == {"log2_blocks": 13, "scaling": [13], "repeats": 2, "seed": 0}
    assert "git_commit" in summary and "versions" in summary and "device" in summary
    run_dir = tmp_path / "runs" / summary["run_dir"].rsplit("/", 1)[-1]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "config.json", "metrics.json", "points.jsonl", "release_times.png", "scaling.png"]
    kinds = [p["kind"] for p in runs.read_points(run_dir)]
    # 2 private tenants, 4 prefix creators; 4 actions x 8 timed tenants (plan + apply).
    assert kinds == ["release"] * (2 + 4) + ["reclaim_action"] * 4 * 8 + ["scaling"]
    actions = summary["reclaim_actions"]
    assert sorted(actions) == sorted(["tiered_quota_cut", "swap_all_quota_cut",
                                      "preempt_all_quota_cut", "lease_expiry"])
    for name, action in actions.items():
        assert action["steps"] and action["median_shortfall_bytes"] == 0, name
        assert action["plan_equals_apply"] is True, name
        assert action["over_release"] == pytest.approx(
            action["seconds"] / action["release_seconds"])
    assert actions["swap_all_quota_cut"]["steps"] == ["suspend_running"]
    assert actions["lease_expiry"]["steps"] == ["release"]
    assert summary["plan_apply_over_release"] == actions["tiered_quota_cut"]["over_release"]
    # At 2^13 blocks (one sequence per tenant) the suspended sequences keep every slot a top-up
    # could take: the latency is not measured, and the summary says why.
    assert summary["top_up"] == {"skipped": "no sequence slot left for the top-up after the "
                                            "reclaim"}
    assert runs.read_metrics(run_dir) == summary
    assert json.loads((tmp_path / "results" / "r.json").read_text()) == summary

    # Again: measured again, into a second run directory; --replay shows the newest complete
    # run of this config and code instead (when no commit landed in between: the commit is part
    # of the key).
    again = run_cli("bench_reclaim", *args)
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout.splitlines()[-1])
    assert second["run_dir"] != summary["run_dir"]
    assert len(list((tmp_path / "runs").glob("bench_reclaim-*"))) == 2
    shown = run_cli("bench_reclaim", *args, "--replay")
    if second["git_commit"] == summary["git_commit"] == runs.git_state()["git_commit"]:
        assert shown.returncode == 0, shown.stderr
        assert "--replay: showing" in shown.stderr
        assert json.loads(shown.stdout.splitlines()[-1]) == second
        assert len(list((tmp_path / "runs").glob("bench_reclaim-*"))) == 2


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_gguf")  # bench_model runs SmolLM2: skips without it, but CI
def test_bench_attention_and_bench_model_small_runs(tmp_path):
    attention = run_cli("bench_attention", "--contexts=64", "--batches=1", "--repeats=2",
                        "--json", f"--runs_dir={tmp_path}")
    assert attention.returncode == 0, attention.stderr
    summary = json.loads(attention.stdout.splitlines()[-1])
    assert [p["context"] for p in summary["cpu"]["points"]] == [64]
    model = run_cli("bench_model", "--batches=1", "--contexts=32", "--decode_steps=1",
                    "--chunk_size=32", "--json", f"--runs_dir={tmp_path}")
    assert model.returncode == 0, model.stderr
    summary = json.loads(model.stdout.splitlines()[-1])
    assert summary["points"][0]["same_greedy_tokens"] in (True, False)
    assert sorted(p.name for p in tmp_path.glob("bench_*/*.png")) == [
        "cpu_ratio.png", "decode_step.png", "prefill.png"]
