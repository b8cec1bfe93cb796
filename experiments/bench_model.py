r"""SmolLM2-135M prefill and decode throughput, paged KV cache vs a dense contiguous cache.

  python -m experiments.bench_model --json

For each batch size (1, 8) and context (512, 2048), both caches get the same prompts (pydoc text,
one offset per row) and the same chunk size:
  * prefill: wall time of the whole chunked prefill (the paged one includes the allocator's admit),
    after a warm-up on the same shapes so no compile is timed -> tokens/s;
  * decode: mean wall time of a full step at that context (paged: the allocator's donated append
    with its validation, then the model; dense: the model) over --decode_steps steps after a
    warm-up step -> tokens/s = batch / step time.
`ratio` = paged time / dense time (goal for decode: <= 1.25). `scheduler_step`: the serving
scheduler's decode step (kq.serving.Scheduler over a ModelExecutor: append + forward + sample in
one jitted call, one readback) against the engine's (facade append with its validation reads,
the forward, the logits back to the host, host argmax), in the same alternation -> steps/s of
each, `speedup` = engine time / scheduler time, the scheduler's host syncs per step, and whether
both sampled the same greedy tokens. `record_attention`: the cost of the
attention statistics (DESIGN.md, tiered KV storage): a third engine, paged with
`record_attention=True` (each decode step also asks the kernels for per-token attention mass
and adds it into the state's `blocks.attn_mass`, in the same jitted step), timed in the same
alternation -> its median step beside the plain paged one, `ratio` = on / off; `recorded_mass`
checks the bookkeeping (the state's total mass / the expected steps * batch * layers * KV
heads: 1.0). Written to a run directory
(experiments/runs.py: one point per (batch, context) with the 1-minute load average when it was
taken, the summary, plots) and, with --out, to a file (results/bench_model.json); a point that
runs out of memory is recorded as data. Quick run: --batches=1 --contexts=64 --decode_steps=2.
Not a test: numbers depend on the machine and its load (decode steps of the two
caches alternate, and each reports its median, so a busy neighbour hurts both alike).
"""

from __future__ import annotations

import math
import os
import sys
import time

import jax
import numpy as np
from absl import flags

import kvquota as kq
from experiments import cli, runs

FLAGS = flags.FLAGS
MODEL = "smollm2-135m"


def define_flags():
    cli.define_int_list("batches", [1, 8], "Batch sizes", lower=1, upper=256)
    cli.define_int_list("contexts", [512, 2048], "Context lengths (prompt tokens)", lower=1,
                        upper=kq.get_model_config(MODEL).max_context)
    flags.DEFINE_integer("decode_steps", 8, "Timed decode steps per point.", lower_bound=1)
    flags.DEFINE_integer("chunk_size", 512, "Prefill chunk length.", lower_bound=1)
    flags.DEFINE_integer("block_size", 16, "Tokens per KV block.", lower_bound=1,
                         upper_bound=1024)
    flags.DEFINE_enum("kv_format", "f32", ["f32", "bf16"], "KV format of both caches.")
    runs.define_flags()


