r"""KV-cache memory accounting for a model preset and a KV format.

  python -m experiments.accounting --model=qwen2.5-7b --batch=32 --seq_len=32768 --json

prints one JSON object (other tools read it); without --json a readable table plus a check of
the figures quoted in the design's source material.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from configs.models import get_model_config
from kvquota import KVLayout, tenant_footprint
from configs.formats import get_kv_format

FLAGS = flags.FLAGS


def _define_flags():
    """Defined only when run as a program, so tests can import this module beside other
    experiments whose flags share names (absl forbids defining a flag twice)."""
    flags.DEFINE_string("model", "qwen2.5-7b", "Model preset name.")
    flags.DEFINE_integer("batch", 32, "Sequences in the tenant's batch.")
    flags.DEFINE_integer("seq_len", 32768, "Tokens per sequence.")
    flags.DEFINE_integer("block_size", 16, "Tokens per KV block (page).")
    flags.DEFINE_string("kv_format", "bf16", "KV storage format.")
    flags.DEFINE_boolean("json", False, "Print one JSON object instead of a table.")


def accounting(
    model: str, batch: int, seq_len: int, block_size: int = 16, kv_format: str = "bf16"
) -> dict:
    """The accounting record for one configuration; raises ValueError on bad input."""
    layout = KVLayout(get_model_config(model), get_kv_format(kv_format), block_size)
    footprint = tenant_footprint(layout, batch, seq_len)
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


def source_figures() -> list[dict]:
    """Each figure quoted in DESIGN.md §1.1, recomputed; `holds` says whether the quote is right."""
    qwen7 = accounting("qwen2.5-7b", batch=32, seq_len=32768)
    qwen72_32k = accounting("qwen2.5-72b", batch=4, seq_len=32768)
    qwen72_128k = accounting("qwen2.5-72b", batch=4, seq_len=131072)
    gib = 2**30
    return [
        {"claim": "Qwen2.5-7B KV = 57,344 B/token (56 KiB)",
         "computed": f"{qwen7['bytes_per_token']:,} B/token",
         "holds": qwen7["bytes_per_token"] == 57344},
        {"claim": "Qwen2.5-7B batch 32 x 32,768 tokens = 60.1 GB",
         "computed": f"{qwen7['total_bytes']:,} B",
         "holds": round(qwen7["total_bytes"] / 1e9, 1) == 60.1},
        {"claim": "... about four times the ~15.2 GB of bf16 weights",
         "computed": f"weights {qwen7['weight_bytes'] / 1e9:.1f} GB, "
                     f"ratio {qwen7['kv_to_weight_ratio']:.2f}",
         "holds": round(qwen7["kv_to_weight_ratio"]) == 4},
        {"claim": "Qwen2.5-72B KV = 327,680 B/token (320 KiB)",
         "computed": f"{qwen72_32k['bytes_per_token']:,} B/token",
         "holds": qwen72_32k["bytes_per_token"] == 327680},
        {"claim": "Qwen2.5-72B four sequences of 32K = 42.9 GB",
         "computed": f"{qwen72_32k['total_bytes']:,} B",
         "holds": round(qwen72_32k["total_bytes"] / 1e9, 1) == 42.9},
        {"claim": "Qwen2.5-72B 'four sequences at 32K eat 160 GB'",
         "computed": f"4 x 32K = {qwen72_32k['total_bytes'] / gib:.0f} GiB; 160 GiB is 4 x "
                     f"131,072 tokens = {qwen72_128k['total_bytes']:,} B",
         "holds": qwen72_32k["total_bytes"] == 160 * gib},
    ]


def format_table(record: dict) -> str:
    """A readable rendering of `accounting()` plus the source-figure check."""
    rows = [(key, f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"
             if isinstance(value, float) else str(value)) for key, value in record.items()]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    lines += ["", "source figures (DESIGN.md §1.1):"]
    for figure in source_figures():
        mark = "ok   " if figure["holds"] else "WRONG"
        lines.append(f"  [{mark}] {figure['claim']}: {figure['computed']}")
    return "\n".join(lines)


def main(argv):
    del argv
    try:
        record = accounting(
            FLAGS.model, FLAGS.batch, FLAGS.seq_len, FLAGS.block_size, FLAGS.kv_format
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(record) if FLAGS.json else format_table(record))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
