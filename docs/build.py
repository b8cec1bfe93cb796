"""Builds the API reference and checks every reference in the documentation (`make docs`).

    python docs/build.py [--out=docs/api] [--check_only]

1. The API reference: pdoc renders the docstrings of the public packages (`kvquota`, its
   subpackages, `kernels`, `configs`) to HTML under --out (docs/api/index.html). A module pdoc
   cannot import, or any other warning pdoc gives, fails the build.
2. The references: in README.md, CHANGELOG.md, docs/*.md and every results/**/README.md,
   each relative Markdown link must name a file or directory that exists (and, for a `.md`
   target with `#anchor`, a heading of it), and each code reference to the API written
   `kq.Name.attr` or `kvquota.module.Name` in backticks must resolve by import. Broken
   references are listed, one a line, and the build exits 1.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import sys
import warnings

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = ("kvquota", "kernels", "configs")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_REF = re.compile(r"`((?:kq|kvquota)\.[A-Za-z_][\w.]*)`")

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined only when this file runs as a program (tests import it beside other programs)."""
    flags.DEFINE_string("out", str(ROOT / "docs" / "api"), "Where the API reference is written.")
    flags.DEFINE_boolean("check_only", False, "Check the references only (no pdoc).")


def documents(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The Markdown files whose references are checked."""
    found = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "results").glob("**/README.md"))]
    return [p for p in found if p.exists()]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def resolves(name: str) -> bool:
    """Does `kq.X.y` / `kvquota.module.X` name something importable?"""
    parts = ["kvquota", *name.split(".")[1:]]
    for i in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def broken_references(paths) -> list[str]:
    """Every broken link or code reference in `paths`, as `file:line: what`."""
    problems = []
    for path in paths:
        text = path.read_text()
        prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
        for lineno, line in enumerate(prose.splitlines(), 1):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{lineno}"
            for groups in LINK.findall(line):
                target = groups[0] or groups[1]
                if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                if not dest.exists():
                    problems.append(f"{where}: link to a missing file: {target}")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{where}: link to a missing heading: {target}")
            for name in CODE_REF.findall(line):
                if not resolves(name.rstrip(".")):
                    problems.append(f"{where}: `{name}` does not resolve")
    return problems


def build_api(out: pathlib.Path) -> None:
    """The pdoc HTML of MODULES under `out`; any pdoc warning is an error."""
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="markdown", show_source=False,
                          footer_text="kvquota API reference (docstrings, rendered by pdoc)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*MODULES, output_directory=out)
    mine = [w for w in caught if "pdoc" in w.filename]
    if mine:
        for w in mine:
            print(f"error: pdoc: {w.message}", file=sys.stderr)
        sys.exit(1)


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}: this program takes only flags",
              file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, str(ROOT))
    problems = broken_references(documents())
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)
    if not FLAGS.check_only:
        build_api(pathlib.Path(FLAGS.out))
        print(f"API reference: {pathlib.Path(FLAGS.out) / 'index.html'}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
