"""bench_tiers: offload, restore and compress timed beside plain copies, bytes from the reports
checked against the ledger. A tiny run through the CLI (its JSON contract, its run directory,
bytes recomputed here from the config), the plot and description from files alone (a failed op
included), the ledger cross-check catching a difference, and bad invocations refused in one line
before any work."""

import concurrent.futures
import json
import types

import pytest

from experiments import bench_tiers as bt
from experiments import runs
from tests.experiments.common import run_cli

FORMATS = ["int8", "kivi2", "fp8"]  # a symmetric, an asymmetric and a plain-float pool
TINY_ARGS = dict(seqs=2, seq_tokens=40, keep_recent=8, formats=FORMATS)


def test_tiny_run_json_contract_and_bytes_match_the_ledger(tmp_path):
    args = ["--models=smollm2-135m", f"--seqs={TINY_ARGS['seqs']}",
            f"--seq_tokens={TINY_ARGS['seq_tokens']}", f"--keep_recent={TINY_ARGS['keep_recent']}",
            "--formats=" + ",".join(TINY_ARGS["formats"]), "--repeats=2", "--json",
            f"--runs_dir={tmp_path / 'runs'}", f"--out={tmp_path / 'results' / 't.json'}"]
    result = run_cli("bench_tiers", *args)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    for key in ("models", "partial", "failed_ops", "all_bytes_match_ledger", "all_checked",
                "timing", "config", "git_commit", "versions", "device", "command", "run_dir"):
        assert key in summary, key
    assert summary["partial"] is False and summary["failed_ops"] == []
    assert summary["all_bytes_match_ledger"] is True and summary["all_checked"] is True
    model = summary["models"]["smollm2-135m"]
    assert set(model) == {"setup", "offload", "restore", "compress", "evict"}
    assert set(model["compress"]) == set(FORMATS) and set(model["evict"]) == {"token", "block"}
    # Half of each 40-token sequence evicted: token mode packs the 20 kept into 2 blocks (1 of
    # 3 returned per sequence); block mode keeps the 20 // 16 = 1 best whole block.
    pb0 = bt.make_config("smollm2-135m", seqs=2, seq_tokens=40, block_size=16,
                         formats=FORMATS).pool_bytes[0]
    assert model["evict"]["token"]["evicted_tokens"] == 40
    assert model["evict"]["token"]["pool_bytes_returned"] == 2 * pb0
    assert model["evict"]["block"]["pool_bytes_returned"] == 4 * pb0
    assert all(model["evict"][m]["bytes_match_ledger"] for m in ("token", "block"))

    # Bytes recomputed here from the config: 2 sequences of 40 tokens hold 3 blocks each; the
    # full blocks wholly before the last 8 tokens are 2 per sequence.
    config = bt.make_config("smollm2-135m", seqs=2, seq_tokens=40, block_size=16,
                            formats=FORMATS)
    pb, host = config.pool_bytes, config.host_pool
    assert [p["bytes_per_block"] for p in model["setup"]["pools"]] == list(pb)
    for op, src, dst in (("offload", 0, host), ("restore", host, 0)):
        rec = model[op]
        assert rec["blocks_moved"] == 6 and rec["bytes_moved"] == 6 * pb[0]
        assert rec["pool_bytes_returned"] == 6 * pb[src] == rec["ledger"]["pool_bytes_returned"]
        assert rec["ledger"]["bytes_moved"] == rec["bytes_moved"]
        assert rec["ledger"]["free_blocks_delta"][src] == 6
        assert rec["ledger"]["charged_blocks_delta"][dst] == 6
        assert rec["bytes_match_ledger"] and rec["checked"] and rec["reports_consistent"]
        assert rec["seconds"] > 0 and rec["ratio_vs_device_copy"] > 0
        assert len(rec["seconds_all"]) == 2 and len(rec["device_copy_seconds_all"]) == 6
        assert rec["ratio_vs_host_copy"] is None or rec["ratio_vs_host_copy"] > 0
        assert rec["transfer_seconds_modelled"] == rec["bytes_moved"] / config.host_bandwidth
    assert model["offload"]["device_bytes_returned"] == 6 * pb[0]
    assert model["restore"]["device_bytes_returned"] == -6 * pb[0]
    for pool, fmt in enumerate(FORMATS, start=1):
        rec = model["compress"][fmt]
        assert rec["blocks_compressed"] == 4 and rec["blocks_as_expected"]
        assert rec["pool0_bytes_freed"] == 4 * pb[0] == rec["ledger"]["pool0_bytes_freed"]
        assert rec["compressed_bytes_charged"] == 4 * pb[pool]
        assert rec["compressed_bytes_charged"] == rec["ledger"]["compressed_bytes_charged"]
        assert rec["net_device_bytes_returned"] == 4 * (pb[0] - pb[pool])
        assert rec["net_device_bytes_returned"] == rec["ledger"]["net_device_bytes_returned"]
        assert rec["bytes_match_ledger"] and rec["checked"]
        assert rec["host_copy_seconds"] is None and rec["ratio_vs_device_copy"] > 0
    # int8 of bf16: half the bytes, plus a bf16 scale per token and head.
    assert model["compress"]["int8"]["fraction_of_bf16_block"] == pytest.approx(0.5 + 2 / 128)
    assert model["compress"]["fp8"]["fraction_of_bf16_block"] == 0.5

    run_dir = tmp_path / "runs" / summary["run_dir"].rsplit("/", 1)[-1]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "config.json", "metrics.json", "points.jsonl", "tiers.png"]
    points = runs.read_points(run_dir)
    assert [(p["kind"], p.get("op"), p.get("format")) for p in points] == [
        ("setup", None, None), ("op", "offload", None), ("op", "restore", None),
        *[("op", "compress", fmt) for fmt in FORMATS], ("op", "evict", "token"),
        ("op", "evict", "block")]
    assert runs.read_metrics(run_dir) == summary
    assert json.loads((tmp_path / "results" / "t.json").read_text()) == summary
    assert runs.replot(run_dir) == ["tiers.png"]


