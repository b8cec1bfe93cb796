"""Benchmark of the tier operations: `python -m experiments.bench_tiers --json`.

    python -m experiments.bench_tiers --json [--out=results/bench_tiers.json]
    python -m experiments.bench_tiers --models=smollm2-135m --seqs=2 --seq_tokens=80 \\
        --formats=int8 --repeats=2 --keep_recent=16                       # quick

At the KV geometry of each model (default SmolLM2-135M and Qwen2.5-7B: layers, KV heads,
head_dim), one state with a bf16 pool 0, one compressed pool per --formats entry and a host pool
(in `pinned_host` memory where the backend has it; it holds every sequence exactly, so its
watermark alarm rings after the offload): one tenant, --seqs sequences of --seq_tokens
random token ids admitted, the pool-0 pages of their blocks filled with random values. Then,
through the public facade with `donate=True`,

  * offload: every sequence's own blocks to the host pool (`Allocator.offload`),
  * restore: all of them back to pool 0 (`Allocator.restore`, from the offloaded state),
  * evict (token and block mode, StreamingLLM, half the tokens kept): blocks returned, exact;
  * compress: every full block outside the --keep_recent most recent tokens into each
    compressed pool (`Allocator.compress`, oldest first; quantized formats, and fp8 as a cast),

each timed as the median of --repeats calls, every call on a fresh copy of its input state
(the copy untimed; one untimed call first compiles). Beside each op, in the same loop
(interleaved, so load drift hits all alike), a plain copy of the same bytes: a jitted device
copy (`jnp.copy`) and, for offload and restore, a device -> pinned_host (host -> device)
`jax.device_put`. Times on a shared machine are noisy: the figures to read are the ratios (op
time / plain copy time, of the medians; every time is kept). Bytes come exactly from the
reports (MoveReport, CompressReport) and are checked against the ledger before and after
(`Allocator.ledger`: free blocks and charged blocks per pool); `Allocator.check` runs once on
each op's result, outside the timing.

A failed op (or a model's failed setup) is recorded as data, an "error", and the rest go on.
Ctrl-C (SIGINT) writes what was measured as a summary marked `"partial": true` (exit status
130). Writes a run directory (experiments/runs.py): one point per model setup and per op, the
summary, and one plot (tiers.png); --out also writes the summary to a file.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import kvquota as kq
from experiments import cli, runs

FLAGS = flags.FLAGS
MiB = 1 << 20
POOL0_FORMAT = "bf16"


def _compresses(fmt) -> bool:
    """A format bf16 pages are compressed into: quantized, or a narrower float (fp8: a cast)."""
    return fmt.quantized or fmt.element_bytes < kq.get_kv_format(POOL0_FORMAT).element_bytes


COMPRESSED = [name for name, fmt in kq.KV_FORMATS.items() if _compresses(fmt)]
DEFAULT_FORMATS = [n for n in ("int8", "int4", "kivi4", "kivi2", "fp8") if n in COMPRESSED]
TENANT = 0
BASELINE_CALLS = 3  # plain copies timed after each op call (cheap; steadies their median)


def define_flags():
    flags.DEFINE_list("models", ["smollm2-135m", "qwen2.5-7b"],
                      f"Model presets whose KV geometry is used, some of: {', '.join(kq.MODELS)}.")
    flags.register_validator("models", _check_models)
    flags.DEFINE_list("formats", DEFAULT_FORMATS,
                      f"Compressed pools (quantized or 8-bit float), some of: "
                      f"{', '.join(COMPRESSED)}.")
    flags.register_validator("formats", _check_formats)
    flags.DEFINE_integer("seqs", 4, "Sequences admitted (one tenant).", lower_bound=1,
                         upper_bound=256)
    flags.DEFINE_integer("seq_tokens", 504, "Tokens per sequence (the last block half full "
                         "by default).", lower_bound=1, upper_bound=1 << 17)
    flags.DEFINE_integer("block_size", 16, "Tokens per block.", lower_bound=1, upper_bound=1024)
    flags.DEFINE_integer("keep_recent", 32, "compress: most recent tokens kept in pool 0.",
                         lower_bound=0)
    flags.DEFINE_integer("repeats", 7, "Timed calls per op (median reported).", lower_bound=1,
                         upper_bound=1000)
    flags.DEFINE_integer("max_state_mib", 512,
                         "Refuse a model whose page arrays (every pool) would exceed this.",
                         lower_bound=1)
    flags.DEFINE_boolean("scrub_on_free", False, "Zero the pages of freed blocks (config knob).")
    flags.DEFINE_integer("seed", 0, "Seed of token ids and page values.", lower_bound=0)
    runs.define_flags()


def _check_models(values) -> bool:
    if not values:
        raise flags.ValidationError("--models needs at least one preset")
    for name in values:
        try:
            kq.get_model_config(name)
        except ValueError as error:
            raise flags.ValidationError(str(error)) from None
    return True


def _check_formats(values) -> bool:
    if not values:
        raise flags.ValidationError("--formats needs at least one compressed format")
    for name in values:
        try:
            fmt = kq.get_kv_format(name)
        except ValueError as error:
            raise flags.ValidationError(str(error)) from None
        if not _compresses(fmt):
            raise flags.ValidationError(
                f"kv_format {name!r} is neither quantized nor narrower than pool 0's "
                f"{POOL0_FORMAT}: nothing to compress into; use some of: {', '.join(COMPRESSED)}")
    if len(set(values)) != len(values):
        raise flags.ValidationError(f"--formats lists a format twice: {','.join(values)}")
    return True


# ---- the state ----------------------------------------------------------------------------------


def blocks_per_seq(seq_tokens: int, block_size: int) -> int:
    return -(-seq_tokens // block_size)


def make_config(model: str, *, seqs, seq_tokens, block_size, formats, scrub_on_free=False):
    """pool 0 (bf16) holds every sequence plus one spare block per sequence; each compressed pool
    and the host pool hold every sequence's blocks (room for any one op on all of them)."""
    per_seq = blocks_per_seq(seq_tokens, block_size)
    used = seqs * per_seq
    return kq.StateConfig(
        kq.get_model_config(model), num_blocks=used + seqs, block_size=block_size,
        max_seqs=seqs, max_blocks_per_seq=per_seq, num_tenants=1, kv_format=POOL0_FORMAT,
        compressed_pools=tuple((name, used) for name in formats), host_blocks=used,
        scrub_on_free=scrub_on_free)


