"""Rough edges a new user meets: plan-version errors, options a plan contradicts, ``plan --json``
and ``-o DIR``, bad numbers, the hardware choices, progress lines off a terminal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from canzona.planner.plan import SCHEMA_VERSION
from canzona.planner.plan.convert import OLDEST_VERSION

from cli_helpers import run

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "plans" / "old"


def error_line(r, *needles) -> str:
    """Exit 1, nothing on stdout, one 'error:' line on stderr naming every needle."""
    assert r.exit_code == 1, r.output
    assert r.stdout == "", r.stdout
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# --- plan-version errors name the file's version, the versions read and the fix ---------------


READS = f"reads version {OLDEST_VERSION} to version {SCHEMA_VERSION}"


def _edited(tmp_path: Path, name: str, edit) -> Path:
    data = json.loads((OLD / name).read_text())
    edit(data)
    path = tmp_path / f"edited-{name}"
    path.write_text(json.dumps(data))
    return path


def test_newer_plan_names_its_version_the_versions_read_and_the_fix(tmp_path):
    path = _edited(tmp_path, "tiny-dp2-tp2-v3.plan.json",
                   lambda d: d.update(schema_version=SCHEMA_VERSION + 1))
    error_line(run("inspect", path), f"file schema version {SCHEMA_VERSION + 1}", READS,
               "upgrade canzona", "'canzona plan'")


@pytest.mark.parametrize("name,version", [("tiny-dp2-tp2-v1.plan.json", 1),
                                          ("tiny-dp2-tp2-v3.plan.json", 3),
                                          ("tiny-dp4-tp1-v4.plan.json", 4)])
def test_malformed_old_plan_names_its_own_version_and_the_fix(tmp_path, name, version):
    path = _edited(tmp_path, name, lambda d: d["rank_layout"].update(dp=0))
    error_line(run("inspect", path), f"file schema version {version};", READS,
               "regenerate it with 'canzona plan'")


def test_older_plan_names_its_version_the_versions_read_and_the_fix(tmp_path):
    path = _edited(tmp_path, "tiny-dp2-tp2-v2.plan.json",
                   lambda d: d.update(schema_version=OLDEST_VERSION - 1))
    error_line(run("inspect", path), f"file schema version {OLDEST_VERSION - 1};", READS,
               "regenerate it with 'canzona plan'")


def test_old_plans_still_load():
    for path in sorted(OLD.glob("*.plan.json")):
        r = run("inspect", path, "--config", OLD / "tiny-config.json", "--json")
        assert r.exit_code == 0, r.output


# --- compare --plan refuses sizes and options the plan contradicts -----------------------------


V4 = OLD / "tiny-dp4-tp1-v4.plan.json"  # dp 4, tp 1, ep 1, muon, bucket size 20000


@pytest.mark.parametrize("option,value,planned", [("--dp", 8, "dp 4"), ("--tp", 2, "tp 1"),
                                                  ("--ep", 2, "ep 1"),
                                                  ("--optimizer", "soap", "optimizer muon"),
                                                  ("--bucket-size", 5, "bucket-size 20000")])
def test_compare_plan_refuses_an_option_the_plan_contradicts(option, value, planned):
    r = run("compare", "--plan", V4, "--config", OLD / "tiny-config.json", option, value)
    error_line(r, f"{option} {value}", planned, str(V4))


def test_compare_plan_accepts_the_plans_own_values():
    r = run("compare", "--plan", V4, "--config", OLD / "tiny-config.json", "--dp", 4, "--tp", 1,
            "--optimizer", "Muon", "--bucket-size", 20000, "--strategies", "canzona", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dp"] == 4


# --- plan --json, plan -o FOLDER ---------------------------------------------------------------


def test_plan_json_is_the_summary_as_numbers(tmp_path):
    from canzona.planner.plan.load import load_plan

    out = tmp_path / "p.plan.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)  # stdout is the JSON alone
    p = load_plan(out)
    assert (d["model"], d["dp"], d["tp"], d["ep"], d["optimizer"]) == ("qwen3-0.6b", 4, 2, 1,
                                                                        "muon")
    assert d["output"] == str(out)
    assert d["gap_to_bound"] == p.metrics.gap_to_bound
    assert d["certified_bound"] == p.metrics.certified_bound
    assert d["solver_status"] == p.metrics.solver_status
    assert d["per_dp_index"]["flops"]["max"] == max(p.metrics.dp_flops)
    assert d["tp_per_gpu"]["gap_to_lb_gpu"] == p.tp.metrics.gap_to_lb_gpu
    assert d["collectives"]["predicted_s"] == p.comm.predicted_s


def test_plan_output_folder_gets_the_default_name(tmp_path):
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "-o", tmp_path)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "qwen3-0.6b-dp2-tp1-muon.plan.json").is_file()
    assert str(tmp_path / "qwen3-0.6b-dp2-tp1-muon.plan.json") in r.stdout.replace("\n", "")


# --- a number that does not parse is canzona's one error line, exit 1 --------------------------


@pytest.mark.parametrize("args,option", [
    (("plan", "--model", "qwen3-0.6b", "--dp", "four"), "--dp"),
    (("plan", "--model", "qwen3-0.6b", "--alpha", "half"), "--alpha"),
    (("layout", "--model", "qwen3-0.6b", "--tp", "2.5"), "--tp"),
    (("compare", "--model", "qwen3-0.6b", "--mfu", "high"), "--mfu"),
    (("compare", "--model", "qwen3-0.6b", "--seq", "0"), "--seq"),
    (("inspect", V4, "--top", "-1"), "--top"),
    (("simulate", V4, "--backward", "soon"), "--backward"),
    (("calibrate", "--quick", "--name", "x", "-o", "/nonexistent/h.json", "--json", "--help"),
     None),
])
def test_bad_number_is_one_error_line(args, option):
    r = run(*args)
    if option is None:  # --help still wins
        assert r.exit_code == 0 and "Usage" in r.stdout, r.output
        return
    error_line(r, f"{option} '{args[-1]}': ", f"canzona {args[0]} --help")


def test_help_and_usage_errors_keep_typers_form():
    for cmd in ("plan", "inspect", "simulate", "compare", "layout", "models", "calibrate"):
        r = run(cmd, "--help")
        assert r.exit_code == 0 and "Usage" in r.stdout, r.output
    assert run("inspect").exit_code == 2  # a missing argument: usage, exit 2


# --- the --hardware choices, in one order ------------------------------------------------------


def test_every_hardware_option_lists_the_choices_in_the_librarys_order():
    import typer

    from canzona.cli.main import app
    from canzona.planner.hardware import hardware_names

    order = ", ".join(hardware_names())
    group = typer.main.get_command(app)
    seen = []
    for name, cmd in group.commands.items():
        for p in cmd.params:
            if "--hardware" in getattr(p, "opts", ()):
                seen.append(name)
                assert order + ", or a profile file" in p.help, (name, p.help)
    assert sorted(seen) == ["compare", "plan", "simulate"]
    r = run("plan", "--model", "qwen3-0.6b", "--hardware", "tpu")
    error_line(r, f"one of: {order}")


# --- canzona.save_plan beside canzona.load_plan ------------------------------------------------


def test_top_level_save_plan_writes_what_load_plan_reads(tmp_path):
    import canzona

    assert "save_plan" in canzona.__all__ and "save_plan" in dir(canzona)
    plan = canzona.load_plan(OLD / "tiny-dp4-tp1-v4.plan.json")
    out = canzona.save_plan(plan, tmp_path / "again.plan.json")
    assert out.read_text() == (OLD / "tiny-dp4-tp1-v4.plan.json").read_text()


def test_examples_use_the_top_level_plan_names():
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert "from canzona.planner.plan import" not in path.read_text(), path.name


# --- help fills its lines; progress off a terminal ---------------------------------------------


def test_command_help_is_unwrapped_for_the_terminal_to_wrap():
    import re

    import typer

    from canzona.cli.main import app

    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        assert not re.search(r"(?<!\n)\n(?!\n)", cmd.help or ""), (name, cmd.help)
    r = run("--help")
    assert r.exit_code == 0
    rows = [x.strip("│ ") for x in r.stdout.splitlines() if x.startswith("│")]
    # A description's row ends at the box or at the end of its sentence, never mid-phrase.
    for row, nxt in zip(rows, rows[1:]):
        if nxt.startswith(" ") or nxt.split(" ", 1)[0] not in group.commands:
            assert len(row) > 45 or row.endswith("."), (row, nxt)


def test_plan_prints_its_stages_on_stderr_off_a_terminal(tmp_path, monkeypatch):
    from canzona.cli import _render

    monkeypatch.setattr(_render, "PLAIN_DELAY_S", 0.0)
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "-o", tmp_path / "p.json", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dp"] == 2  # stdout: the JSON alone
    stages = [x for x in r.stderr.splitlines() if x.startswith("planning qwen3-0.6b dp=2 tp=1: ")]
    assert any("writing the plan" in x for x in stages), r.stderr
    assert len(stages) >= 2, r.stderr
    for quiet in ("--quiet", "-q"):  # silenced: stderr stays empty, the JSON alike
        r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "-o", tmp_path / "q.json", "--json",
                quiet)
        assert r.exit_code == 0, r.output
        assert r.stderr == "" and json.loads(r.stdout)["dp"] == 2
    p = tmp_path / "p.json"
    r = run("inspect", p, "--quiet")
    assert r.exit_code == 0 and r.stderr == "", r.output
    r = run("inspect", p)
    assert r.exit_code == 0 and f"inspecting {p.name}: " in r.stderr, r.output


# --- following the README writes nothing into the clone ----------------------------------------


def test_readme_and_example_checkpoint_commands_write_outside_the_clone():
    import re

    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
    texts = {p.name: p.read_text() for p in pages}
    found = 0
    for name, text in texts.items():
        for opt, value in re.findall(r"(--checkpoint|--resume)\s+([^\s`\\]+)", text):
            if value.isupper() or value.startswith("DIR"):  # a placeholder (--checkpoint DIR)
                continue
            found += 1
            assert value.startswith("/tmp/"), (name, opt, value)
    assert found >= 2
