r"""KV-cache memory accounting for a model preset and a KV format.

  python -m experiments.accounting --model=qwen2.5-7b --batch=32 --seq_len=32768 --json

prints one JSON object (other tools read it); without --json a readable table, plus, for the
presets DESIGN.md §1 item 1 quotes (Qwen2.5-7B and -72B), those figures recomputed.

A --seq_len beyond the preset's native context is answered (long-context variants reach further:
Qwen2.5 reaches 128K with YaRN), with a one-line note on stderr.
"""

from __future__ import annotations

import json

from absl import flags

import kvquota as kq
from experiments import cli

FLAGS = flags.FLAGS
GB, GIB = 10**9, 2**30
# Bounds that keep every figure meaningful: 2^16 sequences of 2^24 tokens (16M, 128 times
# Qwen2.5's 128K) are 2^40 tokens, under 2^60 bytes (1 EiB) at the largest preset in f32.
MAX_BATCH, MAX_SEQ_LEN = 2**16, 2**24


def define_flags():
    cli.define_model(default="qwen2.5-7b")
    flags.DEFINE_integer("batch", 32, "Sequences in the tenant's batch, at most 2^16: with "
                         "--seq_len's bound, every total stays under 2^60 bytes.", lower_bound=1,
                         upper_bound=MAX_BATCH)
    flags.DEFINE_integer("seq_len", 32768, "Tokens per sequence, at most 2^24 (128 times "
                         "Qwen2.5's 128K).", lower_bound=1, upper_bound=MAX_SEQ_LEN)
    flags.DEFINE_integer("block_size", 16, "Tokens per KV block (page), at most 2^24.",
                         lower_bound=1, upper_bound=MAX_SEQ_LEN)
    cli.define_kv_format("bf16")
    cli.define_json("Print one JSON object instead of a table.")


def accounting(
    model: str, batch: int, seq_len: int, block_size: int = 16, kv_format: str = "bf16"
) -> dict:
    """The accounting record for one configuration; raises ValueError on bad input."""
    layout = kq.KVLayout(kq.get_model_config(model), kq.get_kv_format(kv_format), block_size)
    footprint = kq.tenant_footprint(layout, batch, seq_len)
    return {
        "model": model,
        "kv_format": kv_format,
        "block_size": block_size,
        "batch": batch,
        "seq_len": seq_len,
        "bytes_per_token": layout.bytes_per_token,
        "bytes_per_layer_token": layout.bytes_per_layer_token,
        "bytes_per_block": layout.bytes_per_block,
        "bytes_per_sequence": layout.sequence_bytes(seq_len),
        "blocks": footprint.blocks,
        "total_bytes": footprint.token_bytes,
        "total_block_bytes": footprint.block_bytes,
        "weight_bytes": layout.model.weight_bytes(2),
        "kv_to_weight_ratio": footprint.token_bytes / layout.model.weight_bytes(2),
    }


def design_figures(model: str) -> list[dict]:
    """The figures DESIGN.md §1 item 1 quotes for `model` (none for other presets), recomputed
    at bf16 with blocks of 16; `holds` says whether the quote is right."""
    if model == "qwen2.5-7b":
        r = accounting("qwen2.5-7b", batch=32, seq_len=32768)
        return [
            {"claim": "Qwen2.5-7B KV = 57,344 B/token (56 KiB)",
             "computed": f"{r['bytes_per_token']:,} B/token",
             "holds": r["bytes_per_token"] == 57344},
            {"claim": "batch 32 x 32,768 tokens = 60.1 GB",
             "computed": f"{r['total_bytes']:,} B",
             "holds": round(r["total_bytes"] / GB, 1) == 60.1},
            {"claim": "about four times the ~15 GB of weights",
             "computed": f"weights {r['weight_bytes'] / GB:.1f} GB, "
                         f"ratio {r['kv_to_weight_ratio']:.2f}",
             "holds": round(r["weight_bytes"] / GB) == 15 and round(r["kv_to_weight_ratio"]) == 4},
        ]
    if model == "qwen2.5-72b":
        r32 = accounting("qwen2.5-72b", batch=4, seq_len=32768)
        r128 = accounting("qwen2.5-72b", batch=4, seq_len=131072)
        return [
            {"claim": "Qwen2.5-72B KV = 327,680 B/token (320 KiB)",
             "computed": f"{r32['bytes_per_token']:,} B/token",
             "holds": r32["bytes_per_token"] == 327680},
            {"claim": "four sequences of 32K use 42.9 GB",
             "computed": f"{r32['total_bytes']:,} B",
             "holds": round(r32["total_bytes"] / GB, 1) == 42.9},
            {"claim": "'160 GB for four' is four sequences of 128K",
             "computed": f"4 x 131,072 tokens = {r128['total_bytes']:,} B "
                         f"= {r128['total_bytes'] / GIB:g} GiB",
             "holds": r128["total_bytes"] == 160 * GIB},
        ]
    return []


def format_table(record: dict) -> str:
    """A readable rendering of `accounting()`, plus the design's figures where they apply."""
    rows = [(key, f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"
             if isinstance(value, float) else str(value)) for key, value in record.items()]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    figures = design_figures(record["model"])
    if figures:
        lines += ["", f"design figures for {record['model']} (DESIGN.md §1 item 1; bf16, "
                      "blocks of 16):"]
        for figure in figures:
            mark = "ok   " if figure["holds"] else "WRONG"
            lines.append(f"  [{mark}] {figure['claim']}: {figure['computed']}")
    return "\n".join(lines)


def main(argv):
    del argv
    config = kq.get_model_config(FLAGS.model)
    if FLAGS.seq_len > config.max_context:
        cli.note(f"--seq_len={FLAGS.seq_len:,} is beyond {config.name}'s native context of "
                 f"{config.max_context:,} tokens (long-context variants reach further, e.g. "
                 "Qwen2.5 with YaRN to 128K); the bytes are computed all the same")
    record = accounting(FLAGS.model, FLAGS.batch, FLAGS.seq_len, FLAGS.block_size,
                        FLAGS.kv_format)
    print(json.dumps(record) if FLAGS.json else format_table(record))


if __name__ == "__main__":
    cli.run(main, define_flags)
