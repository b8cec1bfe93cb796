"""Paged-attention benchmark: `python -m experiments.bench_attention --json`.

CPU part: the reference-path paged decode against a dense (contiguous-cache) decode at the
SmolLM2-135M shape, timed side by side (interleaved repeats) in one run, reported as ratios;
a naive paged decode (one gather of the whole table) rides along for comparison.
GPU part (only when a GPU is present): the Pallas decode at the Qwen2.5-7B shape as bytes read
per second, against a device-to-device copy measured in the same run, against the H200's
4.8 TB/s, side by side with the JAX peer kernel on the same inputs, and int8 pages vs bf16.

The GPU part is made for one short try on a borrowed machine: each section (copy, ours, peer,
int8; --gpu_sections picks them, and the knob sweep) is compiled in its own try and written to
points.jsonl as soon as it is measured; a section that fails (does not compile, runs out of
memory) is a line with an "error", and the others go on. Only the sections that compiled are
timed, interleaved. Ctrl-C (SIGINT, as `timeout -s INT` sends) stops the measurement and writes
what was measured as a summary marked `"partial": true` (exit status 130); such a run is then
recorded like a complete one (--replay shows it; a run without --replay measures anew).

Not a timed test: numbers go to a run directory (experiments/runs.py: one point per CPU
(batch, context) and per GPU section or configuration, the summary, plots) with the command,
versions, device and seed; --out also writes the summary to a file
(results/bench_attention_<cpu|gpu>.json).
Quick run: --contexts=256,512 --batches=1 --repeats=3. Off GPU, the GPU part's code path:
--skip_cpu --gpu_dry_run --gpu_batch=1 --gpu_context=256 --repeats=1.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import kvquota as kq
from experiments import cli, runs
from kernels import paged_attention as pa

FLAGS = flags.FLAGS
PEER_K_SPLITS = 16  # jax's GPU paged_attention default: pages per sequence must divide by it
GPU_SECTIONS = ("copy", "ours", "peer", "int8", "sweep")
# Section name -> its key in the GPU summary (the sweep's is "knob_sweep").
SECTION_KEYS = {"copy": "copy", "ours": "ours_bf16", "peer": "peer_bf16", "int8": "ours_int8"}
BAR_LABELS = {"copy": "copy", "ours_bf16": "ours bf16", "peer_bf16": "peer bf16",
              "ours_int8": "ours int8"}
ERROR_CHARS = 300


def define_flags():
    cli.define_int_list("contexts", [512, 1024, 2048, 4096, 8192], "CPU contexts (tokens)",
                        lower=1, upper=1 << 17)
    cli.define_int_list("batches", [1, 8], "CPU batch sizes", lower=1, upper=256)
    cli.define_model("smollm2-135m", "Its attention shape is the CPU part's.", name="cpu_model")
    flags.DEFINE_enum("cpu_dtype", "float32", ["float32", "bfloat16"], "CPU cache dtype.")
    flags.DEFINE_integer("page_size", 16, "Tokens per page.", lower_bound=1, upper_bound=1024)
    flags.DEFINE_integer("repeats", 30, "Timed repeats per point (median reported).",
                         lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed for data and block-table permutations.",
                         lower_bound=0)
    flags.DEFINE_bool("skip_cpu", False, "Skip the CPU part.")
    flags.DEFINE_bool("skip_gpu", False, "Skip the GPU part even when a GPU is present.")
    cli.define_model("qwen2.5-7b", "The GPU part's shape.", name="gpu_model")
    flags.DEFINE_integer("gpu_batch", 32, "GPU batch.", lower_bound=1)
    flags.DEFINE_integer("gpu_context", 32768,
                         "GPU context (tokens per sequence; a multiple of 16 pages for the peer "
                         "kernel).", lower_bound=1)
    flags.DEFINE_float("peak_tb_s", 4.8,
                       "Nominal HBM bandwidth (TB/s) of the device (H200: 4.8).", lower_bound=1e-3)
    flags.DEFINE_list("gpu_sections", list(GPU_SECTIONS),
                      f"GPU sections to run, some of: {', '.join(GPU_SECTIONS)} (the sweep alone: "
                      "--gpu_sections=sweep).")
    flags.register_validator("gpu_sections", _check_sections)
    flags.DEFINE_bool("gpu_sweep", True, "Also time a small grid of kernel knobs on GPU "
                      "(--nogpu_sweep drops 'sweep' from --gpu_sections).")
    flags.DEFINE_bool("gpu_dry_run", False,
                      "Run the GPU part here with Pallas interpreted (checks the code path off "
                      "GPU; use small --gpu_batch/--gpu_context; numbers mean nothing).")
    runs.define_flags()


def _check_sections(values) -> bool:
    if not values:
        raise flags.ValidationError("--gpu_sections needs at least one section")
    for value in values:
        if value not in GPU_SECTIONS:
            raise flags.ValidationError(f"{value!r} is not a GPU section; use some of: "
                                        f"{', '.join(GPU_SECTIONS)}")
    return True


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything the benchmark reads, parsed (the flags, or a test's small sizes)."""

    contexts: tuple = (512, 1024, 2048, 4096, 8192)
    batches: tuple = (1, 8)
    cpu_model: str = "smollm2-135m"
    cpu_dtype: str = "float32"
    page_size: int = 16
    repeats: int = 30
    seed: int = 0
    skip_cpu: bool = False
    skip_gpu: bool = False
    gpu_model: str = "qwen2.5-7b"
    gpu_batch: int = 32
    gpu_context: int = 32768
    peak_tb_s: float = 4.8
    gpu_sweep: bool = True
    gpu_dry_run: bool = False
    gpu_sections: tuple = GPU_SECTIONS

    @classmethod
    def from_flags(cls) -> Options:
        values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(cls)}
        values.update(contexts=tuple(cli.int_list("contexts")),
                      batches=tuple(cli.int_list("batches")),
                      gpu_sections=tuple(s for s in GPU_SECTIONS if s in FLAGS.gpu_sections))
        return cls(**values)

    @property
    def sections(self) -> tuple:
        """The GPU sections that run, in a fixed order ('sweep' only with gpu_sweep)."""
        return tuple(s for s in GPU_SECTIONS
                     if s in self.gpu_sections and (s != "sweep" or self.gpu_sweep))

    def config(self) -> dict:
        """The resolved config of the run directory (lists, as JSON has them)."""
        out = {k: list(v) if isinstance(v, tuple) else v
               for k, v in dataclasses.asdict(self).items()}
        out["gpu_sections"] = list(self.sections)
        return out


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


