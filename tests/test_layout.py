"""The layout rules of DESIGN.md §2, checked so later work keeps them: kernels/ is the ground
floor, experiments use the public API only, one donation path. Module size is a smell, not a
rule (STYLE.md), so no test caps it."""

import ast
import importlib.util
import pathlib

import kvquota

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> list[str]:
    """Every module a file imports (`from pkg import sub` counts `pkg.sub` when sub is a module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names
                      if importlib.util.find_spec(node.module.split(".")[0]) is not None
                      and _is_module(f"{node.module}.{a.name}")]
    return names


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_kernels_import_nothing_from_kvquota():
    bad = [(str(p.relative_to(ROOT)), n) for p in (ROOT / "kernels").rglob("*.py")
           for n in _imports(p) if n == "kvquota" or n.startswith("kvquota.")]
    assert not bad, bad


def test_experiments_use_the_public_api_only():
    bad = [(str(p.relative_to(ROOT)), n) for p in (ROOT / "experiments").rglob("*.py")
           for n in _imports(p) if n.startswith("kvquota.")]
    assert not bad, bad


def test_one_donation_path():
    public = [name for name in dir(kvquota.Allocator) if not name.startswith("_")]
    assert not [name for name in public if name.endswith("_donated")]
    defs = [(str(p.relative_to(ROOT)), node.name) for p in (ROOT / "kvquota").rglob("*.py")
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.FunctionDef) and "donated" in node.name]
    assert not defs, defs
