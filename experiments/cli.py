"""The absl plumbing every experiment's command line shares.

An experiment module defines its flags in a `define_flags()` function and ends with

    if __name__ == "__main__":
        cli.run(main, define_flags)

so that flags exist only when the module runs as a program: tests import several experiment
modules side by side, and absl forbids defining a flag twice. `run` then

  * turns on jax's persistent compilation cache (`compilation_cache`), so a rerun on the same
    machine loads what an earlier run compiled (the load test compiles for minutes at 2^20
    blocks);
  * lowers jax's platform-probing log line ("Unable to initialize backend 'tpu'", logged at INFO
    by `jax._src.xla_bridge` on every machine without that platform) to WARNING, so the useful
    warnings (a GPU present but no CUDA jaxlib) still show; no platform is forced;
  * parses the flags, refusing positional arguments (absl hands them to `main` silently),
    first of all, so that a missing required flag does not hide them;
  * turns bad input into one line on stderr and exit status 2, never a traceback: a flag parsing
    or validator error, `BadInput` raised by `main` (checks across flags, or on the input's
    content), and the library's typed errors (`kq.KVQuotaError`, any ValueError) or OSError.

Numeric flags carry absl bounds (`lower_bound`/`upper_bound`), so a bad value is refused while
parsing, before any heavy work, and `--help` shows the allowed range.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shlex
import sys
from typing import Callable, Optional, Sequence

import jax
from absl import app, flags

import kvquota as kq
from configs.formats import KV_FORMATS, get_kv_format
from configs.models import MODELS, get_model_config

FLAGS = flags.FLAGS
EXIT_BAD_INPUT = 2
# The logger of jax's backend discovery (`jax/_src/xla_bridge.py`, `logger.info(f"Unable to
# initialize backend ...")`).
JAX_PLATFORM_LOGGER = "jax._src.xla_bridge"


class BadInput(ValueError):
    """Input the program refuses, found by `main` (a check across flags, an empty text file).
    Reported as `error: <message>` and exit status 2."""


def quiet_jax_logs() -> None:
    """Hides jax's INFO line for each platform it probes and fails to start (tpu, ...)."""
    logging.getLogger(JAX_PLATFORM_LOGGER).setLevel(logging.WARNING)


