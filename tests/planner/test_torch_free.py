"""The planner never imports torch (DESIGN.md: planner → nothing of ours above it)."""

import subprocess
import sys
import textwrap


def test_planner_imports_with_torch_blocked():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any 'import torch' now raises ImportError
        import canzona, canzona.planner, canzona.planner.plan, canzona.planner.planning
        import canzona.cli.main
        from canzona.planner import build_inventory, get_preset, ParallelSizes
        from canzona.planner.planning import make_problem, baseline_plan
        baseline_plan(make_problem(build_inventory(get_preset("qwen3-0.6b")), ParallelSizes(2, 1)))
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules
                       if sys.modules[m] is not None)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