def _median_ms(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def _interleaved(fns: dict, args: dict, repeats: int, times: dict, errors: dict) -> None:
    """Repeats of already compiled functions, interleaved so drift hits all alike. Seconds go to
    `times[name]` as they are measured (an interrupted caller keeps them); a function that
    raises goes to `errors[name]` (its text) and is dropped from the remaining repeats."""
    live = dict(fns)
    for name in live:
        times.setdefault(name, [])
    for _ in range(repeats):
        for name, fn in list(live.items()):
            try:
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args[name]))
                times[name].append(time.perf_counter() - t0)
            except Exception as error:  # a failure is data: the others go on
                errors[name] = _error_text(error)
                del live[name]


def _medians_ms(times: dict) -> dict:
    return {name: float(np.median(t) * 1e3) for name, t in times.items() if t}


def _side_by_side(fns: dict, args: dict, repeats: int) -> dict:
    """Median ms of each function (warmed first), repeats interleaved; raises on a failure."""
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))
    times, errors = {}, {}
    _interleaved(fns, args, repeats, times, errors)
    if errors:
        raise RuntimeError("; ".join(f"{name}: {text}" for name, text in errors.items()))
    return _medians_ms(times)


def dense_decode(q, k, v, lengths, *, sm_scale):
    """Decode over a contiguous cache k, v [B, Hkv, S, D] (slots past the length hold zeros)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32) * sm_scale
    mask = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", p, v.astype(jnp.float32))
    return out.reshape(b, hq, d).astype(q.dtype)


def _paged_inputs(rng, batch, context, hkv, d, page, dtype, spare=8):
    """A pool holding `batch` sequences of `context` tokens in randomly permuted pages."""
    m = math.ceil(context / page)
    n = batch * m + spare
    k = jnp.asarray(rng.standard_normal((hkv, n, page, d)), dtype)
    v = jnp.asarray(rng.standard_normal((hkv, n, page, d)), dtype)
    tables = jnp.asarray(rng.permutation(n)[: batch * m].reshape(batch, m), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    return k, v, tables, lengths


def cpu_part(opts: Options, on_point=lambda point: None, out: dict | None = None) -> dict:
    """The CPU part; fills `out` as it goes (an interrupted run keeps the points measured)."""
    out = {} if out is None else out
    cfg = kq.get_model_config(opts.cpu_model)
    hq, hkv, d, page = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, opts.page_size
    dtype = jnp.dtype(opts.cpu_dtype)
    scale = 1.0 / math.sqrt(d)
    rng = np.random.default_rng(opts.seed)
    out.update(model=cfg.name, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=page,
               dtype=dtype.name, points=[])
    dense = jax.jit(lambda q, k, v, l: dense_decode(q, k, v, l, sm_scale=scale))
    paged = jax.jit(lambda q, k, v, t, l: pa.decode(q, k, v, t, l, sm_scale=scale,
                                                    backend="reference"))
    # The naive paged path for comparison: one gather of the whole table, then attention.
    naive = jax.jit(lambda q, k, v, t, l: pa.decode_reference(
        q, k, v, t, l, sm_scale=scale, chunk_pages=t.shape[1], pool_dot=False)[0])
    for batch in opts.batches:
        for context in opts.contexts:
            k, v, tables, lengths = _paged_inputs(rng, batch, context, hkv, d, page, dtype)
            # The same tokens, contiguous: [B, Hkv, S, D].
            kd = jnp.take(k, tables, axis=1).reshape(hkv, batch, -1, d).transpose(1, 0, 2, 3)
            vd = jnp.take(v, tables, axis=1).reshape(hkv, batch, -1, d).transpose(1, 0, 2, 3)
            q = jnp.asarray(rng.standard_normal((batch, hq, d)), dtype)
            got, want = paged(q, k, v, tables, lengths), dense(q, kd, vd, lengths)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            paged_args = (q, k, v, tables, lengths)
            ms = _side_by_side({"dense": dense, "paged": paged, "naive": naive},
                               {"dense": (q, kd, vd, lengths), "paged": paged_args,
                                "naive": paged_args}, opts.repeats)
            point = dict(batch=batch, context=context, dense_ms=ms["dense"],
                         paged_ms=ms["paged"], ratio=ms["paged"] / ms["dense"],
                         naive_paged_ms=ms["naive"], naive_ratio=ms["naive"] / ms["dense"],
                         max_abs_diff=err)
            print(f"[cpu] B={batch:2d} ctx={context:5d}  dense {ms['dense']:8.3f} ms  "
                  f"paged {ms['paged']:8.3f} ms  ratio {point['ratio']:.2f}  (naive one-gather "
                  f"{point['naive_ratio']:.2f})", file=sys.stderr)
            out["points"].append(point)
            on_point({"kind": "cpu", **point})
    out["quant_error"] = quant_error(cfg, rng)
    return out


def quant_error(cfg, rng) -> dict:
    """RMS and max error of decode on quantized pages vs full precision, per format."""
    k, v, tables, lengths = _paged_inputs(rng, 4, 1024, cfg.num_kv_heads, cfg.head_dim, 16,
                                          jnp.float32)
    q = jnp.asarray(rng.standard_normal((4, cfg.num_q_heads, cfg.head_dim)), jnp.float32)
    full = pa.decode(q, k, v, tables, lengths, backend="reference")
    out = {}
    for name in ["int8", "int4", "kivi4", "kivi2"]:
        kq8, vq8 = pa.quantize_kv(k, v, name)
        diff = pa.decode(q, kq8, vq8, tables, lengths, backend="reference") - full
        out[name] = dict(rms=float(jnp.sqrt(jnp.mean(diff**2))), max=float(jnp.max(jnp.abs(diff))),
                         bytes_vs_bf16=(kq8.nbytes + vq8.nbytes) / (2 * k.size * 2))
    return out


def backend_name() -> str:
    return jax.default_backend()


# ---- the GPU part: each piece a function, so a test can make one fail --------------------------


def copy_kernel(x):
    """The copy the bandwidths are compared with: read and write every byte once."""
    return -x


def ours_decode(q, k, v, tables, lengths, *, interpret, **knobs):
    # The kernel's knobs (pages_per_block, k_splits, num_warps) are not arguments of the public
    # `pa.decode`; the benchmark times the Pallas entry point behind it.
    from kernels.paged_attention import pallas_kernel

    return pallas_kernel.decode_pallas(q, k, v, tables, lengths, interpret=interpret, **knobs)[0]


def peer_decode(q, k, v, tables, lengths, *, sm_scale, interpret):
    from jax.experimental.pallas.ops.gpu import paged_attention as peer

    return peer.paged_attention(q * sm_scale, k, v, tables, lengths, interpret=interpret)


def quantize_int8(k, v):
    return pa.quantize_kv(k, v, "int8")


def reference_decode(q, k, v, tables, lengths):
    return pa.decode(q, k, v, tables, lengths, backend="reference")


def _gpu_inputs(cfg, b, ctx, page, seed):
    key = jax.random.PRNGKey(seed)
    m = ctx // page
    n = b * m
    kk, kv_, kq_, kp = jax.random.split(key, 4)
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    k = jax.random.normal(kk, (hkv, n, page, d), jnp.bfloat16)
    v = jax.random.normal(kv_, (hkv, n, page, d), jnp.bfloat16)
    tables = jax.random.permutation(kp, n).reshape(b, m).astype(jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    q = jax.random.normal(kq_, (b, cfg.num_q_heads, d), jnp.bfloat16)
    return key, (q, k, v, tables, lengths)


def gpu_part(opts: Options, on_point=lambda point: None, result: dict | None = None) -> dict:
    """The GPU part, section by section; fills `result` as it goes (an interrupted run keeps
    what was measured). A failed section is `{"error": ..., "stage": "compile"|"measure"}`, a
    section not asked for None."""
    result = {} if result is None else result
    cfg = kq.get_model_config(opts.gpu_model)
    b, ctx, page = opts.gpu_batch, opts.gpu_context, opts.page_size
    hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    scale = 1.0 / math.sqrt(d)
    sections = opts.sections
    kv_bytes = 2 * b * ctx * hkv * d * 2  # K and V actually read, bf16
    result.update(model=cfg.name, batch=b, context=ctx, q_heads=hq, kv_heads=hkv, head_dim=d,
                  page_size=page, dtype="bfloat16", sections=list(sections), copy=None,
                  ours_bf16=None, peer_bf16=None, ours_int8=None, speedup_vs_peer=None,
                  int8_speedup_vs_bf16=None, max_abs_diff_vs_reference={}, knob_sweep=[],
                  errors={})
    on_point({"kind": "gpu_setup", **{k: result[k] for k in (
        "model", "batch", "context", "q_heads", "kv_heads", "head_dim", "page_size", "dtype",
        "sections")}})

    def failed(name, error, stage):
        text = error if isinstance(error, str) else _error_text(error)
        result[name] = {"error": text, "stage": stage}
        result["errors"][name] = text
        on_point({"kind": "gpu_section", "section": name, "stage": stage, "error": text})
        print(f"[gpu] {name} failed ({stage}): {text}", file=sys.stderr)

    try:
        key, (q, k, v, tables, lengths) = _gpu_inputs(cfg, b, ctx, page, opts.seed)
        jax.block_until_ready((q, k, v))
    except Exception as error:  # e.g. out of memory: nothing else can run
        failed("inputs", error, "setup")
        return result

    copy_tb_s = None
    if "copy" in sections:  # read + write of a buffer the size of the K/V read
        try:
            buf = jax.random.normal(key, (kv_bytes // 2,), jnp.bfloat16)
            copy_ms = _median_ms(jax.jit(copy_kernel), buf, repeats=opts.repeats)
            copy_tb_s = 2 * buf.nbytes / (copy_ms * 1e-3) / 1e12
            del buf
            result["copy"] = dict(ms=copy_ms, tb_s=copy_tb_s)
            on_point({"kind": "gpu_section", "section": "copy", **result["copy"]})
        except Exception as error:
            failed("copy", error, "measure")

    def rate(nbytes, t_ms):
        tb_s = nbytes / (t_ms * 1e-3) / 1e12
        return dict(ms=t_ms, bytes=nbytes, tb_s=tb_s,
                    of_copy=None if copy_tb_s is None else tb_s / copy_tb_s,
                    of_peak=tb_s / opts.peak_tb_s)

    interp = opts.gpu_dry_run and backend_name() != "gpu"
    args = (q, k, v, tables, lengths)

    def make_int8():
        kq8, vq8 = quantize_int8(k, v)
        return (q, kq8, vq8, tables, lengths), kq8.nbytes + vq8.nbytes  # every page read once

    makers = {  # section key -> () -> (jitted fn, args, bytes read)
        "ours_bf16": lambda: (jax.jit(lambda *a: ours_decode(*a, interpret=interp)), args,
                              kv_bytes),
        "peer_bf16": lambda: (jax.jit(lambda *a: peer_decode(*a, sm_scale=scale,
                                                             interpret=interp)), args, kv_bytes),
        "ours_int8": lambda: (jax.jit(lambda *a: ours_decode(*a, interpret=interp)),
                              *make_int8()),
    }
    ready = {}  # the kernels that compiled (and ran once), each warmed in its own try
    for section in ("ours", "peer", "int8"):
        name = SECTION_KEYS[section]
        if section not in sections:
            continue
        try:
            fn, fn_args, nbytes = makers[name]()
            jax.block_until_ready(fn(*fn_args))
            ready[name] = (fn, fn_args, nbytes)
        except Exception as error:
            failed(name, error, "compile")
    times, errors = {}, {}
    try:
        _interleaved({n: r[0] for n, r in ready.items()}, {n: r[1] for n, r in ready.items()},
                     opts.repeats, times, errors)
    finally:  # also when interrupted: the medians of the repeats done so far
        done = _medians_ms(times)
        for name, (_, _, nbytes) in ready.items():
            if name in errors:
                failed(name, errors[name], "measure")
            elif name in done:
                result[name] = rate(nbytes, done[name])
                if len(times[name]) < opts.repeats:
                    result[name]["repeats_done"] = len(times[name])
                on_point({"kind": "gpu_section", "section": name, **result[name]})

    ms = {name: result[name]["ms"] for name in SECTION_KEYS.values()
          if isinstance(result.get(name), dict) and "ms" in result[name] and name != "copy"}
    if "peer_bf16" in ms and "ours_bf16" in ms:
        result["speedup_vs_peer"] = ms["peer_bf16"] / ms["ours_bf16"]
    if "ours_int8" in ms and "ours_bf16" in ms:
        result["int8_speedup_vs_bf16"] = ms["ours_bf16"] / ms["ours_int8"]
    _reference_check(result, {n: ready[n][0] for n in ("ours_bf16", "peer_bf16") if n in ready},
                     args, on_point)
    on_point({"kind": "gpu", **{k: v for k, v in result.items() if k != "knob_sweep"}})
    print(f"[gpu] {_gpu_line(result)}", file=sys.stderr)

    if "sweep" in sections:
        for ppb in (4, 8):
            for splits in (2, 4, 8):
                for warps in (4, 8):
                    knobs = dict(pages_per_block=ppb, k_splits=splits, num_warps=warps)
                    fn = jax.jit(lambda *a, kn=knobs: ours_decode(*a, interpret=interp, **kn))
                    try:
                        t_ms = _median_ms(fn, *args, repeats=10)
                        result["knob_sweep"].append(dict(knobs, **rate(kv_bytes, t_ms)))
                    except Exception as e:  # a failed configuration is data, not a crash
                        result["knob_sweep"].append(dict(knobs, error=_error_text(e)))
                    on_point({"kind": "gpu_knobs", **result["knob_sweep"][-1]})
    return result


def _reference_check(result, fns, args, on_point):
    """Max |kernel - reference| of each bf16 kernel that compiled, each in its own try."""
    if not fns:
        return
    check = result["max_abs_diff_vs_reference"]
    try:
        want = reference_decode(*args).astype(jnp.float32)
    except Exception as error:
        result["errors"]["reference_check"] = _error_text(error)
        check.update({name: None for name in fns})
    else:
        for name, fn in fns.items():
            try:
                check[name] = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want)))
            except Exception as error:
                check[name] = None
                result["errors"][f"reference_check:{name}"] = _error_text(error)
    on_point({"kind": "gpu_check", "max_abs_diff_vs_reference": dict(check),
              **{k: v for k, v in result["errors"].items() if k.startswith("reference_check")}})


def _section_text(value) -> str:
    if value is None:
        return "not run"
    if "error" in value:
        return f"failed ({value.get('stage', '?')}: {value['error'][:80]})"
    text = f"{value['tb_s']:.2f} TB/s"
    if value.get("of_copy") is not None:
        text += f" ({value['of_copy']:.0%} of copy)"
    return text


def _gpu_line(gpu: dict) -> str:
    parts = [f"{label} {_section_text(gpu.get(key))}" for key, label in BAR_LABELS.items()]
    if gpu.get("speedup_vs_peer") is not None:
        parts.append(f"x{gpu['speedup_vs_peer']:.2f} vs peer")
    if gpu.get("int8_speedup_vs_bf16") is not None:
        parts.append(f"int8 x{gpu['int8_speedup_vs_bf16']:.2f} vs bf16")
    if "inputs" in gpu.get("errors", {}):
        parts = [f"inputs failed: {gpu['errors']['inputs'][:120]}"]
    return "; ".join(parts)


def gpu_runs(opts: Options, backend: str) -> bool:
    return (backend == "gpu" or opts.gpu_dry_run) and not opts.skip_gpu


def measure(opts: Options, on_point=lambda point: None) -> dict:
    """Both parts. On KeyboardInterrupt (SIGINT) the record so far, marked `"partial": true`."""
    backend = backend_name()
    record = {"seed": opts.seed, "partial": False}
    stage = "cpu"
    try:
        if not opts.skip_cpu:
            record["cpu"] = {}
            cpu_part(opts, on_point, record["cpu"])
        stage = "gpu"
        if gpu_runs(opts, backend):
            record["gpu"] = {"dry_run": backend != "gpu"}
            gpu_part(opts, on_point, record["gpu"])
        else:
            record["gpu"] = None if opts.skip_gpu else f"skipped: no GPU (backend {backend})"
    except KeyboardInterrupt:
        record.update(partial=True, interrupted=f"during the {stage} part")
        record.setdefault("gpu", "skipped: interrupted before the GPU part")
        on_point({"kind": "interrupted", "stage": stage})
        cli.note(f"interrupted during the {stage} part: writing what was measured, marked "
                 "partial")
    return record


# ---- drawn from the run's files ----------------------------------------------------------------


def _gpu_from_points(points) -> tuple[dict, dict]:
    """(setup, {section key: its dict}) of the GPU part, from its points: the section lines as
    they were measured, then the summary line where it exists."""
    setup, sections = {}, {}
    for p in points:
        if p.get("kind") == "gpu_setup":
            setup = p
        elif p.get("kind") == "gpu_section" and p.get("section") in BAR_LABELS:
            sections[p["section"]] = p
        elif p.get("kind") == "gpu":
            setup = {**setup, **{k: p[k] for k in ("model", "batch", "context") if k in p}}
            sections.update({k: p[k] for k in BAR_LABELS if isinstance(p.get(k), dict)})
    return setup, sections


def plot(points, metrics, out_dir) -> list[str]:
    """cpu_ratio.png (paged / dense decode time vs context, per batch) and, with a GPU part,
    gpu_bandwidth.png (TB/s of each kernel and of the copy; failed or missing sections marked),
    from the run's files."""
    import matplotlib.pyplot as plt

    names = []
    cpu = [p for p in points if p["kind"] == "cpu"]
    if cpu:
        fig, ax = plt.subplots(figsize=(6, 4))
        for batch in sorted({p["batch"] for p in cpu}):
            rows = sorted((p for p in cpu if p["batch"] == batch), key=lambda p: p["context"])
            ctx = [p["context"] for p in rows]
            line, = ax.semilogx(ctx, [p["ratio"] for p in rows], "o-", base=2,
                                label=f"paged, B={batch}")
            ax.semilogx(ctx, [p["naive_ratio"] for p in rows], "x--", base=2,
                        color=line.get_color(), label=f"naive one-gather, B={batch}")
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode time / dense decode time")
        ax.set_title(f"CPU paged decode, {(metrics.get('cpu') or {}).get('model', '?')} shape")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "cpu_ratio.png", dpi=120)
        plt.close(fig)
        names.append("cpu_ratio.png")
    setup, sections = _gpu_from_points(points)
    if setup or sections:
        labels = list(BAR_LABELS.values())
        values = [(sections.get(k) or {}).get("tb_s") for k in BAR_LABELS]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(labels, [v or 0.0 for v in values])
        for i, (key, value) in enumerate(zip(BAR_LABELS, values)):
            if value is None:
                ax.text(i, 0, "failed" if key in sections else "not run", ha="center",
                        va="bottom", rotation=90, color="C3")
        ax.set_ylabel("TB/s (bytes read)")
        gpu = metrics.get("gpu") if isinstance(metrics.get("gpu"), dict) else {}
        ax.set_title(f"GPU decode, {setup.get('model', '?')} B={setup.get('batch', '?')} "
                     f"ctx={setup.get('context', '?')}{' (dry run)' if gpu.get('dry_run') else ''}"
                     f"{' (partial)' if metrics.get('partial') else ''}")
        fig.tight_layout()
        fig.savefig(out_dir / "gpu_bandwidth.png", dpi=120)
        plt.close(fig)
        names.append("gpu_bandwidth.png")
    return names


