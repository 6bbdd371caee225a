"""``canzona.runtime.dp`` stays importable for one release: it warns, naming the new homes, and
its names are the real ones."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from canzona.runtime import accounting, errors, optimizer  # noqa: E402


def test_importing_runtime_dp_warns_and_its_names_work():
    sys.modules.pop("canzona.runtime.dp", None)
    with pytest.warns(DeprecationWarning, match="canzona.runtime.dp is deprecated") as caught:
        dp = importlib.import_module("canzona.runtime.dp")
    message = str(caught[0].message)
    for home in ("canzona.runtime.optimizer", "canzona.runtime.errors",
                 "canzona.runtime.accounting"):
        assert home in message
    assert dp.CanzonaOptimizer is optimizer.CanzonaOptimizer
    assert dp.PlanMismatchError is errors.PlanMismatchError
    assert dp.UnusedParameterWarning is errors.UnusedParameterWarning
    assert dp.predicted_state_bytes is accounting.predicted_state_bytes


def test_the_warning_points_at_the_importer():
    sys.modules.pop("canzona.runtime.dp", None)
    with pytest.warns(DeprecationWarning) as caught:
        exec(compile("import canzona.runtime.dp", "importer.py", "exec"), {})
    assert caught[0].filename == "importer.py"


def test_nothing_in_the_repository_imports_runtime_dp():
    root = Path(__file__).resolve().parents[2]
    here = Path(__file__).resolve()
    found = []
    for folder in ("canzona", "tests", "benchmarks", "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.resolve() == here:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if "canzona.runtime.dp" in names:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, "imports of the deprecated canzona.runtime.dp:\n" + "\n".join(found)
