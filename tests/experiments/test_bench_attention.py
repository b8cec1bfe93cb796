"""bench_attention's GPU part, made for one short try on a borrowed GPU: a failing section is
data and the others survive, Ctrl-C leaves a partial summary, plots and the description cope
with missing or failed sections. Runs off GPU through --gpu_dry_run (Pallas interpreted) at a
tiny size; the failures are injected by replacing one measurement function."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import bench_attention as ba
from experiments import runs
from tests.experiments.common import run_cli

TINY = ba.Options(skip_cpu=True, gpu_dry_run=True, gpu_batch=1, gpu_context=256, repeats=1,
                  gpu_sections=("copy", "ours", "peer", "int8"))


def _broken(*args, **kwargs):
    raise RuntimeError("injected failure")


def _sections(points):
    return {p["section"]: p for p in points if p["kind"] == "gpu_section"}


def test_a_failing_section_is_recorded_and_the_others_survive(monkeypatch):
    monkeypatch.setattr(ba, "peer_decode", _broken)  # fails while compiling
    points = []
    result = ba.gpu_part(TINY, points.append)
    assert result["peer_bf16"]["stage"] == "compile"
    assert "injected failure" in result["peer_bf16"]["error"]
    assert "injected failure" in result["errors"]["peer_bf16"]
    for name in ("copy", "ours_bf16", "ours_int8"):  # measured all the same
        assert result[name]["tb_s"] > 0, name
    assert result["ours_bf16"]["of_copy"] > 0 and result["int8_speedup_vs_bf16"] > 0
    assert result["speedup_vs_peer"] is None
    assert set(result["max_abs_diff_vs_reference"]) == {"ours_bf16"}
    assert result["max_abs_diff_vs_reference"]["ours_bf16"] < 0.1
    # One points line per section, as it was measured or failed, then the summary line.
    lines = _sections(points)
    assert set(lines) == {"copy", "ours_bf16", "peer_bf16", "ours_int8"}
    assert "error" in lines["peer_bf16"] and "tb_s" in lines["ours_int8"]
    assert points[0]["kind"] == "gpu_setup" and points[-1]["kind"] == "gpu"
    assert result["knob_sweep"] == []  # "sweep" was not asked for


def test_int8_and_reference_failures_are_data_too(monkeypatch):
    monkeypatch.setattr(ba, "quantize_int8", _broken)
    monkeypatch.setattr(ba, "reference_decode", _broken)
    opts = ba.Options(**{**TINY.__dict__, "gpu_sections": ("ours", "int8")})
    points = []
    result = ba.gpu_part(opts, points.append)
    assert result["ours_int8"]["stage"] == "compile" and result["copy"] is None
    assert result["ours_bf16"]["tb_s"] > 0 and result["ours_bf16"]["of_copy"] is None
    assert result["peer_bf16"] is None  # not asked for
    assert result["max_abs_diff_vs_reference"] == {"ours_bf16": None}
    assert "injected failure" in result["errors"]["reference_check"]
    assert any(p["kind"] == "gpu_check" for p in points)


def test_interleaved_drops_a_function_that_fails_and_keeps_the_others():
    calls = {"bad": 0}

    def bad():
        calls["bad"] += 1
        if calls["bad"] == 2:
            raise RuntimeError("second call fails")
        return 0

    times, errors = {}, {}
    ba._interleaved({"good": lambda: 1, "bad": bad}, {"good": (), "bad": ()}, 4, times, errors)
    assert len(times["good"]) == 4 and len(times["bad"]) == 1 and calls["bad"] == 2
    assert errors == {"bad": "RuntimeError: second call fails"}


def test_ctrl_c_writes_a_partial_summary(tmp_path, monkeypatch):
    """SIGINT (KeyboardInterrupt) right after the copy is measured: the run directory still gets
    a metrics.json, marked partial, holding the copy; plot and describe cope."""
    run = runs.open_run("bench_attention", "experiments.bench_attention", TINY.config(), seed=0,
                        root=tmp_path)

    def add_point(point):
        run.add_point(point)
        if point.get("section") == "copy":
            raise KeyboardInterrupt

    summary = run.finish(ba.measure(TINY, add_point), ba.plot)
    assert summary["partial"] is True and "gpu" in summary["interrupted"]
    assert runs.read_metrics(run.path)["partial"] is True
    gpu = summary["gpu"]
    assert gpu["copy"]["tb_s"] > 0 and gpu["ours_bf16"] is None and gpu["dry_run"] is True
    kinds = [p["kind"] for p in runs.read_points(run.path)]
    assert kinds == ["gpu_setup", "gpu_section", "interrupted"]
    assert (run.path / "gpu_bandwidth.png").stat().st_size > 0
    text = ba.describe(summary)
    assert "PARTIAL" in text and "ours bf16 not run" in text


def test_plot_and_describe_cope_with_missing_and_failed_sections(tmp_path):
    rate = dict(ms=1.0, bytes=1, tb_s=1.0, of_copy=0.5, of_peak=0.2)
    points = [
        dict(kind="gpu_setup", model="qwen2.5-7b", batch=32, context=32768),
        dict(kind="gpu_section", section="copy", ms=1.0, tb_s=2.0),
        dict(kind="gpu_section", section="peer_bf16", stage="compile", error="XlaRuntimeError"),
        dict(kind="gpu_section", section="ours_bf16", **rate),
    ]  # no int8 line and no summary line: a run cut short
    gpu = dict(model="qwen2.5-7b", copy=dict(ms=1.0, tb_s=2.0), ours_bf16=rate,
               peer_bf16=dict(error="XlaRuntimeError", stage="compile"), ours_int8=None,
               speedup_vs_peer=None, dry_run=False, errors={"peer_bf16": "XlaRuntimeError"})
    run = runs.open_run("bench_attention", "experiments.bench_attention", {"t": 1}, seed=0,
                        root=tmp_path)
    for point in points:
        run.add_point(point)
    run.finish({"seed": 0, "gpu": gpu, "partial": True, "interrupted": "during the gpu part"})
    assert runs.replot(run.path) == ["gpu_bandwidth.png"]
    text = ba.describe(runs.read_metrics(run.path))
    assert "peer bf16 failed (compile: XlaRuntimeError)" in text
    assert "ours int8 not run" in text and "ours bf16 1.00 TB/s (50% of copy)" in text
    # The old layout (one summary point with all four) still plots; so do no GPU part at all
    # and a GPU part that is only a string.
    assert ba.plot([dict(kind="gpu", model="m", batch=1, context=2, copy=rate, ours_bf16=rate,
                         peer_bf16=rate, ours_int8=rate)], {"gpu": {"dry_run": True}},
                   tmp_path) == ["gpu_bandwidth.png"]
    assert ba.plot([], {"gpu": "skipped: no GPU (backend cpu)"}, tmp_path) == []
    assert ba.describe({"gpu": "skipped: no GPU (backend cpu)"}) == \
        "gpu: skipped: no GPU (backend cpu)"
    assert ba.describe({"gpu": {"model": "m", "errors": {"inputs": "out of memory"}}}) == \
        "gpu m: inputs failed: out of memory"


def test_options_sections_and_config():
    assert ba.Options().sections == ba.GPU_SECTIONS
    assert ba.Options(gpu_sweep=False).sections == ("copy", "ours", "peer", "int8")
    assert ba.Options(gpu_sections=("sweep",), gpu_sweep=False).sections == ()
    config = ba.Options(gpu_sections=("sweep", "copy")).config()
    assert config["gpu_sections"] == ["copy", "sweep"] and config["contexts"][0] == 512


BAD = [
    (["--gpu_sections=copy,warp"], "'warp' is not a GPU section"),
    (["--gpu_sections="], "--gpu_sections needs at least one section"),
    (["--gpu_dry_run", "--gpu_sections=sweep", "--nogpu_sweep"], "leaves no GPU section"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_sections_exit_2_with_one_line(args, message):
    result = run_cli("bench_attention", *args, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0] and result.stdout == ""


@pytest.mark.slow
def test_sweep_alone_skips_the_main_measurement(tmp_path):
    """--gpu_sections=sweep: only the knob sweep's points (no copy, no kernels side by side)."""
    result = run_cli("bench_attention", "--skip_cpu", "--gpu_dry_run", "--gpu_batch=1",
                     "--gpu_context=64", "--page_size=16", "--repeats=1", "--gpu_sections=sweep",
                     "--json", f"--runs_dir={tmp_path}", timeout=300)
    assert result.returncode == 0, result.stderr
    gpu = json.loads(result.stdout.splitlines()[-1])["gpu"]
    assert gpu["sections"] == ["sweep"] and gpu["copy"] is None and gpu["ours_bf16"] is None
    assert len(gpu["knob_sweep"]) == 12
    assert all("tb_s" in s or "error" in s for s in gpu["knob_sweep"])