def fail(message: str) -> None:
    """Prints `error: <message>` as one line on stderr and exits with status 2."""
    line = " ".join(str(message).split())
    print(f"error: {line}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def note(message: str) -> None:
    """Prints `note: <message>` as one line on stderr (the program goes on)."""
    print(f"note: {' '.join(str(message).split())}", file=sys.stderr)


def positional_args(argv: Sequence[str]) -> list[str]:
    """The positional arguments of `argv` by absl's parsing rules, found without parsing or
    validating any flag (absl checks required flags inside `FLAGS(argv)`, so a missing one would
    hide the stray argument that explains it). An argument is positional when it does not start
    with `-` (or is all dashes) and is not the value of the flag before it (`--name value`, for a
    known flag that is not boolean, or --undefok); everything after `--` is positional."""
    try:
        args = iter(FLAGS.read_flags_from_files(list(argv[1:]), force_gnu=False))
    except flags.Error:
        return []  # a bad --flagfile: the parse reports it
    found = []
    for arg in args:
        name = arg.lstrip("-")
        if arg == "--":
            found.extend(args)
            break
        if not arg.startswith("-") or not name:
            found.append(arg)
        elif "=" not in name and (name == "undefok" or (name in FLAGS and not FLAGS[name].boolean)):
            next(args, None)  # the flag's value
    return found


def refuse_positionals(extra: Sequence[str]) -> None:
    """Fails (one line, status 2) when there is any positional argument."""
    if extra:
        fail(f"unexpected positional argument{'s' if len(extra) > 1 else ''} "
             f"{' '.join(shlex.quote(arg) for arg in extra)}: this program takes only flags "
             "(--name=value); see --help")


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's parser, with one-line errors (status 2) and no positional arguments. Positionals
    are refused first, so `generate "What is a KV cache?"` is told that it takes only flags, not
    that --prompt is missing."""
    refuse_positionals(positional_args(argv))
    try:
        rest = FLAGS(argv)
    except flags.Error as error:
        fail(error)
    refuse_positionals(rest[1:])  # absl's own verdict, should the scan above miss one
    return rest


def guarded(main: Callable[[list[str]], object]) -> Callable[[list[str]], object]:
    """`main`, with bad input reported as one line and exit status 2."""

    def wrapped(argv):
        try:
            return main(argv)
        except BadInput as error:
            fail(error)
        except (ValueError, OSError) as error:  # kq.KVQuotaError is a ValueError
            fail(f"{type(error).__name__}: {error}")

    return wrapped


DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "kvquota" / "jax"


def compilation_cache() -> Optional[str]:
    """Turns on jax's persistent compilation cache, keeping every compile; returns the
    directory, or None when off. The directory: $KVQUOTA_JAX_CACHE (empty: off), else a cache
    jax already has from $JAX_COMPILATION_CACHE_DIR, else ~/.cache/kvquota/jax (the test suite
    sets $KVQUOTA_JAX_CACHE to its own). Set in the environment too, so worker processes spawned
    later share it. jax keys each entry on the program, its compile options and the jax/XLA
    versions, so a hit runs the executable a compile would make. The cache is unbounded (delete
    the directory to reclaim it; the test suite's holds ~70 MB): jax's size bound rescans the
    whole directory, a stat and a read per entry, on every write, which made a cold run of the
    default tests (thousands of entries) slower than no cache at all."""
    path = os.environ.get("KVQUOTA_JAX_CACHE",
                          os.environ.get("JAX_COMPILATION_CACHE_DIR", str(DEFAULT_CACHE)))
    if not path:  # off, even where jax found $JAX_COMPILATION_CACHE_DIR at import
        jax.config.update("jax_compilation_cache_dir", None)
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        return None
    settings = {"jax_compilation_cache_dir": path,
                "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0,
                "jax_compilation_cache_max_size": -1}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    return path


def run(main: Callable[[list[str]], object], define_flags: Callable[[], None]) -> None:
    """Defines the flags, then runs `main` under absl with the conventions above."""
    quiet_jax_logs()
    compilation_cache()
    define_flags()
    app.run(guarded(main), flags_parser=parse_flags)


# ---- flags several experiments share ----------------------------------------------------------
# Defined here but credited to the program's main module, so `--help` (absl's short help lists
# the main module's flags only) shows them.


def _main_module() -> str:
    return sys.argv[0]  # absl's name for the `__main__` module


def _check_model(name: str) -> bool:
    try:
        get_model_config(name)
    except ValueError as error:
        raise flags.ValidationError(str(error)) from None
    return True


def _check_kv_format(name: str, allowed: Sequence[str] | None, refused: str) -> bool:
    try:
        get_kv_format(name)
    except ValueError as error:
        raise flags.ValidationError(str(error)) from None
    if allowed is not None and name not in allowed:
        raise flags.ValidationError(
            f"kv_format {name!r} is not supported here{': ' + refused if refused else ''}; "
            f"use one of: {', '.join(allowed)}")
    return True


def define_model(default: str = "smollm2-135m", extra_help: str = "", *,
                 name: str = "model") -> None:
    """--model (or --<name>), a preset name; its help lists the presets (configs.models.MODELS)."""
    flags.DEFINE_string(name, default, " ".join(
        [f"Model preset, one of: {', '.join(MODELS)}.", extra_help]).strip(),
        module_name=_main_module())
    flags.register_validator(name, _check_model)


def define_kv_format(default: str, allowed: Sequence[str] | None = None, refused: str = "",
                     extra_help: str = "") -> None:
    """--kv_format (configs.formats.KV_FORMATS), optionally narrowed to `allowed`; `refused`
    says why the others are refused."""
    names = allowed if allowed is not None else list(KV_FORMATS)
    flags.DEFINE_string("kv_format", default, " ".join(
        [f"KV storage format, one of: {', '.join(names)}.", extra_help]).strip(),
        module_name=_main_module())
    flags.register_validator("kv_format", lambda value: _check_kv_format(value, allowed, refused))


def define_progress() -> None:
    """--progress (on; --noprogress turns it off): progress of long work on stderr. A program
    that defined its own --progress first (with its own help) keeps it."""
    if "progress" in FLAGS:
        return
    flags.DEFINE_boolean("progress", True, "Show the progress of long work on stderr "
                         "(--noprogress: quiet).", module_name=_main_module())


def flag_or(name: str, default):
    """The value of flag `name`, or `default` where the program did not define (or parse) it
    (a library function called from a test or another program)."""
    return FLAGS[name].value if name in FLAGS and FLAGS.is_parsed() else default


def progress_on() -> bool:
    return bool(flag_or("progress", True))


def progress_bar(**tqdm_args):
    """A tqdm bar on stderr (a context manager), silent with --noprogress; leaves no line behind
    when it closes."""
    from tqdm import tqdm

    return tqdm(disable=not progress_on(), leave=False, file=sys.stderr, **tqdm_args)


def stage(message: str) -> None:
    """One line on stderr saying what a long run does now (a progress line: --noprogress hides
    it)."""
    if progress_on():
        print(f"{_program()}: {message}", file=sys.stderr, flush=True)


def _program() -> str:
    return pathlib.Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "kvquota"


def define_json(help_text: str = "Print one JSON object (the last line of stdout).") -> None:
    flags.DEFINE_boolean("json", False, help_text, module_name=_main_module())


def define_int_list(name: str, default: Sequence[int], help_text: str, *, lower: int,
                    upper: int) -> None:
    """A comma-separated list of integers in [lower, upper]; read it with `int_list(name)`."""
    flags.DEFINE_list(name, [str(x) for x in default],
                      f"{help_text} (comma-separated integers in [{lower}, {upper}])",
                      module_name=_main_module())

    def check(values):
        if not values:
            raise flags.ValidationError(f"--{name} needs at least one value")
        for value in values:
            try:
                number = int(value)
            except ValueError:
                raise flags.ValidationError(f"{value!r} is not an integer") from None
            if not lower <= number <= upper:
                raise flags.ValidationError(f"{number} is not in [{lower}, {upper}]")
        return True

    flags.register_validator(name, check)


def int_list(name: str) -> list[int]:
    """The parsed values of a flag defined with `define_int_list`."""
    return [int(value) for value in FLAGS[name].value]


# ---- flags of the programs that run a model (score, generate) ----------------------------------

PACKAGED_WEIGHTS = ("smollm2-135m",)  # presets kq.load_pretrained finds without a path
def define_model_source(default_format: str = "f32") -> None:
    """--model, --weights, --kv_format and the cache-policy flags of a program that runs a
    model on the paged cache."""
    define_model(extra_help=f"Weights ship only for {', '.join(PACKAGED_WEIGHTS)}; other "
                            "presets need --weights.")
    flags.DEFINE_string(
        "weights", None,
        "A .gguf file or Hugging Face checkpoint dir (default: the packaged weights).",
        module_name=_main_module())
    define_kv_format(default_format, extra_help=(
        "A full-precision format (f32, bf16, f16) holds every token; a compressed one (fp8, "
        "int8, int4, kivi2, kivi4) keeps the --keep_recent newest tokens in f32 and compresses "
        "every full block outside that window before the next token attends to it."))
    flags.DEFINE_integer("keep_recent", 32, "Newest tokens kept in full precision (compressed "
                         "formats) or always kept (eviction).", lower_bound=0,
                         module_name=_main_module())
    flags.DEFINE_string("evict_policy", None, "Evict down to --budget_tokens before each block "
                        f"with this policy: {', '.join(sorted(kq.POLICIES))}.",
                        module_name=_main_module())
    flags.DEFINE_integer("budget_tokens", None, "Tokens kept by --evict_policy.", lower_bound=1,
                         module_name=_main_module())
    flags.register_validator("evict_policy", lambda v: v is None or v in kq.POLICIES,
                             f"must be one of: {', '.join(sorted(kq.POLICIES))}")
    flags.register_multi_flags_validator(
        ["evict_policy", "budget_tokens"],
        lambda f: (f["evict_policy"] is None) == (f["budget_tokens"] is None),
        "--evict_policy and --budget_tokens go together")
    flags.register_multi_flags_validator(
        ["evict_policy", "kv_format"],
        lambda f: f["evict_policy"] is None or not get_kv_format(f["kv_format"]).compressed,
        "compress (a compressed --kv_format) or evict (--evict_policy), one at a time")


def cache_policy(kv_format: str, keep_recent: int, evict_policy, budget_tokens):
    """(pool-0 format, kq.CachePolicy) for the flags: a compressed --kv_format means f32 in pool
    0 and compression into that format."""
    if get_kv_format(kv_format).compressed:
        return "f32", kq.CachePolicy(kv_format=kv_format, keep_recent=keep_recent)
    return kv_format, kq.CachePolicy(keep_recent=keep_recent, evict_policy=evict_policy,
                                     budget_tokens=budget_tokens)


def check_model_source(model: str, weights: str | None) -> None:
    """Refuses, before anything loads, a preset without packaged weights and no --weights, or a
    --weights path that does not exist."""
    if weights is None and model not in PACKAGED_WEIGHTS:
        raise BadInput(f"--model={model} needs --weights (a .gguf file or a Hugging Face "
                       f"checkpoint directory): only {', '.join(PACKAGED_WEIGHTS)} ships weights")
    if weights is not None and not os.path.exists(weights):
        raise BadInput(f"--weights={weights}: no such file or directory")
