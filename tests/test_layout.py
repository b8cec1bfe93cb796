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


def test_the_allocator_is_one_class_of_one_line_delegations():
    """No mixins, no logic in the facade: each public method returns one call to the op that
    validates its inputs beside its jitted core (DESIGN.md §2)."""
    assert kvquota.Allocator.__bases__ == (object,)
    tree = ast.parse((ROOT / "kvquota" / "allocator.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Allocator")
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    assert len(methods) >= 30
    for fn in methods:
        body = [s for s in fn.body
                if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert len(body) == 1 and isinstance(body[0], ast.Return), fn.name


def test_every_core_is_a_named_donating_jit():
    """The cores are module-level names a reader can follow (no string-keyed table), each built
    by the one helper."""
    import importlib
    import pkgutil

    from kvquota.core.jit import DonatingJit

    cores = {}
    for info in pkgutil.iter_modules([str(ROOT / "kvquota" / "core")]):
        module = importlib.import_module(f"kvquota.core.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, DonatingJit) and value.fn.__module__ == module.__name__:
                cores[f"{info.name}.{attr}"] = value.name
    assert len(cores) == 18, sorted(cores)
    assert len(set(cores.values())) == len(cores)  # one version tag per core


# Bases a class in kvquota/serving/ may name: plain data and enums. The engines' and the
# executors' shared base classes (one base each, the subclasses standalone implementations of one
# interface) are listed by name: they are base classes, not mixins joined through `self`.
PLAIN_BASES = {"object", "Enum", "IntEnum", "StrEnum", "NamedTuple"}
SHARED_BASES = {"_Engine": "kvquota/serving/engine.py", "_Executor": "kvquota/serving/executors.py"}


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ast.unparse(node))


def test_no_mixins_in_serving():
    """No class in kvquota/serving/ is put together from mixins (STYLE.md: components that own
    their state, not one class over several files): each class has at most one base, which is
    object, an enum or a NamedTuple (dataclasses are decorated, not derived), or one of the two
    shared bases, which derive from nothing themselves."""
    bad = []
    for path in (ROOT / "kvquota" / "serving").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [_base_name(b) for b in node.bases]
            allowed = PLAIN_BASES | (set() if node.name in SHARED_BASES else set(SHARED_BASES))
            if len(bases) > 1 or not set(bases) <= allowed or \
                    (node.name in SHARED_BASES and SHARED_BASES[node.name] != rel):
                bad.append((rel, node.name, bases))
    assert not bad, bad


def test_the_scheduler_is_one_class():
    from kvquota.serving import Scheduler, WaitQueue

    assert Scheduler.__bases__ == (object,) and WaitQueue.__bases__ == (object,)


def test_sim_never_touches_the_schedulers_private_attributes():
    """The load test drives the scheduler through its public methods only: no `sched._x`,
    `scheduler._x` (or `s._x`, its local name) anywhere in kvquota/sim/."""
    import re

    pattern = re.compile(r"\b(sched|scheduler|s)\._\w")
    bad = [(str(p.relative_to(ROOT)), n, line.strip())
           for p in (ROOT / "kvquota" / "sim").rglob("*.py")
           for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, bad
