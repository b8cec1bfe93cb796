"""bench_prefix: admission through the prefix index beside the brute-force lookup. A tiny run
through the CLI (its JSON contract, identical results both ways, the system-prompt hits counted
independently here, its run directory and plots), and bad invocations refused in one line before
any work."""

import json

import pytest

from experiments import bench_prefix as bp
from experiments import cli, runs
from tests.experiments.common import run_cli

TINY = dict(log2_blocks=12, prompts=48, brute_prompts=16, batch=8, prompt_tokens=256,
            system_tokens=64, scaling=[11, 12], scaling_prompts=16)


def _expected_hit_blocks(prompts, batch, system_tokens):
    """A prompt hits its system prompt's blocks when an earlier call admitted that system
    prompt (prompts of one call never hit each other); nothing else is shared."""
    seen, hits = set(), 0
    for start in range(0, prompts, batch):
        keys = [((i % bp.TENANTS) // bp.GROUP_SIZE, (i // bp.TENANTS) % bp.SYSTEMS_PER_GROUP)
                for i in range(start, min(start + batch, prompts))]
        hits += sum(k in seen for k in keys) * (system_tokens // bp.BLOCK_SIZE)
        seen.update(keys)
    return hits


@pytest.mark.slow  # ~15 s: the CLI at tiny sizes (the default run's budget, issue #13)
def test_tiny_run_contract_and_results_match(tmp_path):
    args = [f"--{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in TINY.items()]
    out = tmp_path / "results" / "bench_prefix.json"
    result = run_cli("bench_prefix", *args, "--json", f"--runs_dir={tmp_path / 'runs'}",
                     f"--out={out}")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert json.loads(out.read_text()) == summary
    for key in ("blocks", "index", "brute_force", "ratio", "ratio_same_prompts", "results_match",
                "scaling", "scaling_max_over_min", "timing", "setup", "command", "versions",
                "device", "seed", "git_commit", "config", "run_dir"):
        assert key in summary, key
    assert summary["command"].startswith("python -m experiments.bench_prefix --log2_blocks=12")
    assert summary["blocks"] == 1 << 12 and summary["results_match"] is True
    idx, brute = summary["index"], summary["brute_force"]
    assert idx["calls"] == 6 and idx["admitted"] == 48 and brute["calls"] == 2
    assert idx["hit_blocks"] == _expected_hit_blocks(48, 8, 64) > 0
    assert summary["ratio"] > 0 and idx["ms_per_prompt_median"] > 0
    assert [p["blocks"] for p in summary["scaling"]] == [1 << 11, 1 << 12]
    assert all(p["hashed_blocks_before"] > 0 for p in summary["scaling"])
    points = runs.read_points(summary["run_dir"])
    assert sorted({p["kind"] for p in points}) == ["brute_force", "index", "scaling"]
    assert runs.replot(summary["run_dir"]) == ["admit_calls.png", "scaling.png"]


@pytest.mark.parametrize("sizes, message", [
    (dict(TINY, brute_prompts=64), "exceeds --prompts"),
    (dict(TINY, prompt_tokens=250), "multiple of the block size"),
    (dict(TINY, system_tokens=256), "must be below --prompt_tokens"),
    (dict(TINY, prompts=4096), r"half-full pool of 2\^12 blocks"),
    (dict(TINY, prompt_tokens=64, system_tokens=16), "below 80: a prompt needs more than 4"),
])
def test_sizes_that_do_not_fit_are_refused_before_any_work(sizes, message):
    with pytest.raises(cli.BadInput, match=message):
        bp.check_sizes(**sizes)


def test_bad_invocations_fail_in_one_line():
    for args, message in ((["stray"], "unexpected positional argument"),
                          (["--prompts=8", "--brute_prompts=16"], "exceeds --prompts")):
        result = run_cli("bench_prefix", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().count("\n") == 0 and message in result.stderr


def test_prompt_tokens_help_states_the_rule_the_cli_enforces():
    """--help said "integer >= 16" while 64 failed with "needs more than 4 blocks": the help and
    the flag's bound now state the real rule (a multiple of 16, at least 80, above
    --system_tokens), and a value within the bound that breaks it is refused in one line."""
    assert bp.MIN_PROMPT_TOKENS == 80
    help_text = " ".join(run_cli("bench_prefix", "--help").stdout.split())
    assert ("Tokens per prompt: a multiple of the block size 16, at least 80 (more than the "
            "built state's 4-block prefix) and above --system_tokens. (default: '2048') "
            "(integer >= 80)") in help_text
    for args, message in ((["--prompt_tokens=64"], "--prompt_tokens=64: 64 is not integer >= 80"),
                          (["--prompt_tokens=88"], "not a multiple of the block size 16"),
                          (["--prompt_tokens=96", "--system_tokens=96"],
                           "--system_tokens=96 must be below --prompt_tokens=96")):
        result = run_cli("bench_prefix", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
