"""Bad invocations of every experiment CLI, as a new user types them: each must exit 2 with one
line on stderr (`error: ...`), nothing on stdout and no traceback, before any heavy work (no
weights load: each case takes about the time of importing jax).

The invocations run once, side by side (a thread pool over subprocesses), in a module fixture;
each case is then checked in its own test. MORE_CASES run only with -m slow; they include a
positional argument given to every program.
"""

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

import kvquota as kq
from tests.conftest import REPO
from tests.experiments.common import run_cli

POSITIONAL = "unexpected positional argument stray: this program takes only flags"


def _programs():
    """Every experiment module that runs as a program (ends in `cli.run(main, ...)`)."""
    return [path.stem for path in sorted((REPO / "experiments").glob("*.py"))
            if re.search(r'^if __name__ == "__main__":\s+cli\.run\(', path.read_text(), re.M)]


# (module, arguments, text the one-line error must contain). {text} is a small UTF-8 file,
# {empty} an empty one, {missing} a path that does not exist. CASES: the ones a new user hit,
# one or more per CLI; MORE_CASES (marked slow): the rest of each CLI's checks.
CASES = [
    ("accounting", ["qwen2.5-72b"], "unexpected positional argument qwen2.5-72b"),
    ("accounting", ["--model=gpt-5"], "valid choices: qwen2.5-0.5b"),
    ("accounting", ["--batch=0"], "--batch=0: 0 is not an integer in the range [1, 65536]"),
    ("score", ["--text_file={text}", "--max_tokens=-5"], "-5 is not a non-negative integer"),
    ("score", ["--text_file={empty}"], "is empty: nothing to score"),
    ("score", ["--text_file={text}", "--block_size=0"], "not an integer in the range [1, 1024]"),
    ("score", ["--text_file={text}", "--block_size=100000"], "in the range [1, 1024]"),
    ("score", ["--text_file={text}", "--kv_format=int8", "--evict_policy=h2o",
               "--budget_tokens=8"], "one at a time"),
    ("generate", ["--prompt=hi", "--max_new_tokens=0"], "0 is not a positive integer"),
    # A positional argument is refused as such even where a required flag is missing (absl
    # validates required flags while parsing, and said "--prompt must have a value").
    ("generate", ["What is a KV cache?"],
     "unexpected positional argument 'What is a KV cache?': this program takes only flags"),
    ("score", ["stray"], POSITIONAL),  # without --text_file
    ("runs", ["stray"], POSITIONAL),  # without --run_dir
    ("demo", ["--max_new_tokens=-1"], "not an integer in the range [1, 192]"),
    ("bench_reclaim", ["--repeats=0"], "--repeats=0"),
    ("bench_attention", ["--contexts=0"], "0 is not in [1, 131072]"),
    ("bench_model", ["--batches=0"], "0 is not in [1, 256]"),
]
MORE_CASES = [
    ("accounting", ["--kv_format=int3"], "valid choices: f32, bf16"),
    ("accounting", ["--seq_len=-5"], "--seq_len=-5"),
    ("accounting", ["--block_size=0"], "--block_size=0"),
    ("accounting", ["--nope=1"], "Unknown command line flag 'nope'"),
    ("score", ["--text_file={text}", "--evict_policy=h2o"], "go together"),
    ("score", ["--text_file={text}", "--evict_policy=h3o", "--budget_tokens=8"],
     "must be one of: h2o"),
    ("score", ["--text_file={text}", "--keep_recent=-1"], "--keep_recent=-1"),
    ("score", ["--text_file={text}", "--kv_format=kivi2", "--block_size=64"],
     "key group of 32 tokens is not a whole number of blocks of 64"),
    ("score", ["--text_file={missing}"], "No such file or directory"),
    ("score", [], "--text_file must have a value"),
    ("score", ["--text_file={text}", "--model=qwen2.5-7b"], "needs --weights"),
    ("score", ["--text_file={text}", "--weights={missing}"], "no such file or directory"),
    ("score", ["--text_file={text}", "--model=qwen9"], "unknown model 'qwen9'"),
    ("score", ["--text_file={text}", "stray"], "unexpected positional argument stray"),
    ("generate", ["--prompt="], "--prompt is empty"),
    ("generate", ["--prompt=hi", "--temperature=-1"], "not a non-negative number"),
    ("generate", ["--prompt=hi", "--kv_format=kivi3"], "kivi3"),
    ("generate", ["--prompt=hi", "--budget_tokens=4"], "go together"),
    ("generate", ["--prompt=hi", "more", "words"], "unexpected positional arguments more words"),
    ("demo", ["now"], "unexpected positional argument now"),
    ("bench_reclaim", ["--log2_blocks=40"], "not an integer in the range [13, 24]"),
    ("bench_reclaim", ["--scaling=14,x"], "'x' is not an integer"),
    ("bench_reclaim", ["20"], "unexpected positional argument 20"),
    ("bench_attention", ["--cpu_dtype=int8"], "value should be one of <float32|bfloat16>"),
    ("bench_attention", ["--gpu_dry_run", "--gpu_context=100"], "not a multiple of 16 pages"),
    ("bench_attention", ["--cpu_model=llama"], "unknown model 'llama'"),
    ("bench_model", ["--contexts=8190"], "exceed smollm2-135m's context of 8192"),
    ("bench_model", ["--kv_format=int8"], "value should be one of <f32|bf16>"),
    ("runs", ["--run_dir={missing}"], "not a complete run directory"),
    ("generate", ["--", "--prompt=hi"], "unexpected positional argument --prompt=hi"),
    # smollm2-135m is --model's value, --chat a boolean: only "stray" is positional.
    ("generate", ["--model", "smollm2-135m", "--chat", "stray"], POSITIONAL),
]
# Every other program, with a positional argument (score and runs are in CASES).
MORE_CASES += [(module, ["stray"], POSITIONAL) for module in _programs()
               if module not in ("score", "runs")]
