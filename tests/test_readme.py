"""The README's state-API example runs as written and prints what its comment says."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_state_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md", "exec"), {})
    printed = out.getvalue()
    # 40 tokens of Qwen2.5-7B in bf16 = 3 blocks of 16 x 57,344 B, charged to tenant 0.
    assert "['ok']" in printed
    assert "'used_tokens': 40" in printed and "'charged_bytes': 2752512" in printed


def test_readme_reclaim_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "README has no reclaim example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[1], "README.md", "exec"), {})
    printed = out.getvalue()
    # 60 + 40 tokens in blocks of 16 x 57,344 B: 7 blocks charged, the cut to 2 asks for 5.
    assert "target 4,587,520 B" in printed and "shortfall 0 B" in printed
    assert "1. offload_idle     seqs [1]: 3 blocks" in printed
    assert "seq 0 (tenant 0, 60 tokens): suspended, prefetch 3,670,016 B" in printed
