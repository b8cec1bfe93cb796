"""Paged-attention benchmark: `python -m experiments.bench_attention --json`.

CPU part: the reference-path paged decode against a dense (contiguous-cache) decode at the
SmolLM2-135M shape, timed side by side (interleaved repeats) in one run, reported as ratios;
a naive paged decode (one gather of the whole table) rides along for comparison.
GPU part (only when a GPU is present): the Pallas decode at the Qwen2.5-7B shape as bytes read
per second, against a device-to-device copy measured in the same run, against the H200's
4.8 TB/s, side by side with the JAX peer kernel on the same inputs, and int8 pages vs bf16.

Not a timed test: numbers go to a run directory (experiments/runs.py: one point per CPU
(batch, context) and per GPU configuration, the summary, plots) with the command, versions,
device and seed; --out also writes the summary to a file (results/bench_attention_<cpu|gpu>.json).
Quick run: --contexts=256,512 --batches=1 --repeats=3.
"""

from __future__ import annotations

import math
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
                         "GPU context (tokens per sequence; a multiple of 16 pages).",
                         lower_bound=1)
    flags.DEFINE_float("peak_tb_s", 4.8,
                       "Nominal HBM bandwidth (TB/s) of the device (H200: 4.8).", lower_bound=1e-3)
    flags.DEFINE_bool("gpu_sweep", True, "Also time a small grid of kernel knobs on GPU.")
    flags.DEFINE_bool("gpu_dry_run", False,
                      "Run the GPU part here with Pallas interpreted (checks the code path off "
                      "GPU; use small --gpu_batch/--gpu_context; numbers mean nothing).")
    runs.define_flags()


def _median_ms(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def _side_by_side(fns: dict, args: dict, repeats: int) -> dict:
    """Median ms of each function, repeats interleaved so drift hits all alike."""
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t) * 1e3) for name, t in times.items()}


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


def cpu_part(on_point=lambda point: None) -> dict:
    cfg = kq.get_model_config(FLAGS.cpu_model)
    hq, hkv, d, page = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, FLAGS.page_size
    dtype = jnp.dtype(FLAGS.cpu_dtype)
    scale = 1.0 / math.sqrt(d)
    rng = np.random.default_rng(FLAGS.seed)
    dense = jax.jit(lambda q, k, v, l: dense_decode(q, k, v, l, sm_scale=scale))
    paged = jax.jit(lambda q, k, v, t, l: pa.decode(q, k, v, t, l, sm_scale=scale,
                                                    backend="reference"))
    # The naive paged path for comparison: one gather of the whole table, then attention.
    naive = jax.jit(lambda q, k, v, t, l: pa.decode_reference(
        q, k, v, t, l, sm_scale=scale, chunk_pages=t.shape[1], pool_dot=False)[0])
    points = []
    for batch in cli.int_list("batches"):
        for context in cli.int_list("contexts"):
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
                                "naive": paged_args}, FLAGS.repeats)
            point = dict(batch=batch, context=context, dense_ms=ms["dense"],
                         paged_ms=ms["paged"], ratio=ms["paged"] / ms["dense"],
                         naive_paged_ms=ms["naive"], naive_ratio=ms["naive"] / ms["dense"],
                         max_abs_diff=err)
            print(f"[cpu] B={batch:2d} ctx={context:5d}  dense {ms['dense']:8.3f} ms  "
                  f"paged {ms['paged']:8.3f} ms  ratio {point['ratio']:.2f}  (naive one-gather "
                  f"{point['naive_ratio']:.2f})", file=sys.stderr)
            points.append(point)
            on_point({"kind": "cpu", **point})
    return dict(model=cfg.name, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=page,
                dtype=dtype.name, points=points, quant_error=quant_error(cfg, rng))


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


