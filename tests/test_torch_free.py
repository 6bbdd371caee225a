"""Planning needs no torch: the one check that ``import canzona``, every planner and CLI module and
a whole plan-and-inspect run work with torch blocked, that the planner imports nothing of ours
above it, and that the names needing torch say how to install it (the planner imports
no torch; cli → planner, never the reverse)."""

import subprocess
import sys
import textwrap

CODE = textwrap.dedent("""
    import importlib, pkgutil, sys
    sys.modules["torch"] = None  # any 'import torch' now raises ImportError

    def ours(prefix):
        return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))

    # Every planner module, and the planner alone: nothing of the CLI or the runtime.
    import canzona.planner
    for info in pkgutil.walk_packages(canzona.planner.__path__, "canzona.planner."):
        importlib.import_module(info.name)
    assert ours("canzona.cli") == [] and ours("canzona.runtime") == [], sys.modules.keys()

    # A plan with a TP section, built and reported on without torch.
    from canzona.planner import ParallelSizes, build_inventory, formulas, get_preset
    from canzona.planner.pipeline import plan
    from canzona.planner.plan.build import baseline_plan
    from canzona.planner.planning import make_problem
    from canzona.planner.report import inspect_report
    baseline_plan(make_problem(build_inventory(get_preset("qwen3-0.6b")), ParallelSizes(2, 1)))
    report = inspect_report(plan("qwen3-0.6b", ParallelSizes(2, 2)))
    assert report["baselines"] and report["tp_schedule"]["baselines"]
    assert formulas.muon_flops(128, 384) == 5 * (4 * 128 * 128 * 384 + 2 * 128 ** 3)

    # Every CLI module.
    import canzona.cli
    for info in pkgutil.walk_packages(canzona.cli.__path__, "canzona.cli."):
        importlib.import_module(info.name)

    # The top-level package: its names, the torch-free ones usable.
    import canzona
    assert callable(canzona.load_plan) and callable(canzona.save_plan)
    assert sorted(canzona.__all__) == ["CanzonaOptimizer", "__version__", "dcp_state",
                                       "load_checkpoint", "load_plan", "plan_model",
                                       "save_checkpoint", "save_plan"]
    assert not [m for m in sys.modules if (m == "torch" or m.startswith("torch."))
                and sys.modules[m] is not None]

    # The optimizer needs torch and says how to install it, both ways of asking.
    try:
        canzona.CanzonaOptimizer
    except ModuleNotFoundError as e:
        print("attribute:", e)
    try:
        from canzona import CanzonaOptimizer
    except ModuleNotFoundError as e:
        print("import:", e)
""")


def test_planning_runs_and_the_cli_imports_with_torch_blocked():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [x.split(":")[0] for x in lines] == ["attribute", "import"], r.stdout
    for line in lines:
        assert "pip install 'canzona[runtime]'" in line, line
