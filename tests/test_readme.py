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
