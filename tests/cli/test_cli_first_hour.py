"""The first hour of a new user: charts, messages, --json, units, progress, --help."""

import contextlib
import io
import json
import re
import sys
import time

import pytest
from rich.console import Console

from canzona.cli import _render
from cli_helpers import plan_files, run


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A tp = 1 plan and a tp = 2 plan of qwen3-0.6b."""
    return plan_files(tmp_path_factory.mktemp("plans"), dp=2)


def error_only(r, *needles):
    """Exit 1, nothing on stdout, one 'error:' line on stderr mentioning every needle."""
    assert r.exit_code == 1, r.output
    assert r.stdout == "", r.stdout
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# --- 3. --plot says exactly which files were written --------------------------------------------


def test_plot_unsupported_extension_fails_before_the_report(plans, tmp_path):
    path, _ = plans[1]
    error_only(run("inspect", path, "--plot", tmp_path / "chart.jpgx"), "--plot", ".jpgx", ".png")
    assert not list(tmp_path.iterdir())


def test_plot_into_a_folder_names_the_file_after_the_plan(plans, tmp_path):
    path, _ = plans[1]
    r = run("inspect", path, "--plot", tmp_path)
    assert r.exit_code == 0, r.output
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["q-tp1.png"]
    assert f"wrote chart {tmp_path / 'q-tp1.png'}" in r.stdout
    assert (tmp_path / "q-tp1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_extension_adds_png_and_says_so(plans, tmp_path):
    path, _ = plans[1]
    r = run("inspect", path, "--plot", tmp_path / "chart")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png"]
    assert f"wrote chart {tmp_path / 'chart.png'}" in r.stdout


def test_plot_tp_plan_reports_both_files_and_other_formats_work(plans, tmp_path):
    path, _ = plans[2]
    r = run("inspect", path, "--plot", tmp_path / "c.svg")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c-tp.svg", "c.svg"]
    assert f"wrote chart {tmp_path / 'c.svg'}" in r.stdout
    assert f"wrote TP chart {tmp_path / 'c-tp.svg'}" in r.stdout
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")


def test_plot_with_json_keeps_stdout_json_and_names_files_on_stderr(plans, tmp_path):
    path, _ = plans[2]
    r = run("inspect", path, "--json", "--plot", tmp_path / "c.png")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == json.loads(run("inspect", path, "--json").stdout)
    assert [x for x in r.stderr.splitlines() if x.strip()] == [
        f"wrote chart {tmp_path / 'c.png'}", f"wrote TP chart {tmp_path / 'c-tp.png'}"]


def test_plot_missing_folder_is_one_line(plans, tmp_path):
    path, _ = plans[1]
    error_only(run("inspect", path, "--plot", tmp_path / "no" / "c.png"), "does not exist")


def test_plot_without_matplotlib_gives_the_install_hint_with_brackets(plans, tmp_path, monkeypatch):
    path, _ = plans[1]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    error_only(run("inspect", path, "--plot", tmp_path / "c.png"), "pip install 'canzona[plot]'")


# --- 4. messages --------------------------------------------------------------------------------


def test_messages_are_printed_verbatim_not_as_markup(monkeypatch):
    error_only(run("plan", "--model", "foo[plot]"), "unknown model 'foo[plot]'")
    buf = io.StringIO()
    monkeypatch.setattr(_render, "err_console", Console(file=buf, width=200))
    _render.error("pip install 'canzona[plot]' [bold]x[/bold]")
    _render.note("see [runtime]")
    _render.info("wrote chart [x].png")
    assert buf.getvalue().splitlines() == ["error: pip install 'canzona[plot]' [bold]x[/bold]",
                                           "note: see [runtime]", "wrote chart [x].png"]


def test_config_without_model_type(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64}))
    r = run("plan", "--config", cfg)
    error_only(r, "no 'model_type' field", "qwen3")
    assert "None" not in r.stderr


def test_oversized_matrices_are_one_cli_note_not_a_python_warning(tmp_path):
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "--tp", 2, "--cmax", 1, "-o",
            tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    notes = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(notes) == 1 and notes[0].startswith("note:") and "exceed C_max" in notes[0], r.stderr
    assert "Warning" not in r.stderr and "warnings.warn" not in r.stderr


# --- 5. inspect --json: tp stays an integer; the real peak ---------------------------------------


def test_json_tp_is_an_integer_and_the_schedule_has_its_own_key(plans):
    for tp in (1, 2):
        rep = json.loads(run("inspect", plans[tp][0], "--json").stdout)
        assert rep["tp"] == tp and isinstance(rep["tp"], int)
        assert (rep["tp_schedule"] is None) == (tp == 1)


def test_peak_gathered_includes_oversized_groups_and_marks_them(tmp_path):
    path = tmp_path / "p.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "--tp", 2, "--cmax", 4, "-o", path)
    assert r.exit_code == 0, r.output
    rep = json.loads(run("inspect", path, "--json").stdout)["tp_schedule"]
    groups = rep["groups"]
    over = [g for g in groups if g["oversized"]]
    assert over and any(not g["oversized"] for g in groups)
    assert rep["metrics"]["peak_gathered_bytes"] == max(g["peak_gathered_bytes"] for g in groups)
    assert rep["metrics"]["peak_gathered_bytes"] > rep["cmax_bytes"]
    assert rep["metrics"]["peak_gathered_bytes_within_cmax"] == max(
        g["peak_gathered_bytes"] for g in groups if not g["oversized"])
    assert rep["metrics"]["oversized_groups"] == len(over)
    assert "oversized groups" in r.stdout


# --- 8. one unit family; per-DP-index and per-GPU labels -----------------------------------------


def test_bytes_are_binary_units_everywhere(plans):
    for tp in (1, 2):
        path, plan_out = plans[tp]
        text = plan_out + run("inspect", path).stdout
        assert re.search(r"\d (KiB|MiB|GiB)", text), text
        assert not re.search(r"\d ?(KB|MB|GB|TB)\b", text), text
        assert not re.search(r"\d(\.\d+)?[KMGT]B\b", text), text


def test_scopes_are_labelled(plans):
    assert "per DP index (its 2 TP ranks summed)" in plans[2][1]
    assert "per GPU" in plans[2][1]
    assert "TP ranks summed" not in plans[1][1]


# --- 9. progress from the start of long steps ----------------------------------------------------


class _Recorder:
    def __init__(self):
        self.active = False
        self.phases = []

    @contextlib.contextmanager
    def __call__(self, title, delay_s=0.25, *, quiet=False):
        self.active = True
        try:
            yield self.phases.append
        finally:
            self.active = False


def test_progress_covers_the_inventory_and_the_plan_loading(plans, tmp_path, monkeypatch):
    import canzona.planner.pipeline

    rec = _Recorder()
    monkeypatch.setattr(_render, "progress", rec)
    seen = {}
    real_inv = canzona.planner.pipeline.inventory_of

    def inv(source, *args):
        seen["inventory"] = rec.active
        return real_inv(source, *args)

    monkeypatch.setattr(canzona.planner.pipeline, "inventory_of", inv)
    assert run("plan", "--model", "qwen3-0.6b", "--dp", 2, "-o", tmp_path / "p.json").exit_code == 0
    assert seen["inventory"] is True and rec.phases[0].startswith("model inventory")
    rec.phases.clear()
    assert run("inspect", plans[2][0]).exit_code == 0
    assert rec.phases[:2] == ["reading the plan", "rebuilding the model's problem"]
    assert "TP baselines" in rec.phases


def test_progress_shows_on_a_terminal_and_is_silent_otherwise(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(_render, "err_console", Console(file=buf, force_terminal=True, width=100))
    with _render.progress("planning x", delay_s=0.0) as say:
        say("DP partition")
        time.sleep(0.4)
    assert "planning x: DP partition" in buf.getvalue()
    buf2 = io.StringIO()
    monkeypatch.setattr(_render, "err_console", Console(file=buf2, force_terminal=False))
    with _render.progress("planning x", delay_s=0.0) as say:
        say("DP partition")
        time.sleep(0.1)
    assert buf2.getvalue() == ""


# --- 10. --help and headers ----------------------------------------------------------------------


def test_help_has_no_type_placeholders_on_flags_nor_braces():
    for args in ((), ("plan",), ("inspect",), ("layout",), ("models",)):
        out = run(*args, "--help").stdout
        assert "<bool>" not in out, (args, out)
        assert "{" not in out, (args, out)
    out = run("inspect", "--help").stdout
    assert "canzona inspect [OPTIONS] PLAN_FILE" in out


def test_one_gpu_header_is_singular(tmp_path):
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 1, "-o", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    assert "(1 GPU)" in r.stdout and "GPUs" not in r.stdout.splitlines()[0]
