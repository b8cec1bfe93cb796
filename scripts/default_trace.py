"""What the load-test measurement scripts share: their `[STEPS [POLICY]]` arguments and the load
test's default run (its flags' defaults, the CLIs' compilation cache)."""

import sys

import kvquota as kq
from experiments import cli
from experiments import loadtest as loadtest_cli


def steps_and_policy(script: str) -> tuple[int, str]:
    """STEPS (default 11000) and POLICY (default tiered) from the command line, or exit."""
    args = sys.argv[1:]
    if len(args) > 2 or (args and not args[0].isdigit()):
        sys.exit(f"usage: {script} [STEPS [POLICY]]")
    return (int(args[0]) if args else 11000), (args[1] if len(args) > 1 else "tiered")


def default_run(script: str):
    """(LoadConfig, trace, first event's time) of `python -m experiments.loadtest`'s default run,
    with the CLIs' persistent compilation cache on."""
    cli.compilation_cache()
    loadtest_cli.define_flags()
    loadtest_cli.FLAGS([script])
    cfg, trace = loadtest_cli.load_config(), kq.sim.generate_trace(loadtest_cli.trace_config())
    return cfg, trace, min(e.time_s for e in trace.events)