def test_plot_and_describe_from_files_with_a_failed_op(tmp_path):
    ok = dict(kind="op", model="m", seconds=1e-3, ratio_vs_device_copy=2.0,
              ratio_vs_host_copy=1.5, device_bytes_returned=1 << 20, bytes_match_ledger=True)
    points = [dict(kind="setup", model="m"), dict(ok, op="offload", format=None),
              dict(kind="op", model="m", op="restore", format=None, error="PoolFullError: x"),
              dict(ok, op="compress", format="int8", ratio_vs_host_copy=None)]
    metrics = {"models": {"m": {"offload": points[1], "restore": {"error": "PoolFullError: x"},
                                "compress": {"int8": points[3]}}},
               "all_bytes_match_ledger": True, "partial": True}
    run = runs.open_run("bench_tiers", "experiments.bench_tiers", {"t": 1}, seed=0,
                        root=tmp_path)
    for point in points:
        run.add_point(point)
    run.finish(metrics)
    assert runs.replot(run.path) == ["tiers.png"]
    assert (run.path / "tiers.png").stat().st_size > 0
    text = bt.describe(runs.read_metrics(run.path))
    assert "m restore: failed: PoolFullError: x" in text
    assert "m offload: 1.00 ms, x2.00 of a device copy, x1.50 of a host copy" in text
    assert "PARTIAL" in text
    assert bt.plot([dict(kind="op", model="m", op="offload", error="e")], {}, tmp_path) == []


def test_the_ledger_cross_check_catches_a_difference():
    config = bt.make_config("smollm2-135m", seqs=1, seq_tokens=40, block_size=16,
                            formats=["int8"])
    pb = config.pool_bytes
    rep = types.SimpleNamespace(blocks_compressed=2, pool0_bytes_freed=2 * pb[0],
                                compressed_bytes_charged=2 * pb[1],
                                net_device_bytes_returned=2 * (pb[0] - pb[1]))
    right = {"free_blocks": [2, -2, 0], "charged_blocks": [-2, 2, 0]}
    assert bt.compress_record(config, rep, right, 1)["bytes_match_ledger"]
    wrong = {"free_blocks": [2, -2, 0], "charged_blocks": [-1, 2, 0]}
    assert not bt.compress_record(config, rep, wrong, 1)["bytes_match_ledger"]
    move = types.SimpleNamespace(blocks_moved=3, bytes_moved=3 * pb[0],
                                 pool_bytes_returned=3 * pb[0], transfer_seconds=0.0,
                                 host_alarm=False)
    delta = {"free_blocks": [3, 0, -3], "charged_blocks": [-3, 0, 3]}
    assert bt.move_record(config, move, delta, 0, 2)["bytes_match_ledger"]
    delta["free_blocks"][2] = -2
    assert not bt.move_record(config, move, delta, 0, 2)["bytes_match_ledger"]


