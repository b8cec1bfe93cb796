"""`experiments.multihost`: the sharded state and model as several JAX processes on this machine
(`jax.distributed` with a localhost coordinator, gloo CPU collectives), checked against one
device.

Default run (about a minute on two cores): the launcher's own pieces, each a real command line:
bad flags are one line and exit 2 before anything starts; a worker killed from outside, or a run
past --timeout_s, fails the command with one line naming the process and leaves no worker
running; the HLO reading that prices the collectives, on the three spellings of device groups.
Slow (-m slow): whole runs, on SmolLM2 (the issue's 2 processes x 4 devices) and on a tiny model
with KV heads split inside each process, and a worker that SIGKILLs itself mid-decode.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from experiments import multihost as mh
from tests.conftest import REPO, require_smollm2
from tests.experiments.common import run_cli

SUMMARY_KEYS = ["processes", "devices", "tokens_equal", "state_equal", "reclaim_ok",
                "wall_seconds"]


def _one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def _drop_logs(line: str) -> None:
    """Removes the worker logs a failed run keeps (named in its error line)."""
    m = re.search(r"\(logs: (\S+)\)$", line)
    assert m, line
    shutil.rmtree(m.group(1), ignore_errors=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _launch(tmp_path, *args):
    """The launcher started in the background, and the file it writes its workers' pids to."""
    pids = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "experiments.multihost", "--json",
                             f"--pids_file={pids}", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, pids


def _pids(path: pathlib.Path, count: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = [int(x) for x in path.read_text().split()]
            if len(pids) == count:
                return pids
        time.sleep(0.1)
    raise AssertionError(f"no {count} pids in {path}")


# ---- flags ---------------------------------------------------------------------------------------

BAD = [
    (["--kv=2"], "--kv=2 must divide smollm2-135m's 3 KV heads"),
    (["--kv=3"], "--kv=3 must divide --devices_per_process=4"),
    (["--num_processes=0"], "--num_processes=0"),
    (["--process_id=2"], "--process_id=2 must be below --num_processes=2"),
    (["--kill_process=0", "--kill_at_step=40"], "--kill_at_step=40 must be below --decode_steps"),
    (["stray"], "unexpected positional argument stray"),
]


def test_bad_flags_exit_2_with_one_line_before_anything_starts():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: run_cli("multihost", *case[0], timeout=120), BAD))
    for (args, message), proc in zip(BAD, results):
        line = _one_error_line(proc)
        assert message in line, (args, line)
        assert proc.returncode == 2, (args, proc.returncode)
        assert proc.stdout == "", args


def test_default_mesh_keeps_a_kv_group_inside_one_process():
    """--kv defaults to gcd(devices per process, KV heads): SmolLM2's 3 KV heads on 4 devices
    give kv=1 (seq=8 over 2 processes); on 3 devices kv=3; tiny-qwen's 2 heads on 4, kv=2."""
    base = dict(num_processes=2, devices_per_process=4, kv=None, decode_steps=32,
                model="smollm2-135m", timeout_s=600, process_id=None, kill_process=None,
                kill_at_step=1, json=True)
    for change, kv, seq in (({}, 1, 8), ({"devices_per_process": 3}, 3, 2),
                            ({"model": "tiny-qwen"}, 2, 4), ({"num_processes": 1}, 1, 4)):
        setup = mh.resolve({**base, **change})
        assert (setup.kv, setup.seq) == (kv, seq), change
        assert setup.devices == setup.kv * setup.seq


# ---- reading the compiled step -----------------------------------------------------------------


