"""The planner's layers (``docs/architecture.md``): every import, those inside functions included,
goes to the same or a lower layer, and imports inside functions are kept for the libraries whose
import cost pays for laziness."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "canzona"
PLANNER = ROOT / "planner"

#: The planner's layers, lowest first: a module (dotted, relative to ``canzona.planner``) belongs
#: to the layer of its longest listed prefix. The plan file (its schema, assembly, reading, checks
#: and inverse) sits above sharing: nothing below writes or reads a plan.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("formulas", ("errors", "formulas", "hardware", "comm", "settings", "options", "optimizers",
                  "alike")),
    ("model", ("models", "inventory", "stages", "shards", "heads", "layout")),
    ("cost", ("cost", "objective", "planning", "__init__")),
    ("dp", ("dp",)),
    ("tp", ("tp",)),
    ("solve", ("solve",)),
    ("sharing", ("sharing",)),
    ("fsdp2", ("fsdp2",)),
    ("plan", ("plan",)),
    ("front", ("pipeline", "report", "strategies", "simulate", "baselines")),
)

#: Libraries a planner function may import lazily (their import is slow or optional).
LAZY_OK = ("ortools", "matplotlib", "networkx", "torch")


def _rank(name: str) -> int:
    """The layer of planner module ``name`` (dotted, ``__init__`` for a package)."""
    best, rank = -1, None
    for k, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), k
    if rank is None:
        raise AssertionError(f"planner module {name!r} has no layer: add it to LAYERS "
                             "and to docs/architecture.md")
    return rank


def _module_name(path: Path, planner: Path = PLANNER) -> str:
    return ".".join(path.relative_to(planner).with_suffix("").parts)


def _is_module(dotted: str, planner: Path) -> bool:
    base = planner.joinpath(*dotted.split(".")) if dotted else planner
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _target(dotted: str, planner: Path) -> str:
    """The planner module an import of ``canzona.planner[.dotted]`` loads (a package: its
    ``__init__``)."""
    if not dotted:
        return "__init__"
    package = planner.joinpath(*dotted.split(".")) / "__init__.py"
    return dotted + ".__init__" if package.is_file() else dotted


def _imports(path: Path, planner: Path = PLANNER):
    """(line, planner module imported or None, dotted name, inside a function) per import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts = list(path.relative_to(planner).parts[:-1])  # the module's package, from planner
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inner = {id(s) for f in funcs for s in ast.walk(f)}

    def planner_module(dotted: str) -> str | None:
        if dotted == "canzona.planner":
            return "__init__"
        if dotted.startswith("canzona.planner."):
            return _target(dotted.removeprefix("canzona.planner."), planner)
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, planner_module(alias.name), alias.name, id(node) in inner
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = parts[:len(parts) - (node.level - 1)]
                base = ".".join(["canzona", "planner", *up] + ([node.module] if node.module
                                                                else []))
            else:
                base = node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                sub = full.removeprefix("canzona.planner.")
                is_sub = full.startswith("canzona.planner.") and _is_module(sub, planner)
                dotted = full if is_sub else base
                yield node.lineno, planner_module(dotted), dotted, id(node) in inner


def _planner_files() -> list[Path]:
    return sorted(PLANNER.rglob("*.py"))


def test_every_planner_module_has_a_layer():
    for path in _planner_files():
        _rank(_module_name(path))


def test_no_import_goes_to_a_higher_layer():
    bad = []
    for path in _planner_files():
        me = _module_name(path)
        for line, target, _, _ in _imports(path):
            if target is not None and _rank(target) > _rank(me):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} "
                           f"({LAYERS[_rank(me)][0]}) imports {target} "
                           f"({LAYERS[_rank(target)][0]})")
    assert not bad, "imports to a higher layer:\n" + "\n".join(sorted(set(bad)))


def _graph(unit) -> nx.DiGraph:
    """The planner's import graph (every import, those inside functions included), its nodes
    ``unit(module)``."""
    g = nx.DiGraph()
    for path in _planner_files():
        me = unit(_module_name(path))
        g.add_node(me)
        for _, target, _, _ in _imports(path):
            if target is not None and target != "__init__" and unit(target) != me:
                g.add_edge(me, unit(target))
    return g


def test_no_import_cycles_between_modules_or_packages():
    """No circle of imports between planner modules (a package as its ``__init__``), nor between
    its packages and top-level modules (``dp``, ``tp``, ``sharing``, ``plan``, ``comm``, …)."""
    for unit in (lambda m: m.removesuffix(".__init__"), lambda m: m.split(".")[0]):
        cycles = sorted(" -> ".join(c + [c[0]]) for c in nx.simple_cycles(_graph(unit)))
        assert not cycles, "import cycles:\n" + "\n".join(cycles[:10])