@pytest.mark.slow
def test_sigint_in_a_subprocess_leaves_a_partial_run(tmp_path):
    """The real signal, sent while the sweep runs (as `timeout -s INT` does, here to a command
    started in the background, which inherits SIGINT ignored): exit 130, the partial summary as
    the last stdout line and in metrics.json, the points measured before it kept."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--skip_cpu", "--gpu_dry_run", "--gpu_batch=1", "--gpu_context=64", "--repeats=1",
            "--gpu_sections=copy,sweep", "--json", f"--runs_dir={tmp_path}"]
    ignoring_sigint = ["/bin/sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable]
    proc = subprocess.Popen([*ignoring_sigint, "-m", "experiments.bench_attention", *args],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any("gpu_knobs" in p.read_text() for p in tmp_path.glob("*/points.jsonl")):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    summary = json.loads(out.splitlines()[-1])
    assert summary["partial"] is True and summary["gpu"]["copy"]["tb_s"] > 0
    assert 1 <= len(summary["gpu"]["knob_sweep"]) < 12
    (run_dir,) = tmp_path.glob("bench_attention-*")
    assert runs.read_metrics(run_dir)["partial"] is True
    assert runs.read_points(run_dir)[-1]["kind"] == "interrupted"
    assert "Traceback" not in err
