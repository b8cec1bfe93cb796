"""Shares of a py-spy raw profile (`py-spy record -f raw`), as one JSON object on stdout: own
time by package (kvquota and experiments, jax, numpy, the rest), the time spent waiting for or
running jitted calls (`ArrayImpl._value`: a readback waiting; the facade's and the cost
executor's call lines: on CPU the call runs on the calling thread), and the largest own-time
functions. Native frames are not sampled, so XLA's work shows as the Python line that called it.

  py-spy record -r 50 -f raw -o prof.raw -- python -m experiments.loadtest ...
  python scripts/pyspy_shares.py prof.raw
"""

import collections
import json
import re
import sys

CALL_LINES = ("run (kvquota/core/jit.py", "CostModelExecutor.step (kvquota/serving/executors.py")


def package(frame: str) -> str:
    path = re.search(r"\((.*?):\d+\)", frame)
    path = path.group(1) if path else ""
    for name in ("kvquota/", "experiments/", "jax/", "jaxlib/", "numpy/"):
        if path.startswith(name) or f"site-packages/{name}" in path:
            return {"experiments/": "kvquota/", "jaxlib/": "jax/"}.get(name, name).rstrip("/")
    return "other"


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/pyspy_shares.py PROFILE.raw")
    own, by_package, total = collections.Counter(), collections.Counter(), 0
    waiting = calling = 0
    for line in open(sys.argv[1]):
        stack, _, n = line.rstrip().rpartition(" ")
        leaf, n = stack.split(";")[-1], int(n)
        total += n
        own[re.sub(r":\d+\)", ")", leaf)] += n
        by_package[package(leaf)] += n
        waiting += n * ("ArrayImpl._value" in leaf)
        calling += n * leaf.startswith(CALL_LINES)
    share = lambda n: round(n / total, 3)  # noqa: E731
    print(json.dumps({"samples": total,
                      "own_by_package": {k: share(v) for k, v in by_package.most_common()},
                      "waiting_for_device_reads": share(waiting),
                      "in_jitted_call_lines": share(calling),
                      "top_own_functions": {k: share(v) for k, v in own.most_common(12)}},
                     indent=1))


if __name__ == "__main__":
    main()
