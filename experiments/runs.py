r"""Run directories: what an experiment measured, keyed by its resolved config (kvpress-style).

Each run of an experiment writes

    runs/<experiment>-<key>-<UTC time>/
      config.json    the resolved config (every flag that changes what is measured, parsed), the
                     seed, the git commit, whether tracked files differ from it (`git_dirty`) and
                     a hash of every uncommitted change (`git_changes`), the library versions,
                     the device, the machine's load average and the command
      points.jsonl   one JSON object per measured point, appended as it is measured (each with the
                     1-minute load average when it was taken); a failed point (out of memory, a
                     configuration that does not compile) is a line with an "error", not a crash
      metrics.json   the summary, written last: its presence marks the run as complete
      *.png          plots drawn from points.jsonl and metrics.json only (matplotlib, Agg)

<key> is a short hash of the experiment, its resolved config, the git commit, the uncommitted
changes (`git_changes`: a hash of the diff of tracked files against the commit and of every
untracked file git does not ignore, names and contents; None on a clean tree) and the jax
platform: runs of the same measurement of the same code on the same kind of device share the
key, and an edit of the code, committed or not, changes it.

Every run measures, into a new directory (the time stamp, and a counter should two runs start
in the same second, keep them apart): a finished run is never overwritten and never shown in
place of a measurement. Only --replay shows again the newest complete run with this key (same
config, same code, committed or not) instead of measuring; with no such run it is an error. An
interrupted run is a directory without metrics.json, left as it is. The summary also goes to
stdout with --json (one line, the last) and to --out (a file, e.g. under results/, where
committed summaries live).

Plots can be redrawn from a run directory alone:

    python -m experiments.runs --run_dir=runs/bench_reclaim-1a2b3c4d-20261206T181640Z
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import logging as logging_module
import os
import pathlib
import platform
import subprocess
import sys
from typing import Callable

from absl import flags, logging

import kvquota as kq
from experiments import cli

FLAGS = flags.FLAGS
RUNS_DIR = "runs"
CONFIG, POINTS, METRICS = "config.json", "points.jsonl", "metrics.json"
REPO = pathlib.Path(__file__).resolve().parents[1]

# A plot function: (points, metrics, run directory) -> names of the PNG files it wrote.
PlotFn = Callable[[list, dict, pathlib.Path], list]


def define_flags() -> None:
    """--runs_dir, --replay, --overwrite, --out and --progress (--noprogress), for an experiment
    that writes a run directory."""
    main = sys.argv[0]  # credited to the main module, so --help lists them
    flags.DEFINE_string("runs_dir", RUNS_DIR, "Where run directories are made.", module_name=main)
    flags.DEFINE_boolean("replay", False,
                         "Do not measure: show again the newest complete run of this config and "
                         "this code (committed and uncommitted), an error when there is none.",
                         module_name=main)
    flags.DEFINE_boolean("overwrite", False,
                         "Measure anew even with --replay, and replace committed results where "
                         "the experiment guards them (--out_dir).", module_name=main)
    flags.DEFINE_string("out", None,
                        "Also write the summary JSON to this file (e.g. results/<name>.json).",
                        module_name=main)
    cli.define_progress()
    cli.define_json()


# ---- what every record carries ----------------------------------------------------------------


def git_state() -> dict:
    """The checkout's commit, whether tracked files differ from it, and `git_changes`: a hash of
    everything uncommitted that could change a result (the diff of tracked files and the
    untracked, non-ignored files, names and contents), None on a clean tree. All None off a
    git tree."""

    def git(*args) -> bytes:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              timeout=30, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").decode().strip()
        diff = git("diff", "--binary", "HEAD")
        untracked = git("ls-files", "--others", "--exclude-standard", "-z").split(b"\0")
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None, "git_changes": None}
    changes = hashlib.sha256(diff)
    for name in sorted(n for n in untracked if n):
        changes.update(b"\0" + name + b"\0")
        try:
            changes.update((REPO / name.decode()).read_bytes())
        except OSError:  # removed since git listed it
            pass
    dirty = bool(diff) or any(untracked)
    return {"git_commit": commit, "git_dirty": bool(diff),
            "git_changes": changes.hexdigest()[:16] if dirty else None}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "flax", "numpy", "kvquota"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def device() -> dict:
    """The device jax runs on, the machine and its load average now."""
    import jax

    first = jax.devices()[0]
    return {
        "platform": first.platform,
        "kind": first.device_kind,
        "count": jax.device_count(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": list(os.getloadavg()),
    }


def command(module: str) -> str:
    return " ".join(["python -m", module, *sys.argv[1:]])


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_key(experiment: str, config: dict, git_commit: str | None, platform_name: str,
            git_changes: str | None = None) -> str:
    """8 hex digits of the sha256 of what decides a measurement."""
    what = {"experiment": experiment, "config": config, "git_commit": git_commit,
            "platform": platform_name}
    if git_changes is not None:  # a clean tree keeps the key it always had
        what["git_changes"] = git_changes
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


# ---- the run directory ------------------------------------------------------------------------


def _write_json(path: pathlib.Path, record: dict, indent: int | None = 2) -> None:
    """Writes atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=indent) + "\n")
    os.replace(tmp, path)


