"""What the CLI tests share: running a command in-process, and plan files to inspect."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from canzona.cli.main import app

runner = CliRunner()


def run(*args):
    """``canzona ARGS…`` in this process (arguments converted with ``str``)."""
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(r, *needles):
    """Exit 1 and exactly one 'error:' line mentioning every needle."""
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    for n in needles:
        assert n in lines[0], lines[0]


def plan_files(folder: Path, dp: int, model: str = "qwen3-0.6b") -> dict[int, tuple[Path, str]]:
    """``canzona plan`` of ``model`` at ``dp`` and tp 1 and 2: per tp, the file and stdout."""
    out = {}
    for tp in (1, 2):
        path = folder / f"q-tp{tp}.plan.json"
        r = run("plan", "--model", model, "--dp", dp, "--tp", tp, "-o", path)
        assert r.exit_code == 0, r.output
        out[tp] = (path, r.stdout)
    return out