def _prompts(tok, batch: int, context: int) -> list[list[int]]:
    """`batch` prompts of `context` tokens of real text, each from its own offset."""
    from pydoc_data.topics import topics

    ids = tok.encode("\n".join(topics[k] for k in sorted(topics)))
    stride = (len(ids) - context) // max(batch, 1)
    return [ids[i * stride: i * stride + context] for i in range(batch)]


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench_point(config, params, prompts, *, steps: int, chunk: int, block: int,
                kv_format: str) -> dict:
    """One (batch, context) point: prefill and decode on both caches.

    The machine may be shared, so decode steps alternate dense / paged and each side reports
    its median step; prefill is one timed run per side (after a one-chunk warm-up).
    """
    import jax.numpy as jnp

    b, ctx = len(prompts), len(prompts[0])
    capacity = ctx + steps + 2
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[kv_format]
    per_seq = math.ceil(capacity / block)
    sc = kq.StateConfig(model=config, num_blocks=b * per_seq, block_size=block, max_seqs=b,
                     max_blocks_per_seq=per_seq, num_tenants=1, kv_format=kv_format)

    def new_dense():
        return kq.DenseEngine(config, params, capacity=capacity, chunk_size=chunk,
                             cache_dtype=dtype)

    def new_paged(record=False):
        eng = kq.PagedEngine(config, params, sc, chunk_size=chunk, record_attention=record)
        eng.register_tenant(0, token_quota=2**31 - 1, byte_quota=eng.max_byte_quota)
        return eng

    # Warm-up (compiles) on the same shapes: one prefill chunk and one decode step each.
    warm = new_dense()
    warm.prefill(prompts, max_chunks=1)
    warm.decode(np.arange(b), np.zeros(b, np.int32))
    for record in (False, True):
        warm = new_paged(record)
        report = warm.reserve([0] * b, prompts)
        warm.prefill(report, prompts, max_chunks=1)
        warm.decode(report.seq_id.astype(np.int32), np.zeros(b, np.int32))
    del warm

    dense = new_dense()
    last_d, dense_prefill = _timed(lambda: dense.prefill(prompts))
    paged = new_paged()
    (report, last_p), paged_prefill = _timed(lambda: paged.admit([0] * b, prompts))
    seq_ids = report.seq_id.astype(np.int32)
    recording = new_paged(record=True)
    rec_report, last_r = recording.admit([0] * b, prompts)  # untimed: its prefill is paged's
    rec_ids = rec_report.seq_id.astype(np.int32)

    # Decode: greedy on each side from its own logits; the first step is untimed.
    tok_d = last_d.argmax(-1).astype(np.int32)
    tok_p = last_p.argmax(-1).astype(np.int32)
    tok_d = np.asarray(dense.decode(np.arange(b), tok_d)).argmax(-1).astype(np.int32)
    tok_p = np.asarray(paged.decode(seq_ids, tok_p)[1]).argmax(-1).astype(np.int32)
    tok_r = last_r.argmax(-1).astype(np.int32)
    tok_r = np.asarray(recording.decode(rec_ids, tok_r)[1]).argmax(-1).astype(np.int32)
    sched = _scheduler(config, params, sc, prompts, chunk, steps)
    sched_steps, syncs0 = [], (sched.syncs, sched.executor.syncs)
    dense_steps, paged_steps, rec_steps = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        sched.step()
        sched_steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        tok_d = np.asarray(dense.decode(np.arange(b), tok_d)).argmax(-1).astype(np.int32)
        dense_steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        tok_p = np.asarray(paged.decode(seq_ids, tok_p)[1]).argmax(-1).astype(np.int32)
        paged_steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        tok_r = np.asarray(recording.decode(rec_ids, tok_r)[1]).argmax(-1).astype(np.int32)
        rec_steps.append(time.perf_counter() - start)
    dense_step, paged_step = float(np.median(dense_steps)), float(np.median(paged_steps))
    rec_step, sched_step = float(np.median(rec_steps)), float(np.median(sched_steps))
    sched_syncs = (sched.syncs + sched.executor.syncs - sum(syncs0)) / steps
    sched_tokens = [r.tokens[1: steps + 2] for r in sched.requests]  # the same positions as
    paged_tokens = tok_p  # the engine's last step sampled (greedy, same prompts)
    same_tokens = bool((tok_d == tok_p).all())
    expected_mass = (steps + 1) * b * config.num_layers * config.num_kv_heads
    recorded = float(np.asarray(recording.state.blocks.attn_mass, np.float64).sum())
    del dense, paged, recording, sched

    return {
        "batch": b,
        "context": ctx,
        "prefill_tokens_per_s": {"dense": b * ctx / dense_prefill,
                                 "paged": b * ctx / paged_prefill},
        "prefill_seconds": {"dense": dense_prefill, "paged": paged_prefill,
                            "ratio": paged_prefill / dense_prefill},
        "decode_tokens_per_s": {"dense": b / dense_step, "paged": b / paged_step},
        "decode_step_ms": {"dense": 1e3 * dense_step, "paged": 1e3 * paged_step,
                           "ratio": paged_step / dense_step},
        "same_greedy_tokens": same_tokens,
        "record_attention": {"decode_step_ms": {"off": 1e3 * paged_step, "on": 1e3 * rec_step,
                                                "ratio": rec_step / paged_step},
                             "same_greedy_tokens": bool((tok_r == tok_p).all()),
                             "recorded_mass": recorded / expected_mass},
        # the scheduler's one-sync step (kq.serving.Scheduler + ModelExecutor: append, forward
        # and sample in one jitted call, one readback) beside today's engine step (facade
        # append, forward, logits to the host, host argmax)
        "scheduler_step": {"steps_per_s": {"engine": 1 / paged_step, "scheduler": 1 / sched_step},
                           "step_ms": {"engine": 1e3 * paged_step, "scheduler": 1e3 * sched_step},
                           "speedup": paged_step / sched_step,
                           "host_syncs_per_step": sched_syncs,
                           "same_greedy_tokens": bool(all(
                               len(t) == steps + 1 and t[-1] == int(p)
                               for t, p in zip(sched_tokens, paged_tokens)))},
        "load_average_1min": os.getloadavg()[0],
    }


def _scheduler(config, params, sc, prompts, chunk: int, steps: int):
    """A Scheduler whose requests (the same prompts, tenant 0) have all been prefilled and have
    made one (compiling) decode step: the next `steps` steps are pure decode steps."""
    ex = kq.serving.ModelExecutor(config, params, sc, prefill_rows=min(len(prompts), 4),
                                  chunk_size=chunk, chunk_floor=chunk)
    sched = kq.serving.Scheduler(ex, token_budget=len(prompts) * chunk + sc.max_seqs)
    sched.register_tenant(0, token_quota=2**31 - 1, byte_quota=(2**31 - 1) * sc.unit_bytes)
    for p in prompts:
        sched.submit(kq.serving.Request(0, p, steps + 2))
    while any(r.status != "running" for r in sched.requests):
        sched.step()
    sched.step()
    return sched