def page_bytes(config) -> int:
    """Bytes of every pool's page arrays (what the state holds beside its metadata)."""
    return sum(b * n for b, n in zip(config.pool_bytes, config.pool_sizes))


def build_state(config, seq_tokens: int, seed: int):
    """One tenant, `max_seqs` sequences of `seq_tokens` random token ids, the pool-0 pages of
    their blocks random (free pages stay zero, as scrub_on_free requires)."""
    alloc = kq.Allocator(config)
    state = alloc.init()
    device_bytes = sum(b * n for b, n, on_device in zip(
        config.pool_bytes, config.pool_sizes, config.device_pools) if on_device)
    state, _ = alloc.register_tenant(state, TENANT, token_quota=kq.INT32_MAX,
                                     byte_quota=device_bytes)  # every device block: never short
    rng = np.random.default_rng(seed)
    seqs, tokens = config.max_seqs, config.max_tokens_per_seq
    ids = rng.integers(0, config.model.vocab_size, (seqs, tokens), dtype=np.int32)
    state, report = alloc.admit(state, np.full(seqs, TENANT, np.int32), ids,
                                np.full(seqs, seq_tokens, np.int32))
    if report.reasons() != ["ok"] * seqs:
        raise RuntimeError(f"admission refused: {report.reasons()}")
    pool0 = state.pages[0]
    held = (state.blocks.ref_count[: config.num_blocks] > 0)[None, None, :, None, None]
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    k = jnp.where(held, jax.random.normal(kk, pool0.k.shape, pool0.k.dtype), 0)
    v = jnp.where(held, jax.random.normal(kv, pool0.v.shape, pool0.v.dtype), 0)
    state = state.replace(pages=(pool0.replace(k=k, v=v),) + tuple(state.pages[1:]))
    jax.block_until_ready(state)
    return alloc, state