# (arguments, text the one-line error must contain): BAD run by default, MORE_BAD with -m slow.
BAD = [
    (["--formats=f16"], "kv_format 'f16' is neither quantized nor narrower than pool 0's bf16"),
    (["--formats=int3"], "unknown kv_format 'int3'"),
    (["--seqs=0"], "--seqs=0"),
    (["--models=qwen2.5-7b", "--seq_tokens=8000"], "over --max_state_mib=512"),
]
MORE_BAD = [
    (["--formats=int8,bf16"], "kv_format 'bf16' is neither quantized nor narrower"),
    (["--formats=f32"], "use some of: fp8, int8, int4, kivi2, kivi4"),
    (["--formats=int8,int8"], "lists a format twice"),
    (["--formats="], "--formats needs at least one compressed format"),
    (["--models=gpt-5"], "unknown model 'gpt-5'"),
    (["--seq_tokens=0"], "--seq_tokens=0"),
    (["--repeats=0"], "--repeats=0"),
    (["--keep_recent=-1"], "--keep_recent=-1"),
    (["--models=smollm2-135m", "--seq_tokens=9000"], "exceeds smollm2-135m's context of 8192"),
    (["--keep_recent=1000"], "leaves no full block"),
    (["int8"], "unexpected positional argument int8"),
]


def _run_all(tmp, cases):
    """Every case side by side (each a subprocess that stops before any work)."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {tuple(args): pool.submit(run_cli, "bench_tiers", *args,
                                            f"--runs_dir={tmp}", cwd=tmp, timeout=120)
                   for args, _ in cases}
        return {key: future.result() for key, future in futures.items()}


@pytest.fixture(scope="module")
def bad_results(tmp_path_factory):
    return _run_all(tmp_path_factory.mktemp("tiers_cli"), BAD)


@pytest.fixture(scope="module")
def more_bad_results(tmp_path_factory):
    return _run_all(tmp_path_factory.mktemp("tiers_cli_more"), MORE_BAD)


def _check_bad(result, message):
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert result.returncode == 2 and result.stdout == ""


def _ids(cases):
    return [" ".join(args) or "(empty)" for args, _ in cases]


@pytest.mark.parametrize("args,message", BAD, ids=_ids(BAD))
def test_bad_invocation_exits_2_with_one_line(bad_results, args, message):
    _check_bad(bad_results[tuple(args)], message)


@pytest.mark.slow
@pytest.mark.parametrize("args,message", MORE_BAD, ids=_ids(MORE_BAD))
def test_more_bad_invocations(more_bad_results, args, message):
    _check_bad(more_bad_results[tuple(args)], message)


SMALL = dict(models=["smollm2-135m"], formats=["int8"], seqs=1, seq_tokens=40, block_size=16,
             keep_recent=8, repeats=1, scrub_on_free=False, seed=0)


def test_ctrl_c_keeps_what_was_measured_and_marks_it_partial():
    points = []

    def on_point(point):
        points.append(point)
        if point.get("op") == "offload":
            raise KeyboardInterrupt

    result = bt.run(SMALL, on_point)
    assert result["partial"] is True
    per = result["models"]["smollm2-135m"]
    assert per["offload"]["bytes_match_ledger"] and per["restore"] is None
    assert per["compress"] == {} and result["all_bytes_match_ledger"] is True
    assert "m restore" not in bt.describe(result) and "PARTIAL" in bt.describe(result)


def test_a_failed_setup_is_data(monkeypatch):
    def broken(*args, **kwargs):
        raise MemoryError("injected")

    monkeypatch.setattr(bt, "build_state", broken)
    points = []
    result = bt.run({**SMALL, "models": ["smollm2-135m", "tiny-qwen"]}, points.append)
    assert result["failed_ops"] == ["smollm2-135m setup", "tiny-qwen setup"]
    assert result["partial"] is False and result["all_bytes_match_ledger"] is False
    assert [p["kind"] for p in points] == ["setup", "setup"] and "injected" in points[0]["error"]
    assert "smollm2-135m setup failed: MemoryError: injected" in bt.describe(result)