def describe(summary: dict) -> str:
    lines = []
    cpu = summary.get("cpu")
    if isinstance(cpu, dict):
        for p in cpu.get("points", []):
            lines.append(f"cpu B={p['batch']} context={p['context']}: paged/dense decode time "
                         f"{p['ratio']:.2f} (naive one-gather {p['naive_ratio']:.2f})")
    gpu = summary.get("gpu")
    if isinstance(gpu, dict):
        lines.append(f"gpu {gpu.get('model', '?')}: {_gpu_line(gpu)}"
                     f"{' (dry run)' if gpu.get('dry_run') else ''}")
        sweep = gpu.get("knob_sweep") or []
        if sweep:
            ok = [s for s in sweep if "tb_s" in s]
            best = max(ok, key=lambda s: s["tb_s"]) if ok else None
            lines.append(f"gpu knob sweep: {len(ok)}/{len(sweep)} configurations ran" + (
                f", best {best['tb_s']:.2f} TB/s at pages_per_block={best['pages_per_block']} "
                f"k_splits={best['k_splits']} num_warps={best['num_warps']}" if best else ""))
    elif gpu:
        lines.append(f"gpu: {gpu}")
    if summary.get("partial"):
        lines.append(f"PARTIAL: interrupted {summary.get('interrupted', '')}".strip())
    return "\n".join(lines)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv):
    del argv
    opts = Options.from_flags()
    backend = backend_name()
    on_gpu = gpu_runs(opts, backend)
    if opts.skip_cpu and not on_gpu:
        raise cli.BadInput("--skip_cpu leaves nothing to measure here (no GPU part: "
                           f"backend {backend}; --gpu_dry_run runs it interpreted)")
    if on_gpu and not opts.sections:
        raise cli.BadInput("--gpu_sections=sweep with --nogpu_sweep leaves no GPU section to run")
    if on_gpu and "peer" in opts.sections and opts.gpu_context % (PEER_K_SPLITS * opts.page_size):
        raise cli.BadInput(f"--gpu_context={opts.gpu_context} is not a multiple of "
                           f"{PEER_K_SPLITS} pages of --page_size={opts.page_size} (the peer "
                           f"kernel splits each sequence into {PEER_K_SPLITS})")
    measured = {}

    def measure_here(add_point):
        measured.update(measure(opts, add_point))
        return measured

    # SIGINT raises KeyboardInterrupt even where it was inherited ignored (a command started
    # with `&` by a script); SIGTERM (timeout's default signal) stops the measurement alike.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        runs.execute("bench_attention", opts.config(), measure_here, seed=opts.seed, plot=plot,
                     describe=describe)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if measured.get("partial"):
        sys.exit(130)  # interrupted: the partial summary is written and printed


if __name__ == "__main__":
    cli.run(main, define_flags)