def test_imports_inside_functions_are_only_lazy_libraries():
    bad = []
    for path in _planner_files():
        for line, target, dotted, inside in _imports(path):
            if inside and (target is not None or dotted.split(".")[0] not in LAZY_OK):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {dotted}")
    assert not bad, ("imports inside functions (move them to the top of the module):\n"
                     + "\n".join(sorted(set(bad))))


def test_the_layer_rules_catch_what_they_should(tmp_path):
    """The import walk sees an upward import and a function-level one, relative or absolute, and
    a lazy library; the layers order a stage above the leaves it reads."""
    fake = tmp_path / "canzona" / "planner"
    for folder in (fake, fake / "dp", fake / "tp"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    (fake / "tp" / "context.py").write_text("")
    (fake / "errors.py").write_text("")
    (fake / "dp" / "greedy.py").write_text(
        "from ..tp import context\n"
        "from . import __init__ as me\n"
        "def f():\n    from canzona.planner import errors\n    import ortools\n")
    found = [(t, inside) for _, t, _, inside in _imports(fake / "dp" / "greedy.py", fake)]
    assert ("tp.context", False) in found
    assert ("errors", True) in found
    assert (None, True) in found  # ortools, lazily: allowed
    assert _rank("tp.context") > _rank("dp.greedy") > _rank("errors")
    assert _rank("comm") < _rank("sharing.search") < _rank("plan.schema") == _rank("plan.load")


def test_the_documented_layers_are_the_tested_ones():
    """docs/architecture.md's layer table lists the same layers, in the same order, with the
    same modules."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [r.split("|")[1:3] for r in section.splitlines() if r.startswith("| `")]
    documented = [(layer.strip().strip("`"),
                   tuple(m.strip().strip("`") for m in mods.split(",") if m.strip()))
                  for layer, mods in rows]
    assert documented == [(layer, tuple(p.replace(".", "/") for p in prefixes))
                          for layer, prefixes in LAYERS]


#: Where an optimizer's name may be tested: the two registries and the kernels' own files.
NAME_HOMES = ("planner/optimizers.py", "runtime/optim/registry.py", "runtime/optim/muon.py",
              "runtime/optim/shampoo.py", "runtime/optim/soap.py")


def _name_tests(tree: ast.AST, names: set[str]):
    """(line, source) of every comparison, ``in`` test or dict key naming one of ``names``."""
    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(c) for c in [node.left,
                                                                    *node.comparators]):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            yield node.lineno, ast.unparse(node)[:80]
        elif isinstance(node, ast.match_case) and named(getattr(node.pattern, "value", None)):
            yield node.lineno, ast.unparse(node.pattern)


def test_no_optimizer_name_is_branched_on_outside_the_registries():
    """What an optimizer can do is a capability of its registry spec (``OptimizerSpec.share``):
    no ``== "muon"``, ``in ("muon", …)`` or ``{"shampoo": …}`` elsewhere in the package."""
    from canzona.planner import optimizers

    names = set(optimizers.names())
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in NAME_HOMES:
            continue
        for line, src in _name_tests(ast.parse(path.read_text(encoding="utf-8")), names):
            bad.append(f"canzona/{rel}:{line}: {src}")
    assert not bad, "optimizer names branched on (use the spec's capabilities):\n" + "\n".join(bad)


def test_the_name_test_sees_comparisons_in_tests_and_keys():
    tree = ast.parse('a == "muon"\nb in ("x", "shampoo")\nc = {"soap": 1}\nd = "muon"\n'
                     'e != other\n')
    assert [line for line, _ in _name_tests(tree, {"muon", "shampoo", "soap"})] == [1, 2, 3]


def test_lines_are_at_most_100_characters():
    """Python lines in the package, the tests, the benchmarks, the examples and plans/."""
    repo = ROOT.parent
    files = [p for d in ("canzona", "tests", "benchmarks", "examples", "plans")
             for p in sorted((repo / d).rglob("*.py"))]
    long = [f"{p.relative_to(repo)}:{k}" for p in files
            for k, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100]
    assert not long, "lines over 100 characters:\n" + "\n".join(long)


def test_one_plan_reader():
    """Every plan file is read by one function, which runs every check."""
    defs = [f"{p.relative_to(ROOT.parent)}" for p in sorted(ROOT.rglob("*.py"))
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef) and node.name == "load_plan"]
    assert defs == ["canzona/planner/plan/load.py"]
