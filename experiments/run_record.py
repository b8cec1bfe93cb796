"""What every benchmark record carries (command, versions, device, load) and how it is written.

Shared by the benchmark entry points so their JSON files agree on these keys. Timings on a
shared machine drift with its load, so the load average is recorded beside them.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import sys

import jax


def run_metadata(module: str) -> dict:
    """The command that made a record, the library versions and the device it ran on."""
    device = jax.devices()[0]
    versions = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "flax", "numpy"):
        versions[package] = importlib.metadata.version(package)
    return {
        "command": " ".join(["python -m", module, *sys.argv[1:]]),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "device": {
            "platform": device.platform,
            "kind": device.device_kind,
            "count": jax.device_count(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_1_5_15": list(os.getloadavg()),
        },
    }


def write_record(record: dict, out: str | None, print_json: bool) -> None:
    """Writes `record` as indented JSON to `out` (when given) and prints it (when asked)."""
    text = json.dumps(record, indent=2)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
    if print_json:
        print(text)
