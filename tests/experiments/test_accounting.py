"""Accounting library and CLI: the design's figures exactly, and the error paths."""

import json
import subprocess
import sys

import pytest

import kvquota as kq
from experiments.accounting import (MAX_BATCH, MAX_SEQ_LEN, accounting, design_figures,
                                    format_table)


def test_qwen7b_design_figures():
    record = accounting("qwen2.5-7b", batch=32, seq_len=32768)
    # 2 (K,V) x 28 layers x 4 KV heads x 128 dims x 2 bytes = 57,344.
    assert record["bytes_per_token"] == 57344
    assert record["bytes_per_block"] == 57344 * 16
    assert record["total_bytes"] == 57344 * 32 * 32768 == 60_129_542_144
    assert record["total_block_bytes"] == 60_129_542_144  # 32768 is a multiple of 16
    assert record["weight_bytes"] == 2 * kq.get_model_config("qwen2.5-7b").param_count


def test_qwen72b_design_figures():
    record = accounting("qwen2.5-72b", batch=4, seq_len=32768)
    # 2 x 80 layers x 8 KV heads x 128 x 2 bytes = 327,680.
    assert record["bytes_per_token"] == 327680
    assert record["total_bytes"] == 42_949_672_960
    # 160 GiB is four sequences of 128K, not 32K.
    assert accounting("qwen2.5-72b", batch=4, seq_len=131072)["total_bytes"] == 160 * 2**30


@pytest.mark.parametrize("model, quoted", [("qwen2.5-7b", 3), ("qwen2.5-72b", 3),
                                           ("smollm2-135m", 0), ("qwen2.5-0.5b", 0)])
def test_design_figures_shown_only_where_they_apply_and_all_hold(model, quoted):
    figures = design_figures(model)
    assert len(figures) == quoted
    assert all(figure["holds"] for figure in figures)
    table = format_table(accounting(model, batch=1, seq_len=16))
    assert "[WRONG]" not in table
    assert ("design figures" in table) == bool(quoted)


@pytest.mark.parametrize("model", sorted(kq.MODELS))
@pytest.mark.parametrize("fmt", sorted(kq.KV_FORMATS))
def test_every_preset_and_format_by_hand(model, fmt):
    cfg, kv = kq.get_model_config(model), kq.get_kv_format(fmt)
    layout = kq.KVLayout(cfg, kv, block_size=16)
    per_head_block = kv.head_block_bytes(16, cfg.head_dim)
    assert layout.bytes_per_block == per_head_block * cfg.num_kv_heads * cfg.num_layers
    assert layout.bytes_per_token * 16 == layout.bytes_per_block
    if not kv.quantized:
        assert layout.bytes_per_token == (
            2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv.element_bytes
        )


def test_whole_blocks_versus_tokens():
    layout = kq.KVLayout(kq.get_model_config("smollm2-135m"), kq.get_kv_format("bf16"),
                         block_size=16)
    # SmolLM2: 2 x 30 x 3 x 64 x 2 = 23,040 B/token; 17 tokens take 2 blocks = 32 token slots.
    assert layout.bytes_per_token == 23040
    footprint = kq.tenant_footprint(layout, batch=3, seq_len=17)
    assert footprint.blocks == 6
    assert footprint.token_bytes == 3 * 17 * 23040
    assert footprint.block_bytes == 6 * 16 * 23040


@pytest.mark.parametrize("field", ["batch", "seq_len", "block_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes_are_refused(field, value):
    kwargs = dict(model="qwen2.5-7b", batch=1, seq_len=1, block_size=16)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        accounting(**kwargs)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.accounting", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_cli_json_contract():
    result = _cli("--model=qwen2.5-7b", "--batch=32", "--seq_len=32768", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["model"] == "qwen2.5-7b" and record["kv_format"] == "bf16"
    assert record["block_size"] == 16
    assert record["bytes_per_token"] == 57344
    assert record["total_bytes"] == 60_129_542_144
    assert record["total_block_bytes"] == 60_129_542_144
    assert record["weight_bytes"] == 15_231_233_024
    assert result.stderr == ""  # no jax platform-probing line, no note


def test_cli_table_beyond_native_context_notes_and_answers():
    # Qwen2.5-72B with YaRN reaches 128K: a note, not an error.
    result = _cli("--model=qwen2.5-72b", "--batch=4", "--seq_len=131072")
    assert result.returncode == 0, result.stderr
    assert "171,798,691,840" in result.stdout and "[ok   ]" in result.stdout
    assert "[WRONG]" not in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("note:") and "32,768" in lines[0]


def test_cli_refuses_sizes_beyond_its_stated_bounds():
    """--batch=99999999999999999999 printed 1.9e29 bytes: --batch and --seq_len are bounded
    (2^16, 2^24; --help says so), and at the bounds every total is exact and under 2^60 B."""
    assert (MAX_BATCH, MAX_SEQ_LEN) == (2**16, 2**24)
    help_text = " ".join(_cli("--help").stdout.split())
    assert "at most 2^16" in help_text and "(an integer in the range [1, 65536])" in help_text
    assert "at most 2^24" in help_text and "(an integer in the range [1, 16777216])" in help_text
    for flag, value, bound in (("batch", 99999999999999999999, MAX_BATCH),
                               ("seq_len", MAX_SEQ_LEN + 1, MAX_SEQ_LEN),
                               ("block_size", MAX_SEQ_LEN + 1, MAX_SEQ_LEN)):
        result = _cli(f"--{flag}={value}")
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and result.stdout == "" and len(lines) == 1, lines
        assert lines[0] == (f"error: flag --{flag}={value}: {value} is not an integer in the "
                            f"range [1, {bound}]")
    record = accounting("qwen2.5-72b", MAX_BATCH, MAX_SEQ_LEN, kv_format="f32")
    assert record["total_bytes"] == 655360 * 2**40 < 2**60
