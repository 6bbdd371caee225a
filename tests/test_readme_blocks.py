"""The README's code blocks run as written: its quick-start commands (in a temporary folder) and
its training loop at world size 1 on gloo, with a small model and data around it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(kind: str) -> list[str]:
    return [body for lang, body in BLOCK.findall((ROOT / "README.md").read_text())
            if lang == kind]


def test_the_quick_start_commands_run(tmp_path):
    """Every `canzona …` line of the README's shell blocks (the installs are CI's own command)."""
    lines = [ln.split("#")[0].strip() for body in blocks("bash") for ln in body.splitlines()]
    commands = [ln for ln in lines if ln.startswith("canzona ")]
    assert len(commands) >= 4, commands
    for cmd in commands:
        run = subprocess.run([sys.executable, "-m", "canzona.cli.main", *cmd.split()[1:]],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{cmd}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"


PRELUDE = """
import os, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32, bias=False),
                            torch.nn.GELU(), torch.nn.Linear(32, 64, bias=False))
world_size = dist.get_world_size()
gen = torch.Generator().manual_seed(0)
data = [(torch.randint(0, 64, (8, 16), generator=gen),) * 2 for _ in range(5)]
def loss_fn(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
"""


@pytest.mark.slow
def test_the_training_loop_runs_at_world_size_1(tmp_path):
    """The README's Python block, as written, inside a one-rank gloo world; the loss falls."""
    (code,) = [b for b in blocks("python") if "CanzonaOptimizer" in b]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = "\nprint('LOSSES', [float(loss_fn(model(x), y)) for x, y in data[:1]])\n"
    script = PRELUDE.format(port=port) + probe + textwrap.dedent(code) + probe
    path = tmp_path / "readme_loop.py"
    path.write_text(script)
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    before, after = (float(ln.split("[")[1].rstrip("]")) for ln in run.stdout.splitlines()
                     if ln.startswith("LOSSES"))
    assert after < before
