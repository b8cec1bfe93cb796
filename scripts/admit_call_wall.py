"""Wall time of one donated admit call at the load test's geometry (2^20 blocks, Qwen2.5-72B),
for the batch shapes a loaded step sends: B rows padded to T tokens. Prints one JSON line.

  python scripts/admit_call_wall.py
  PYTHONPATH=<a worktree of another revision> python scripts/admit_call_wall.py  # side by side

Every row is padding (tenant INVALID), so the state stays as it is and every call does the
same work: each per-entry step of the admission (hashing, lookup, revival grouping, the pop)
still runs on all B x T/16 block entries, which is what a padded batch costs."""

import json
import sys
import time

import jax
import numpy as np

import kvquota as kq
from kvquota.core import admission
from kvquota.sim.loadtest import LoadConfig, state_config

SHAPES = ((64, 16384), (64, 4096), (16, 2048))
CALLS = 15


def main():
    if sys.argv[1:]:
        sys.exit(f"admit_call_wall.py takes no arguments (got {' '.join(sys.argv[1:])})")
    config = state_config(LoadConfig())
    admit = admission.admit_core.jitted(donate=True)
    rng = np.random.default_rng(0)
    out = {}
    for rows, width in SHAPES:
        lengths = np.minimum(rng.lognormal(np.log(2048) - 0.5, 1.0, rows).astype(int) + 1, width)
        lengths[0] = width
        tokens = rng.integers(0, 150_000, (rows, width)).astype(np.int32)
        tenants = np.full(rows, -1, np.int32)
        state = kq.Allocator(config).init()
        args = (tenants, tokens, lengths.astype(np.int32))
        state, report = admit(config, state, *args)  # compile
        jax.block_until_ready(report)
        walls = []
        for _ in range(CALLS):
            t = time.perf_counter()
            state, report = admit(config, state, *args)
            jax.block_until_ready(report)
            walls.append(time.perf_counter() - t)
        out[f"{rows}x{width}"] = round(1e3 * float(np.median(walls)), 2)
    print(json.dumps({"kvquota": kq.__file__, "median_ms": out}))


if __name__ == "__main__":
    main()
