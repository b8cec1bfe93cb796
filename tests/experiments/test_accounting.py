"""Accounting library and CLI: the source figures exactly, and the error paths."""

import json
import subprocess
import sys

import pytest

from configs.models import MODELS, get_model_config
from experiments.accounting import accounting, source_figures
from kvquota.accounting import KVLayout, tenant_footprint
from configs.formats import KV_FORMATS, get_kv_format


def test_qwen7b_source_figures():
    record = accounting("qwen2.5-7b", batch=32, seq_len=32768)
    # 2 (K,V) x 28 layers x 4 KV heads x 128 dims x 2 bytes = 57,344.
    assert record["bytes_per_token"] == 57344
    assert record["bytes_per_block"] == 57344 * 16
    assert record["total_bytes"] == 57344 * 32 * 32768 == 60_129_542_144
    assert record["total_block_bytes"] == 60_129_542_144  # 32768 is a multiple of 16
    assert record["weight_bytes"] == 2 * get_model_config("qwen2.5-7b").param_count


def test_qwen72b_source_figures():
    record = accounting("qwen2.5-72b", batch=4, seq_len=32768)
    # 2 x 80 layers x 8 KV heads x 128 x 2 bytes = 327,680.
    assert record["bytes_per_token"] == 327680
    assert record["total_bytes"] == 42_949_672_960
    # 160 GiB is four sequences of 128K, not 32K.
    assert accounting("qwen2.5-72b", batch=4, seq_len=131072)["total_bytes"] == 160 * 2**30


def test_source_figure_check_flags_only_the_wrong_quote():
    verdicts = [figure["holds"] for figure in source_figures()]
    assert verdicts == [True, True, True, True, True, False]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("fmt", sorted(KV_FORMATS))
def test_every_preset_and_format_by_hand(model, fmt):
    cfg, kv = get_model_config(model), get_kv_format(fmt)
    layout = KVLayout(cfg, kv, block_size=16)
    per_head_block = kv.head_block_bytes(16, cfg.head_dim)
    assert layout.bytes_per_block == per_head_block * cfg.num_kv_heads * cfg.num_layers
    assert layout.bytes_per_token * 16 == layout.bytes_per_block
    if not kv.quantized:
        assert layout.bytes_per_token == (
            2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv.element_bytes
        )


def test_whole_blocks_versus_tokens():
    layout = KVLayout(get_model_config("smollm2-135m"), get_kv_format("bf16"), block_size=16)
    # SmolLM2: 2 x 30 x 3 x 64 x 2 = 23,040 B/token; 17 tokens take 2 blocks = 32 token slots.
    assert layout.bytes_per_token == 23040
    footprint = tenant_footprint(layout, batch=3, seq_len=17)
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


def test_cli_table_shows_source_figures():
    result = _cli("--model=qwen2.5-72b", "--batch=4", "--seq_len=32768")
    assert result.returncode == 0, result.stderr
    assert "42,949,672,960" in result.stdout
    assert "171,798,691,840" in result.stdout and "[WRONG]" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model=gpt-5"], "valid choices: qwen2.5-0.5b"),
        (["--kv_format=int3"], "valid choices: f32, bf16"),
        (["--batch=0"], "batch must be a positive integer"),
        (["--seq_len=-5"], "seq_len must be a positive integer"),
        (["--block_size=0"], "block_size must be a positive integer"),
    ],
)
def test_cli_errors_exit_non_zero(args, message):
    result = _cli(*args, "--json")
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""