def read_points(run_dir) -> list[dict]:
    return kq.read_json_lines(pathlib.Path(run_dir) / POINTS)


def read_metrics(run_dir) -> dict:
    return json.loads((pathlib.Path(run_dir) / METRICS).read_text())


def read_config(run_dir) -> dict:
    return json.loads((pathlib.Path(run_dir) / CONFIG).read_text())


@dataclasses.dataclass
class Run:
    """One run directory. `complete`: a finished run shown again (--replay): nothing to
    measure."""

    path: pathlib.Path
    config: dict
    complete: bool = False

    def add_point(self, point: dict) -> None:
        """Appends one measured point (flushed at once, so an interrupted run keeps its data)."""
        point = dict(point)
        point.setdefault("load_average_1min", os.getloadavg()[0])
        with open(self.path / POINTS, "a") as f:
            f.write(json.dumps(point) + "\n")

    def finish(self, measured: dict, plot: PlotFn | None = None) -> dict:
        """Writes the summary (measured results plus the run's metadata) and the plots; returns
        the summary."""
        summary = {**measured, **summary_metadata(self)}
        _write_json(self.path / METRICS, summary)
        if plot is not None:
            draw(self.path, plot)
        self.complete = True
        return summary

    def stored_summary(self) -> dict:
        return read_metrics(self.path)


def summary_metadata(run: Run) -> dict:
    """The keys a summary carries beside its results (the record of how it was made)."""
    c = run.config
    return {
        "command": c["command"],
        "time_utc": now_utc(),
        "versions": c["versions"],
        "device": device(),  # load average at the end of the run
        "seed": c["seed"],
        "git_commit": c["git_commit"],
        "git_dirty": c["git_dirty"],
        "git_changes": c.get("git_changes"),  # absent from runs recorded before it existed
        "config": c["config"],
        "run_dir": str(run.path),
    }


def run_directories(root, experiment: str, key: str) -> list[pathlib.Path]:
    """The directories of runs with this key under `root`, oldest first (the time stamp sorts;
    `<experiment>-<key>` alone is how runs were named before each run had its own)."""
    root = pathlib.Path(root)
    found = [p for p in root.glob(f"{experiment}-{key}-*") if p.is_dir()]
    if (root / f"{experiment}-{key}").is_dir():
        found.append(root / f"{experiment}-{key}")
    return sorted(found, key=lambda p: (p.name != f"{experiment}-{key}", p.name))


def _new_directory(root: pathlib.Path, name: str) -> pathlib.Path:
    """Creates `root/<name>-<UTC time>` (then -2, -3, ... when runs start in the same second);
    never an existing directory."""
    stamp = now_utc().replace("-", "").replace(":", "").replace("+0000", "Z")
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = root / f"{name}-{stamp}{'' if n == 1 else f'-{n}'}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise OSError(f"no free run directory for {name} at {stamp} under {root}")