if jax.default_backend() != "gpu":  # with a GPU, --skip_cpu is a legitimate (GPU-only) run
    MORE_CASES.append(("bench_attention", ["--skip_cpu"], "--skip_cpu leaves nothing to measure"))

HELP = ["accounting", "score", "generate"]  # CLIs with --model
MORE_HELP = ["bench_attention"]  # --cpu_model, --gpu_model


def test_every_program_is_swept_for_positionals():
    assert {"accounting", "generate", "loadtest", "runs", "score"} <= set(_programs())
    assert "cli" not in _programs()


def _ids(case):
    module, args, _ = case
    return f"{module} {' '.join(args) or '(no flags)'}"


def _run_all(tmp, cases, helps):
    """Runs every case and every --help side by side: {(module, args): CompletedProcess}."""
    (tmp / "text.txt").write_text("A short text to score.\n", encoding="utf-8")
    (tmp / "empty.txt").write_text("", encoding="utf-8")
    paths = dict(text=tmp / "text.txt", empty=tmp / "empty.txt", missing=tmp / "missing")
    jobs = {(m, tuple(a)): [x.format(**paths) for x in a] for m, a, _ in cases}
    jobs.update({(m, ("--help",)): ["--help"] for m in helps})
    workers = max(2, min(8, os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {key: pool.submit(run_cli, key[0], *args, cwd=tmp, timeout=120)
                   for key, args in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run_all(tmp_path_factory.mktemp("cli"), CASES, HELP)


@pytest.fixture(scope="module")
def more_results(tmp_path_factory):
    return _run_all(tmp_path_factory.mktemp("cli_more"), MORE_CASES, MORE_HELP)


def _check_bad(result, message):
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert message in lines[0]
    assert result.returncode == 2
    assert result.stdout == ""


def _check_help(result, module):
    assert "Traceback" not in result.stderr
    text = " ".join(result.stdout.split())  # absl wraps help text
    for name in kq.MODELS:
        assert name in text, (module, name)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_bad_invocation_exits_2_with_one_line(results, case):
    module, args, message = case
    _check_bad(results[(module, tuple(args))], message)


@pytest.mark.parametrize("module", HELP)
def test_help_lists_the_model_presets(results, module):
    _check_help(results[(module, ("--help",))], module)


@pytest.mark.slow
@pytest.mark.parametrize("case", MORE_CASES, ids=[_ids(c) for c in MORE_CASES])
def test_more_bad_invocations(more_results, case):
    module, args, message = case
    _check_bad(more_results[(module, tuple(args))], message)


@pytest.mark.slow
@pytest.mark.parametrize("module", MORE_HELP)
def test_more_help(more_results, module):
    _check_help(more_results[(module, ("--help",))], module)


@pytest.mark.parametrize("env, expected", [
    ({"KVQUOTA_JAX_CACHE": "{tmp}/mine", "JAX_COMPILATION_CACHE_DIR": "{tmp}/jax"}, "{tmp}/mine"),
    ({"JAX_COMPILATION_CACHE_DIR": "{tmp}/jax"}, "{tmp}/jax"),
    ({"HOME": "{tmp}"}, "{tmp}/.cache/kvquota/jax"),
    ({"KVQUOTA_JAX_CACHE": "", "JAX_COMPILATION_CACHE_DIR": "{tmp}/jax"}, "None"),
])
def test_compilation_cache_precedence_and_off(env, expected, tmp_path):
    """Every CLI keeps its compiles (experiments.cli.compilation_cache): $KVQUOTA_JAX_CACHE,
    else jax's own $JAX_COMPILATION_CACHE_DIR, else ~/.cache/kvquota/jax; empty turns it off,
    even for a cache jax found at import. A compile then lands in that directory."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("KVQUOTA_JAX_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env = dict(base, **{k: v.format(tmp=tmp_path) for k, v in env.items()})
    source = ("import jax, jax.numpy as jnp; from experiments import cli; "
              "got = cli.compilation_cache(); jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)); "
              "print(got, jax.config.jax_compilation_cache_dir)")
    proc = subprocess.run([sys.executable, "-c", source], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = expected.format(tmp=tmp_path)
    assert proc.stdout.split() == [want, want]
    if want != "None":
        assert any(pathlib.Path(want).iterdir()), "nothing was written to the cache"
