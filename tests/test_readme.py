"""Every ```python block of the README runs as written and prints what the README says it does;
the other blocks are fenced `console` (commands) or `text` (output), and the README stays short."""

import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)


def python_blocks() -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == "python"]


def run_here(block: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    return out.getvalue()


def check_state_api(block):
    printed = run_here(block)
    # 40 tokens of Qwen2.5-7B in bf16 = 3 blocks of 16 x 57,344 B, charged to tenant 0.
    assert "['ok']" in printed
    assert "'used_tokens': 40" in printed and "'charged_bytes': 2752512" in printed


def check_reclaim_plan(block):
    printed = run_here(block)
    # The README prints the plan below the example; it must be what the example prints.
    shown = README.read_text().split(block, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    assert printed.strip() == shown.strip()
    # 60 + 40 tokens in blocks of 16 x 57,344 B: 7 blocks charged, the cut to 2 asks for 5.
    assert "target 4,587,520 B" in printed and "shortfall 0 B" in printed


def check_sharding(block):
    """In a fresh Python, as a user runs it: the block forces 8 CPU devices before jax starts,
    which this process (jax already started, one device) cannot."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[4, 4]"


CHECKS = {"state API": check_state_api, "reclaim plan": check_reclaim_plan,
          "sharding": check_sharding}


def test_every_python_block_runs():
    blocks = python_blocks()
    ran = []
    for block, (name, check) in zip(blocks, CHECKS.items()):
        check(block)
        ran.append(name)
    assert len(ran) == len(blocks), f"the README has {len(blocks)} python blocks, ran {ran}"


def test_fences_and_length():
    langs = [lang for lang, _ in FENCE.findall(README.read_text())]
    assert set(langs) <= {"python", "console", "text"}, langs
    assert len(README.read_text().split()) <= 1800  # `wc -w`