def open_run(experiment: str, module: str, config: dict, *, seed, root: str = RUNS_DIR,
             replay: bool | None = None, overwrite: bool = False) -> Run:
    """A new run directory for `config` under `root` (config.json written): every run measures.

    `replay` (default: the --replay flag where the program defines it) returns instead the
    newest complete run with the same key (same experiment, config, code and platform) with
    `complete=True`, and raises cli.BadInput when there is none; `overwrite` (--overwrite)
    measures anew even then.
    """
    replay = bool(cli.flag_or("replay", False)) if replay is None else replay
    git = git_state()
    dev = device()
    key = run_key(experiment, config, git["git_commit"], dev["platform"], git["git_changes"])
    if replay and not overwrite:
        done = [p for p in run_directories(root, experiment, key) if (p / METRICS).exists()]
        if not done:
            raise cli.BadInput(f"--replay: no complete run of {experiment} with this config and "
                               f"code (key {key}) under {root}; run without --replay to measure")
        return Run(done[-1], read_config(done[-1]), complete=True)
    path = _new_directory(pathlib.Path(root), f"{experiment}-{key}")
    record = {
        "experiment": experiment,
        "module": module,
        "key": key,
        "config": config,
        "seed": seed,
        **git,
        "command": command(module),
        "time_utc": now_utc(),
        "versions": versions(),
        "device": dev,
    }
    _write_json(path / CONFIG, record)
    (path / POINTS).touch()
    return Run(path, record)


# ---- plots ------------------------------------------------------------------------------------


def draw(run_dir, plot: PlotFn) -> list[str]:
    """Draws `plot` from the files of `run_dir` only; a plotting error is a note, not a lost run."""
    import matplotlib

    matplotlib.use("Agg")
    logging_module.getLogger("matplotlib").setLevel(logging_module.WARNING)  # font cache notes
    run_dir = pathlib.Path(run_dir)
    try:
        return plot(read_points(run_dir), read_metrics(run_dir), run_dir)
    except Exception as error:  # the data is already on disk
        cli.note(f"plotting {run_dir} failed: {type(error).__name__}: {error}")
        return []


def replot(run_dir) -> list[str]:
    """Redraws a run directory's plots with the `plot` function of the experiment that made it."""
    config = read_config(run_dir)
    module = importlib.import_module(config["module"])
    return draw(run_dir, module.plot)


# ---- the whole flow of a benchmark's main ------------------------------------------------------


def replay_note(run: Run) -> None:
    """The stderr note of a run shown again (--replay) instead of measured."""
    c = run.config
    changes = f", uncommitted changes {c['git_changes']}" if c.get("git_changes") else ""
    cli.note(f"--replay: showing {run.path} (measured {c['time_utc']} at git "
             f"{str(c['git_commit'])[:10]}{changes}), not measuring")


def execute(experiment: str, config: dict, measure: Callable[[Callable[[dict], None]], dict], *,
            seed, plot: PlotFn | None = None,
            describe: Callable[[dict], str] | None = None) -> dict:
    """Opens a new run directory for `config`, measures (`measure(add_point)` returns the
    results; a progress counter of the points on stderr unless --noprogress), or with --replay
    shows the newest complete run instead, writes the summary to --out and prints it (--json: one
    line of JSON, the last of stdout; else `describe(summary)`). Returns the summary."""
    module = f"experiments.{experiment}"
    run = open_run(experiment, module, config, seed=seed, root=FLAGS.runs_dir,
                   overwrite=FLAGS.overwrite)
    if run.complete:
        replay_note(run)
        summary = run.stored_summary()
    else:
        logging.info("writing %s", run.path)
        with cli.progress_bar(desc=experiment, unit="point") as bar:
            def add_point(point: dict) -> None:
                run.add_point(point)
                bar.update(1)

            measured = measure(add_point)
        summary = run.finish(measured, plot)
    if FLAGS.out:
        out = pathlib.Path(FLAGS.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_json(out, summary)
    if FLAGS.json:
        print(json.dumps(summary), flush=True)
    elif describe is not None:
        print(describe(summary))
        print(f"run directory: {run.path}")
    return summary


def _define_replot_flags():
    flags.DEFINE_string("run_dir", None, "A run directory (runs/<experiment>-<key>-<time>).",
                        required=True)


def main(argv):
    del argv
    run_dir = pathlib.Path(FLAGS.run_dir)
    if not (run_dir / METRICS).exists():
        raise cli.BadInput(f"{run_dir} holds no {METRICS}: not a complete run directory")
    for name in replot(run_dir):
        print(run_dir / name)


if __name__ == "__main__":
    cli.run(main, _define_replot_flags)
