"""The plan schema is a leaf: it loads settings, formulas, the optimizer registry, the
communication model's method names (with the hardware profiles they read) and errors, never the
planner's machinery; the plan package (``canzona.planner.plan``) loads the schema alone (with
the compact file's encoding, a leaf too)."""

import subprocess
import sys

CODE = r"""
import sys, types, importlib.util, pathlib
import canzona
root = pathlib.Path(canzona.__file__).parent / "planner"
pkg = types.ModuleType("canzona.planner"); pkg.__path__ = [str(root)]  # skip the package __init__
sys.modules["canzona.planner"] = pkg
import canzona.planner.plan
print(sorted(m for m in sys.modules if m.startswith("canzona.planner.")))
print("torch" in sys.modules)
"""


def test_plan_module_imports_only_settings_formulas_registry_and_errors():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded, torch = r.stdout.splitlines()
    assert loaded == str(sorted(["canzona.planner.comm", "canzona.planner.errors",
                                 "canzona.planner.formulas", "canzona.planner.hardware",
                                 "canzona.planner.optimizers", "canzona.planner.plan",
                                 "canzona.planner.plan.compact", "canzona.planner.plan.schema",
                                 "canzona.planner.settings"]))
    assert torch == "False"