def _out_of_memory(error: Exception) -> bool:
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


def run(batches, contexts, *, steps=8, chunk=512, block=16, kv_format="f32", log=print,
        on_point=lambda point: None) -> dict:
    """All points; returns the results record. `on_point(dict)` receives each point as it is
    measured; a point that runs out of memory is recorded with an "error" instead."""
    config, params = kq.load_smollm2()
    tok = kq.from_gguf(kq.smollm2_gguf_path())
    points = []
    for ctx in contexts:
        for b in batches:
            try:
                point = bench_point(config, params, _prompts(tok, b, ctx), steps=steps,
                                    chunk=chunk, block=block, kv_format=kv_format)
            except Exception as error:  # out of memory is data; anything else is a bug
                if not _out_of_memory(error):
                    raise
                point = {"batch": b, "context": ctx, "error": f"{type(error).__name__}: "
                         f"{str(error)[:300]}", "load_average_1min": os.getloadavg()[0]}
                log(f"batch {b:2d} context {ctx:5d}: {point['error']}")
            else:
                log(describe_point(point))
            points.append(point)
            on_point(point)
    device = jax.devices()[0]
    return {
        "model": config.name,
        "kv_format": kv_format,
        "block_size": block,
        "chunk_size": chunk,
        "decode_steps": steps,
        "attention_backend": "auto -> " + ("pallas" if device.platform == "gpu" else "reference"),
        "points": points,
    }


def describe_point(point: dict) -> str:
    if "error" in point:
        return f"batch {point['batch']:2d} context {point['context']:5d}: {point['error']}"
    pre, step = point["prefill_tokens_per_s"], point["decode_step_ms"]
    rec = point.get("record_attention", {}).get("decode_step_ms")
    sched = point.get("scheduler_step")
    return (f"batch {point['batch']:2d} context {point['context']:5d}: prefill tok/s dense "
            f"{pre['dense']:8.1f} paged {pre['paged']:8.1f} "
            f"(x{point['prefill_seconds']['ratio']:.2f} time) | decode step ms dense "
            f"{step['dense']:7.1f} paged {step['paged']:7.1f} (x{step['ratio']:.2f})"
            + (f" | recording attention {rec['on']:7.1f} (x{rec['ratio']:.2f})" if rec else "")
            + (f" | steps/s engine {sched['steps_per_s']['engine']:6.1f} scheduler "
               f"{sched['steps_per_s']['scheduler']:6.1f} (x{sched['speedup']:.2f}, "
               f"{sched['host_syncs_per_step']:.0f} sync)" if sched else ""))


def plot(points, metrics, out_dir) -> list[str]:
    """decode_step.png and prefill.png: dense vs paged per batch against context, from the run's
    files (points that failed are left out)."""
    import matplotlib.pyplot as plt

    ok = [p for p in points if "error" not in p]
    if not ok:
        return []
    names = []
    for name, key, unit in (("decode_step.png", "decode_step_ms", "ms per decode step"),
                            ("prefill.png", "prefill_tokens_per_s", "prefill tokens/s")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for batch in sorted({p["batch"] for p in ok}):
            rows = sorted((p for p in ok if p["batch"] == batch), key=lambda p: p["context"])
            ctx = [p["context"] for p in rows]
            line, = ax.plot(ctx, [p[key]["dense"] for p in rows], "o--",
                            label=f"dense, B={batch}")
            ax.plot(ctx, [p[key]["paged"] for p in rows], "s-", color=line.get_color(),
                    label=f"paged, B={batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(f"{metrics['model']}, {metrics['kv_format']} cache")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        names.append(name)
    return names


def main(argv):
    del argv
    limit = kq.get_model_config(MODEL).max_context
    batches, contexts = cli.int_list("batches"), cli.int_list("contexts")
    if max(contexts) + FLAGS.decode_steps + 2 > limit:
        raise cli.BadInput(f"--contexts up to {max(contexts)} plus --decode_steps="
                           f"{FLAGS.decode_steps} (+2) exceed {MODEL}'s context of {limit}")
    config = {"batches": batches, "contexts": contexts, "decode_steps": FLAGS.decode_steps,
              "chunk_size": FLAGS.chunk_size, "block_size": FLAGS.block_size,
              "kv_format": FLAGS.kv_format}
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731 (progress; stdout: the summary)

    def measure(on_point):
        return run(batches, contexts, steps=FLAGS.decode_steps, chunk=FLAGS.chunk_size,
                   block=FLAGS.block_size, kv_format=FLAGS.kv_format, log=log,
                   on_point=on_point)

    runs.execute("bench_model", config, measure, seed=None, plot=plot,
                 describe=lambda summary: "\n".join(map(describe_point, summary["points"])))


if __name__ == "__main__":
    cli.run(main, define_flags)
