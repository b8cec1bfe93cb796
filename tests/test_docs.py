"""docs/build.py's reference check: it finds a missing file, a missing heading and an API name
that does not resolve, and passes good ones (`make docs` runs it over the real documentation)."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def test_broken_references_are_found_and_good_ones_pass(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The small real case (`x_y-1`)\n")
    good = tmp_path / "good.md"
    good.write_text("[o](other.md) [h](other.md#the-small-real-case-x_y-1) [w](https://x.org)\n"
                    "`kq.Allocator.plan_reclaim` and `kvquota.reclaim.plan.ReclaimPlan`\n"
                    "```python\n[not checked](inside-code.md) `kq.Nothing`\n```\n")
    assert build.broken_references([good]) == []
    bad = tmp_path / "bad.md"
    bad.write_text("intro\n[gone](missing.md) [h](other.md#no-such-heading)\n"
                   "`kq.Allocator.no_such_method` ![plot](nowhere.png)\n")
    problems = build.broken_references([bad])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "link to a missing file: missing.md", "link to a missing heading: "
        "other.md#no-such-heading", "link to a missing file: nowhere.png",
        "`kq.Allocator.no_such_method` does not resolve"]
    assert all(p.startswith(f"{bad}:") for p in problems)