def test_device_groups_in_the_three_hlo_spellings():
    groups = mh.device_groups
    # mesh axes (what jax 0.10 prints): the devices that differ only along the listed axes
    assert groups("replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=1] {'axis_0'}, x", 8) == [
        [0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups("replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=2,'axis_3'=4], "
                  "device_ids=([4,2]T(1,0)) {'axis_2'}, x", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # iota lists and explicit lists
    assert groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("replica_groups={{0,1},{2,3}}, x", 4) == [[0, 1], [2, 3]]
    assert groups("source_target_pairs={{0,1},{1,0}}, x", 2) == [[0, 1], [1, 0]]
    assert groups("replica_groups={}, x", 4) is None  # every device
    assert groups("%x = f32[2] add(%a, %b)", 4) is None


def test_collective_costs_count_runs_bytes_and_process_crossings():
    """Ops in the loop over layers run once per layer (the while's known trip count); bytes are
    each run's result bytes; an op crosses processes when one of its groups does."""
    hlo = "\n".join([
        "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %ag = f32[8,2,16]{2,1,0} all-gather(%a), channel_id=1, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=1] {'axis_0'}, dimensions={0}",
        "  %ar = f32[8,1,64]{2,1,0} all-reduce(%b), channel_id=2, replica_groups=mesh['axis_0'=1,"
        "'axis_1'=1,'axis_2'=2,'axis_3'=4], device_ids=([4,2]T(1,0)) {'axis_2'}, to_apply=%add",
        "}",
        "ENTRY %main (x: f32[8]) -> f32[8] {",
        '  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config='
        '{"known_trip_count":{"n":"30"}}',
        "  %ars = (bf16[4]{0}, s32[2]{0}) all-reduce-start(%c, %d), replica_groups={}",
        "  %ard = (bf16[4]{0}, s32[2]{0}) all-reduce-done(%ars)",
        "  ROOT %y = f32[8] add(%x, %x)",
        "}"])
    assert mh.runs_per_call(hlo) == {"main": 1, "body": 30}
    costs = mh.collective_costs(hlo, [0, 0, 0, 0, 1, 1, 1, 1])
    gather, reduce_in, reduce_all = 8 * 2 * 16 * 4, 8 * 64 * 4, 4 * 2 + 2 * 4
    assert costs == {
        "all-gather": dict(ops=1, runs=30, bytes=30 * gather, cross_process_runs=30,
                           cross_process_bytes=30 * gather),
        "all-reduce": dict(ops=2, runs=31, bytes=30 * reduce_in + reduce_all,
                           cross_process_runs=1, cross_process_bytes=reduce_all)}
    from kvquota import sharding as ks

    assert sum(c["ops"] for c in costs.values()) == len(ks.collectives(hlo))


# ---- failures ------------------------------------------------------------------------------------


def _failed_in_one_line(proc, out, err, pids, prefix):
    """The launcher failed with exit 1 and one line starting with `prefix`, printed nothing on
    stdout, and left none of `pids` running."""
    line = _one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert line.startswith(prefix), line
    assert proc.returncode == 1 and out == ""
    assert all(_gone(pid) for pid in pids)
    _drop_logs(line)


def test_a_killed_worker_fails_the_run_and_no_worker_is_left(tmp_path):
    """SIGKILL from outside to worker 1 (not the coordinator): the command exits 1 with one
    line naming process 1 and its signal, within seconds, and worker 0 is killed too."""
    proc, path = _launch(tmp_path, "--model=tiny-qwen", "--decode_steps=4", "--timeout_s=300")
    try:
        pids = _pids(path, 2)
        time.sleep(3)  # into jax's start, or past it
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    _failed_in_one_line(proc, out, err, pids, "error: process 1 exited with status -9 (SIGKILL): ")
    assert took < 10, took


def test_a_run_past_its_timeout_is_killed(tmp_path):
    """--timeout_s bounds the whole run: past it, one line names the workers still running,
    and they are killed (256 decode steps take longer than 10 s anywhere)."""
    proc, path = _launch(tmp_path, "--model=tiny-qwen", "--decode_steps=256", "--timeout_s=10")
    out, err = proc.communicate(timeout=60)
    _failed_in_one_line(proc, out, err, _pids(path, 2, timeout=1),
                        "error: timed out after 10 s with processes 0, 1 still running")


@pytest.mark.slow
def test_a_worker_killed_mid_decode_fails_the_run(tmp_path):
    """--kill_process=1 --kill_at_step=2: worker 1 SIGKILLs itself between two decode steps of
    the sharded run (collectives in flight on the other side): exit 1 within the timeout, one
    line naming process 1, nothing left running."""
    proc, path = _launch(tmp_path, "--model=tiny-qwen", "--decode_steps=4", "--timeout_s=300",
                         "--kill_process=1", "--kill_at_step=2")
    try:
        out, err = proc.communicate(timeout=320)
    finally:
        proc.kill()
        proc.wait()
    _failed_in_one_line(proc, out, err, _pids(path, 2, timeout=1),
                        "error: process 1 exited with status -9 (SIGKILL): ")


# ---- whole runs ----------------------------------------------------------------------------------


def _summary(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip() == "", proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(summary)[:len(SUMMARY_KEYS)] == SUMMARY_KEYS
    for key in ("tokens_equal", "state_equal", "reclaim_ok", "invariants_ok"):
        assert summary[key] is True, (key, summary)
    assert summary["decode_collectives"]["page_data"] == 0  # no page data moves
    assert summary["reclaim"]["shortfall_bytes"] == 0
    assert "suspended" in summary["reclaim"]["fates"].values()
    return summary


@pytest.mark.slow
def test_smollm2_on_two_processes_matches_one_device():
    """The issue's run: SmolLM2 on 2 processes x 4 CPU devices (mesh kv=1 x seq=8: decode rows
    split over every device, so the step's gathers cross the process boundary)."""
    require_smollm2()
    proc = run_cli("multihost", "--json", timeout=900)
    s = _summary(proc)
    assert (s["processes"], s["devices"], s["mesh"]) == (2, 8, {"kv": 1, "seq": 8})
    gathers = s["decode_collectives"]["by_kind"]["all-gather"]
    assert gathers["runs"] == gathers["cross_process_runs"] >= 30  # one a layer at least


@pytest.mark.slow
def test_kv_heads_split_inside_each_process():
    """tiny-qwen's 2 KV heads over a 2-way "kv" axis inside each process (seq=4 across both):
    each process assembles whole pages from its own shards, and the tensor-parallel
    all-reduces stay inside a process while the row gathers cross it."""
    proc = run_cli("multihost", "--json", "--model=tiny-qwen", "--decode_steps=8", timeout=600)
    s = _summary(proc)
    assert (s["processes"], s["devices"], s["mesh"]) == (2, 8, {"kv": 2, "seq": 4})
    kinds = s["decode_collectives"]["by_kind"]
    assert kinds["all-reduce"]["runs"] > 0 and kinds["all-reduce"]["cross_process_runs"] == 0
    assert kinds["all-gather"]["cross_process_runs"] > 0