def copy_state(state):
    """A fresh copy of every buffer, each in its own memory (pinned_host stays pinned_host)."""
    out = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), state)
    jax.block_until_ready(out)
    return out


# ---- measuring ----------------------------------------------------------------------------------


def _timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def time_op(call, base, nbytes: int, host_copy: str | None, repeats: int):
    """(first result, {name: [seconds]}, reports alike): the op on `repeats` fresh copies of
    `base`, each call followed by BASELINE_CALLS device copies of `nbytes` and, with `host_copy`
    ("to_host"/"to_device"), as many device_puts of them across memories, interleaved. The first
    (compiling) call is untimed; its result is returned."""
    first = call(copy_state(base))
    jax.block_until_ready(first)
    device = jax.devices()[0]
    sharding_h = kq.host_sharding()
    x = jnp.ones((max(nbytes // 2, 1),), jnp.bfloat16)
    copy = jax.jit(jnp.copy)
    jax.block_until_ready(copy(x))
    if host_copy is not None and sharding_h is not None:
        src = x if host_copy == "to_host" else jax.device_put(x, sharding_h)
        dst = sharding_h if host_copy == "to_host" else jax.sharding.SingleDeviceSharding(
            device, memory_kind="device")
        jax.block_until_ready(jax.device_put(src, dst))
    else:
        src = dst = None
    seconds = {"op": [], "device_copy": []}
    if src is not None:
        seconds["host_copy"] = []
    blocks = set()
    for _ in range(repeats):
        fresh = copy_state(base)
        t0 = time.perf_counter()
        out = call(fresh)
        jax.block_until_ready(out)
        seconds["op"].append(time.perf_counter() - t0)
        blocks.add(_blocks_of(out[1]))
        del out, fresh
        for _ in range(BASELINE_CALLS):
            seconds["device_copy"].append(_timed(lambda: copy(x)))
            if src is not None:
                seconds["host_copy"].append(_timed(lambda: jax.device_put(src, dst)))
    return first, seconds, blocks == {_blocks_of(first[1])}


def _blocks_of(report) -> int:
    """What an op's report says it did (the same in every repeat, or the op is not stable)."""
    if isinstance(report, kq.CompressReport):
        return report.blocks_compressed
    if isinstance(report, kq.EvictReport):
        return int(np.asarray(report.evicted_tokens).sum())
    return report.blocks_moved


def device_bytes_returned(config, delta) -> int:
    """Device bytes the tenant stopped being charged for (negative: took more), off the ledger."""
    return -sum(d * b for d, b, dev in zip(delta["charged_blocks"], config.pool_bytes,
                                           config.device_pools) if dev)


def ledger_delta(alloc, before, after) -> dict:
    """Per-pool change of free blocks and of charged blocks (all tenants) between two states."""
    a, b = alloc.ledger(before), alloc.ledger(after)
    free = np.asarray(b.free_blocks, np.int64) - np.asarray(a.free_blocks, np.int64)
    charged = (np.asarray(b.charged_blocks, np.int64).sum(0)
               - np.asarray(a.charged_blocks, np.int64).sum(0))
    return {"free_blocks": free.tolist(), "charged_blocks": charged.tolist()}


def _timing(seconds: dict) -> dict:
    """Medians and their ratios, with every time kept. (Not minima: on CPU a plain copy is
    bimodal, a few ms when the allocator hands back warm pages, 5-10x that on fresh ones.)"""
    med = {name: statistics.median(t) for name, t in seconds.items()}
    has_host = "host_copy" in med
    return {"seconds": med["op"], "device_copy_seconds": med["device_copy"],
            "ratio_vs_device_copy": med["op"] / med["device_copy"],
            "host_copy_seconds": med.get("host_copy"),
            "ratio_vs_host_copy": med["op"] / med["host_copy"] if has_host else None,
            "seconds_all": seconds["op"], "device_copy_seconds_all": seconds["device_copy"],
            "host_copy_seconds_all": seconds.get("host_copy")}


def move_record(config, rep, delta, src: int, dst: int) -> dict:
    """A MoveReport's figures, and the same bytes read off the ledger's change."""
    pb = config.pool_bytes
    ledger = {
        "pool_bytes_returned": delta["free_blocks"][src] * pb[src],
        "bytes_moved": delta["charged_blocks"][dst] * pb[dst],
        "source_charged_bytes_dropped": -delta["charged_blocks"][src] * pb[src],
        "destination_free_bytes_taken": -delta["free_blocks"][dst] * pb[dst],
        "device_bytes_returned": device_bytes_returned(config, delta),
    }
    # offload returns the device blocks it moved; restore takes as many back
    on_device = rep.pool_bytes_returned if src == 0 else -rep.bytes_moved
    record = {"blocks_moved": rep.blocks_moved, "bytes_moved": rep.bytes_moved,
              "pool_bytes_returned": rep.pool_bytes_returned,
              "device_bytes_returned": on_device,
              "transfer_seconds_modelled": rep.transfer_seconds, "host_alarm": rep.host_alarm}
    record["bytes_match_ledger"] = (
        ledger["pool_bytes_returned"] == rep.pool_bytes_returned
        and ledger["device_bytes_returned"] == on_device
        and ledger["bytes_moved"] == rep.bytes_moved
        == ledger["source_charged_bytes_dropped"] == ledger["destination_free_bytes_taken"])
    record["ledger"] = {**ledger, **{f"{k}_delta": v for k, v in delta.items()}}
    return record


def compress_record(config, rep, delta, pool: int) -> dict:
    """A CompressReport's figures, and the same bytes read off the ledger's change."""
    pb = config.pool_bytes
    ledger = {
        "pool0_bytes_freed": delta["free_blocks"][0] * pb[0],
        "pool0_charged_bytes_dropped": -delta["charged_blocks"][0] * pb[0],
        "compressed_bytes_charged": delta["charged_blocks"][pool] * pb[pool],
        "compressed_free_bytes_taken": -delta["free_blocks"][pool] * pb[pool],
        "net_device_bytes_returned": device_bytes_returned(config, delta),
    }
    record = {"blocks_compressed": rep.blocks_compressed,
              "pool0_bytes_freed": rep.pool0_bytes_freed,
              "compressed_bytes_charged": rep.compressed_bytes_charged,
              "net_device_bytes_returned": rep.net_device_bytes_returned,
              "device_bytes_returned": rep.net_device_bytes_returned,
              "bytes_per_block": pb[pool], "fraction_of_bf16_block": pb[pool] / pb[0],
              "returned_fraction_of_freed": (rep.net_device_bytes_returned
                                             / rep.pool0_bytes_freed
                                             if rep.pool0_bytes_freed else None)}
    record["bytes_match_ledger"] = (
        ledger["pool0_bytes_freed"] == ledger["pool0_charged_bytes_dropped"]
        == rep.pool0_bytes_freed
        and ledger["compressed_bytes_charged"] == ledger["compressed_free_bytes_taken"]
        == rep.compressed_bytes_charged
        and ledger["net_device_bytes_returned"] == rep.net_device_bytes_returned)
    record["ledger"] = {**ledger, **{f"{k}_delta": v for k, v in delta.items()}}
    return record


def run_model(model: str, opts: dict, on_point, result: dict | None = None) -> dict:
    """Every op at one model's geometry, filling `result` as it goes (an interrupted run keeps
    what was measured); a failed op is recorded (error) and the rest go on."""
    result = {} if result is None else result
    config = make_config(model, seqs=opts["seqs"], seq_tokens=opts["seq_tokens"],
                         block_size=opts["block_size"], formats=opts["formats"],
                         scrub_on_free=opts["scrub_on_free"])
    t0 = time.perf_counter()
    alloc, base = build_state(config, opts["seq_tokens"], opts["seed"])
    alloc.check(base)
    ids = np.arange(config.max_seqs, dtype=np.int32)
    setup = {
        "model": model, "layers": config.model.num_layers,
        "kv_heads": config.model.num_kv_heads, "head_dim": config.model.head_dim,
        "block_size": config.block_size, "seqs": config.max_seqs,
        "seq_tokens": opts["seq_tokens"], "blocks_in_use": int(config.max_seqs
                                                              * config.max_blocks_per_seq),
        "pools": [{"format": fmt.name, "blocks": n, "bytes_per_block": b,
                   "tier": "host" if p == config.host_pool else "device"}
                  for p, (fmt, n, b) in enumerate(zip(config.pool_formats, config.pool_sizes,
                                                      config.pool_bytes))],
        "page_mib": page_bytes(config) / MiB,
        "host_memory": "pinned_host" if kq.host_sharding() is not None else "device",
        "setup_seconds": time.perf_counter() - t0,
    }
    on_point({"kind": "setup", **setup})
    result.update(setup=setup, offload=None, restore=None, compress={}, evict={})
    repeats = opts["repeats"]

    def attempt(op, fmt, body):
        """Runs one op into the result (stored before its point is written: an interrupt
        there keeps it)."""
        try:
            record = body()
        except Exception as error:  # a failure is data: the other ops go on
            record = {"error": f"{type(error).__name__}: {error}"[:300]}
        if fmt is None:
            result[op] = record
        else:
            result[op][fmt] = record
        print(f"[{model}] {op}{' ' + fmt if fmt else ''}: {_line(record)}", file=sys.stderr)
        on_point({"kind": "op", "model": model, "op": op, "format": fmt, **record})

    offloaded = {}

    def offload():
        def call(s):
            return alloc.offload(s, ids, donate=True)

        nbytes = int(alloc.ledger(base).charged_blocks[TENANT, 0]) * config.pool_bytes[0]
        (state, rep), seconds, same = time_op(call, base, nbytes, "to_host", repeats)
        alloc.check(state)
        offloaded["state"] = state
        record = move_record(config, rep, ledger_delta(alloc, base, state), 0, config.host_pool)
        return {**record, "checked": True, "reports_consistent": same, **_timing(seconds)}

    def restore():
        if "state" not in offloaded:
            raise RuntimeError("no offloaded state to restore (offload failed)")
        src = offloaded["state"]
        def call(s):
            return alloc.restore(s, ids, donate=True)

        nbytes = int(alloc.ledger(src).charged_blocks[TENANT, config.host_pool]) \
            * config.pool_bytes[config.host_pool]
        (state, rep), seconds, same = time_op(call, src, nbytes, "to_device", repeats)
        alloc.check(state)
        record = move_record(config, rep, ledger_delta(alloc, src, state), config.host_pool, 0)
        return {**record, "checked": True, "reports_consistent": same, **_timing(seconds)}

    def compress(fmt):
        pool = 1 + opts["formats"].index(fmt)
        def call(s):
            return alloc.compress(s, ids, kv_format=fmt, keep_recent=opts["keep_recent"],
                                  donate=True)

        expected = expected_compressed(opts, kq.get_kv_format(fmt))
        nbytes = expected * config.pool_bytes[0]
        (state, rep), seconds, same = time_op(call, base, nbytes, None, repeats)
        alloc.check(state)
        record = compress_record(config, rep, ledger_delta(alloc, base, state), pool)
        record["blocks_as_expected"] = rep.blocks_compressed == expected
        return {**record, "checked": True, "reports_consistent": same, **_timing(seconds)}

    def evict(mode):
        keep = opts["seq_tokens"] // 2  # StreamingLLM: 4 sinks and the newest tokens

        def call(s):
            return alloc.evict(s, ids, policy="streamingllm", keep_tokens=keep, mode=mode,
                               donate=True)

        nbytes = int(alloc.ledger(base).charged_blocks[TENANT, 0]) * config.pool_bytes[0]
        (state, rep), seconds, same = time_op(call, base, nbytes, None, repeats)
        alloc.check(state)
        delta = ledger_delta(alloc, base, state)
        pb0 = config.pool_bytes[0]
        record = {"evicted_tokens": int(np.asarray(rep.evicted_tokens).sum()),
                  "copied_blocks": int(np.asarray(rep.copied_blocks).sum()),
                  "pool_bytes_returned": rep.pool_bytes_returned,
                  "device_bytes_returned": rep.pool_bytes_returned,
                  "bytes_match_ledger": (delta["free_blocks"][0] * pb0 == rep.pool_bytes_returned
                                         == -delta["charged_blocks"][0] * pb0),
                  "ledger": {f"{k}_delta": v for k, v in delta.items()}}
        return {**record, "checked": True, "reports_consistent": same, **_timing(seconds)}

    attempt("offload", None, offload)
    attempt("restore", None, restore)
    offloaded.clear()
    for fmt in opts["formats"]:
        attempt("compress", fmt, lambda f=fmt: compress(f))
    for mode in ("token", "block"):
        attempt("evict", mode, lambda m=mode: evict(m))
    return result


def expected_compressed(opts, fmt) -> int:
    """Blocks compress should take: per sequence, the full blocks wholly before the last
    keep_recent tokens, in whole key groups of the format (KIVI: G / block_size blocks)."""
    p = opts["block_size"]
    group = fmt.key.pages_per_group(p) if fmt.quantized else 1
    cold = max(0, (opts["seq_tokens"] - opts["keep_recent"]) // p)
    return opts["seqs"] * (cold // group * group)


def _line(record: dict) -> str:
    if "error" in record:
        return f"failed: {record['error']}"
    host = record.get("ratio_vs_host_copy")
    return (f"{record['seconds'] * 1e3:.2f} ms, x{record['ratio_vs_device_copy']:.2f} of a device "
            f"copy{f', x{host:.2f} of a host copy' if host is not None else ''}; "
            f"{record['device_bytes_returned'] / MiB:+.2f} MiB of device returned; ledger "
            f"{'matches' if record['bytes_match_ledger'] else 'DIFFERS'}")


def _records(result: dict):
    for model, per in result["models"].items():
        for op in ("offload", "restore"):
            if per.get(op) is not None:
                yield model, op, None, per[op]
        for op in ("compress", "evict"):
            for fmt, record in per.get(op, {}).items():
                yield model, op, fmt, record


def run(opts: dict, on_point=lambda point: None) -> dict:
    result = {"models": {}, "partial": False}
    try:
        for model in opts["models"]:
            per = result["models"][model] = {}
            try:
                run_model(model, opts, on_point, per)
            except Exception as error:  # setup failed (out of memory, ...): the next model goes on
                per["error"] = f"{type(error).__name__}: {error}"[:300]
                on_point({"kind": "setup", "model": model, "error": per["error"]})
                print(f"[{model}] setup failed: {per['error']}", file=sys.stderr)
    except KeyboardInterrupt:
        result.update(partial=True)
        cli.note("interrupted: writing what was measured, marked partial")
    records = [r for *_, r in _records(result)]
    result["failed_ops"] = [f"{m} setup" for m, per in result["models"].items()
                            if "error" in per]
    result["failed_ops"] += [f"{m} {op}{' ' + f if f else ''}" for m, op, f, r in _records(result)
                             if "error" in r]
    result["all_bytes_match_ledger"] = bool(records) and all(
        r.get("bytes_match_ledger") for r in records)
    result["all_checked"] = bool(records) and all(r.get("checked") for r in records)
    result["timing"] = (
        "median over repeats of one facade call with donate=True, each on a fresh copy of its "
        "input state (copy untimed; one untimed call compiles first); a plain jitted device "
        "copy (jnp.copy) and a device<->pinned_host jax.device_put of the same bytes are timed "
        f"{BASELINE_CALLS} times each in the same loop right after each call; ratios are op "
        "time / plain copy time, of the medians")
    return result


# ---- drawn from the run's files -----------------------------------------------------------------


def plot(points, metrics, out_dir) -> list[str]:
    """tiers.png: each op's time over a plain device copy of its bytes (left) and the device
    bytes it returned (right), per model, from the run's points."""
    import matplotlib.pyplot as plt

    ops = [p for p in points if p.get("kind") == "op" and "error" not in p]
    if not ops:
        return []
    models = list(dict.fromkeys(p["model"] for p in ops))
    labels = list(dict.fromkeys(p["op"] + (f" {p['format']}" if p.get("format") else "")
                                for p in ops))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(models)
    for i, model in enumerate(models):
        rows = {p["op"] + (f" {p['format']}" if p.get("format") else ""): p
                for p in ops if p["model"] == model}
        x = np.arange(len(labels)) + i * width
        left.bar(x, [rows[k]["ratio_vs_device_copy"] if k in rows else 0 for k in labels],
                 width, label=model)
        right.bar(x, [rows[k]["device_bytes_returned"] / MiB if k in rows else 0
                      for k in labels], width, label=model)
    for ax in (left, right):
        ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, rotation=30, ha="right")
        ax.legend(fontsize=8)
    left.axhline(1.0, color="0.5", lw=0.8)
    left.set_ylabel("op time / device copy of the same bytes")
    right.axhline(0.0, color="0.5", lw=0.8)
    right.set_ylabel("MiB of device memory returned (restore: taken)")
    left.set_title("tier op time, relative")
    right.set_title("bytes returned (reports = ledger)" if metrics.get("all_bytes_match_ledger")
                    else "bytes returned")
    fig.tight_layout()
    fig.savefig(out_dir / "tiers.png", dpi=120)
    plt.close(fig)
    return ["tiers.png"]


def describe(summary: dict) -> str:
    lines = [f"{model} setup failed: {per['error']}"
             for model, per in summary.get("models", {}).items() if "error" in per]
    lines += [f"{model} {op}{' ' + fmt if fmt else ''}: {_line(record)}"
              for model, op, fmt, record in _records(summary)]
    if summary.get("partial"):
        lines.append("PARTIAL: interrupted")
    return "\n".join(lines)


def main(argv):
    del argv
    opts = {"models": list(dict.fromkeys(FLAGS.models)), "formats": list(FLAGS.formats),
            "seqs": FLAGS.seqs, "seq_tokens": FLAGS.seq_tokens, "block_size": FLAGS.block_size,
            "keep_recent": FLAGS.keep_recent, "repeats": FLAGS.repeats,
            "scrub_on_free": FLAGS.scrub_on_free, "seed": FLAGS.seed}
    for model in opts["models"]:
        cfg = kq.get_model_config(model)
        if opts["seq_tokens"] > cfg.max_context:
            raise cli.BadInput(f"--seq_tokens={opts['seq_tokens']} exceeds {model}'s context of "
                               f"{cfg.max_context}")
        config = make_config(model, seqs=opts["seqs"], seq_tokens=opts["seq_tokens"],
                             block_size=opts["block_size"], formats=opts["formats"])
        mib = page_bytes(config) / MiB
        if mib > FLAGS.max_state_mib:
            raise cli.BadInput(f"{model}: {opts['seqs']} x {opts['seq_tokens']} tokens need "
                               f"{mib:.0f} MiB of pages over all pools, over --max_state_mib="
                               f"{FLAGS.max_state_mib}: lower --seqs or --seq_tokens")
    for fmt in opts["formats"]:
        if expected_compressed(opts, kq.get_kv_format(fmt)) == 0:
            raise cli.BadInput(f"--keep_recent={opts['keep_recent']} leaves no full block of "
                               f"--seq_tokens={opts['seq_tokens']} to compress into {fmt} (in "
                               "whole key groups for KIVI)")
    measured = {}

    def measure(add_point):
        measured.update(run(opts, add_point))
        return measured

    runs.execute("bench_tiers", opts, measure, seed=opts["seed"], plot=plot, describe=describe)
    if measured.get("partial"):
        sys.exit(130)  # interrupted: the partial summary is written and printed


if __name__ == "__main__":
    cli.run(main, define_flags)
