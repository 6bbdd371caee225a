"""`canzona plan --cmax/--tp-solver` and the TP view of `canzona inspect`."""

import json


from canzona.planner.plan.load import load_plan
from cli_helpers import run


def test_plan_writes_tp_section_and_inspect_shows_it(tmp_path):
    out = tmp_path / "p.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "--tp", 4, "--cmax", 64,
            "--tp-solver", "cpsat", "-o", out)
    assert r.exit_code == 0, r.output
    assert "LB_gpu" in r.output
    p = load_plan(out)
    assert p.tp is not None and p.tp.cmax_bytes == 64 * 2**20 and p.tp.solver == "cpsat"
    assert all(t.host is not None for t in p.tasks if t.optimizer == "matrix")
    r = run("inspect", out, "--top", 0)
    assert r.exit_code == 0, r.output
    assert ("TP micro-groups" in r.output and "canzona-greedy" in r.output
            and "compute |" in r.output)
    r = run("inspect", out, "--json")
    rep = json.loads(r.output)
    assert ({b["name"] for b in rep["tp_schedule"]["baselines"]}
            == {"sc", "canzona-greedy", "canzona"})
    assert len(rep["tp_schedule"]["gpu_load"]) == 2 and len(rep["tp_schedule"]["gpu_load"][0]) == 4


def test_tp1_plan_has_no_tp_section(tmp_path):
    out = tmp_path / "p.json"
    assert run("plan", "--model", "qwen3-0.6b", "--dp", 2, "-o", out).exit_code == 0
    assert load_plan(out).tp is None


def test_bad_cmax_and_tp_solver_are_one_line_errors(tmp_path):
    for args, needle in ((("--cmax", 0), "--cmax"), (("--tp-solver", "magic"), "--tp-solver")):
        r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "--tp", 2, *args, "-o",
                tmp_path / "x.json")
        assert r.exit_code == 1, r.output
        lines = [x for x in r.output.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.output
        assert not (tmp_path / "x.json").exists()