def gpu_part(on_point=lambda point: None) -> dict:
    from jax.experimental.pallas.ops.gpu import paged_attention as peer

    # The kernel's knobs (pages_per_block, k_splits, num_warps) are not arguments of the public
    # `pa.decode`; the sweep times the Pallas entry point behind it.
    from kernels.paged_attention import pallas_kernel

    cfg = kq.get_model_config(FLAGS.gpu_model)
    b, ctx, page = FLAGS.gpu_batch, FLAGS.gpu_context, FLAGS.page_size
    hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    scale = 1.0 / math.sqrt(d)
    key = jax.random.PRNGKey(FLAGS.seed)
    m = ctx // page
    n = b * m
    kk, kv_, kq_, kp = jax.random.split(key, 4)
    k = jax.random.normal(kk, (hkv, n, page, d), jnp.bfloat16)
    v = jax.random.normal(kv_, (hkv, n, page, d), jnp.bfloat16)
    tables = jax.random.permutation(kp, n).reshape(b, m).astype(jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    q = jax.random.normal(kq_, (b, hq, d), jnp.bfloat16)
    kv_bytes = 2 * b * ctx * hkv * d * 2  # K and V actually read, bf16

    # Device-to-device copy bandwidth: read + write of a buffer the size of the K/V read.
    buf = jax.random.normal(key, (kv_bytes // 2,), jnp.bfloat16)
    copy_ms = _median_ms(jax.jit(lambda x: -x), buf, repeats=FLAGS.repeats)
    copy_tb_s = 2 * buf.nbytes / (copy_ms * 1e-3) / 1e12

    interp = FLAGS.gpu_dry_run and backend_name() != "gpu"
    ours = jax.jit(lambda q, k, v, t, l: pallas_kernel.decode_pallas(
        q, k, v, t, l, interpret=interp)[0])
    theirs = jax.jit(lambda q, k, v, t, l: peer.paged_attention(
        q * scale, k, v, t, l, interpret=interp))
    kq8, vq8 = pa.quantize_kv(k, v, "int8")
    int8_bytes = kq8.nbytes + vq8.nbytes  # every page of the pool is read once
    ms = _side_by_side(
        {"ours_bf16": ours, "peer_bf16": theirs, "ours_int8": ours},
        {"ours_bf16": (q, k, v, tables, lengths), "peer_bf16": (q, k, v, tables, lengths),
         "ours_int8": (q, kq8, vq8, tables, lengths)},
        FLAGS.repeats,
    )
    ref_out = pa.decode(q, k, v, tables, lengths, backend="reference")
    check = {name: float(jnp.max(jnp.abs(fn(q, k, v, tables, lengths).astype(jnp.float32)
                                         - ref_out.astype(jnp.float32))))
             for name, fn in (("ours_bf16", ours), ("peer_bf16", theirs))}

    def rate(nbytes, t_ms):
        tb_s = nbytes / (t_ms * 1e-3) / 1e12
        return dict(ms=t_ms, bytes=nbytes, tb_s=tb_s, of_copy=tb_s / copy_tb_s,
                    of_peak=tb_s / FLAGS.peak_tb_s)

    sweep = []
    if FLAGS.gpu_sweep:
        for ppb in (4, 8):
            for splits in (2, 4, 8):
                for warps in (4, 8):
                    knobs = dict(pages_per_block=ppb, k_splits=splits, num_warps=warps)
                    fn = jax.jit(lambda q, k, v, t, l, kn=knobs: pallas_kernel.decode_pallas(
                        q, k, v, t, l, interpret=interp, **kn)[0])
                    try:
                        t_ms = _median_ms(fn, q, k, v, tables, lengths, repeats=10)
                        sweep.append(dict(knobs, **rate(kv_bytes, t_ms)))
                    except Exception as e:  # a failed configuration is data, not a crash
                        sweep.append(dict(knobs, error=f"{type(e).__name__}: {e}"[:300]))
                    on_point({"kind": "gpu_knobs", **sweep[-1]})
    result = dict(
        model=cfg.name, batch=b, context=ctx, q_heads=hq, kv_heads=hkv, head_dim=d,
        page_size=page, dtype="bfloat16", copy=dict(ms=copy_ms, tb_s=copy_tb_s),
        ours_bf16=rate(kv_bytes, ms["ours_bf16"]), peer_bf16=rate(kv_bytes, ms["peer_bf16"]),
        ours_int8=rate(int8_bytes, ms["ours_int8"]),
        speedup_vs_peer=ms["peer_bf16"] / ms["ours_bf16"],
        int8_speedup_vs_bf16=ms["ours_bf16"] / ms["ours_int8"], max_abs_diff_vs_reference=check,
        knob_sweep=sweep,
    )
    on_point({"kind": "gpu", **{k: v for k, v in result.items() if k != "knob_sweep"}})
    print(f"[gpu] copy {copy_tb_s:.2f} TB/s; ours {result['ours_bf16']['tb_s']:.2f} TB/s "
          f"({result['ours_bf16']['of_copy']:.0%} of copy); peer "
          f"{result['peer_bf16']['tb_s']:.2f} TB/s; x{result['speedup_vs_peer']:.2f} vs peer; "
          f"int8 x{result['int8_speedup_vs_bf16']:.2f} vs bf16", file=sys.stderr)
    return result


def measure(on_point) -> dict:
    backend = jax.default_backend()
    record = {"seed": FLAGS.seed}
    if not FLAGS.skip_cpu:
        record["cpu"] = cpu_part(on_point)
    if (backend == "gpu" or FLAGS.gpu_dry_run) and not FLAGS.skip_gpu:
        record["gpu"] = gpu_part(on_point)
        record["gpu"]["dry_run"] = backend != "gpu"
    else:
        record["gpu"] = None if FLAGS.skip_gpu else f"skipped: no GPU (backend {backend})"
    return record


def plot(points, metrics, out_dir) -> list[str]:
    """cpu_ratio.png (paged / dense decode time vs context, per batch) and, with a GPU part,
    gpu_bandwidth.png (TB/s of each kernel and of the copy), from the run's files."""
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
        ax.set_title(f"CPU paged decode, {metrics['cpu']['model']} shape")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "cpu_ratio.png", dpi=120)
        plt.close(fig)
        names.append("cpu_ratio.png")
    gpu = [p for p in points if p["kind"] == "gpu"]
    if gpu:
        g = gpu[-1]
        labels = ["copy", "ours bf16", "peer bf16", "ours int8"]
        values = [g["copy"]["tb_s"], g["ours_bf16"]["tb_s"], g["peer_bf16"]["tb_s"],
                  g["ours_int8"]["tb_s"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(labels, values)
        ax.set_ylabel("TB/s (bytes read)")
        ax.set_title(f"GPU decode, {g['model']} B={g['batch']} ctx={g['context']}"
                     f"{' (dry run)' if metrics['gpu'].get('dry_run') else ''}")
        fig.tight_layout()
        fig.savefig(out_dir / "gpu_bandwidth.png", dpi=120)
        plt.close(fig)
        names.append("gpu_bandwidth.png")
    return names


def describe(summary: dict) -> str:
    lines = []
    if summary.get("cpu"):
        for p in summary["cpu"]["points"]:
            lines.append(f"cpu B={p['batch']} context={p['context']}: paged/dense decode time "
                         f"{p['ratio']:.2f} (naive one-gather {p['naive_ratio']:.2f})")
    gpu = summary.get("gpu")
    if isinstance(gpu, dict):
        lines.append(f"gpu {gpu['model']}: ours {gpu['ours_bf16']['tb_s']:.2f} TB/s "
                     f"({gpu['ours_bf16']['of_copy']:.0%} of copy), x{gpu['speedup_vs_peer']:.2f} "
                     f"vs peer{' (dry run)' if gpu['dry_run'] else ''}")
    elif gpu:
        lines.append(f"gpu: {gpu}")
    return "\n".join(lines)


def main(argv):
    del argv
    backend = jax.default_backend()
    gpu_runs = (backend == "gpu" or FLAGS.gpu_dry_run) and not FLAGS.skip_gpu
    if FLAGS.skip_cpu and not gpu_runs:
        raise cli.BadInput("--skip_cpu leaves nothing to measure here (no GPU part: "
                           f"backend {backend}; --gpu_dry_run runs it interpreted)")
    if gpu_runs and FLAGS.gpu_context % (PEER_K_SPLITS * FLAGS.page_size):
        raise cli.BadInput(f"--gpu_context={FLAGS.gpu_context} is not a multiple of "
                           f"{PEER_K_SPLITS} pages of --page_size={FLAGS.page_size} (the peer "
                           f"kernel splits each sequence into {PEER_K_SPLITS})")
    names = ["contexts", "batches", "cpu_model", "cpu_dtype", "page_size", "repeats", "seed",
             "skip_cpu", "skip_gpu", "gpu_model", "gpu_batch", "gpu_context", "peak_tb_s",
             "gpu_sweep", "gpu_dry_run"]
    config = {name: FLAGS[name].value for name in names}
    config.update(contexts=cli.int_list("contexts"), batches=cli.int_list("batches"))
    runs.execute("bench_attention", config, measure, seed=FLAGS.seed, plot=plot,
                 describe=describe)


if __name__ == "__main__":
    cli.run(main, define_flags)
