"""Fixtures every test folder shares."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (``derandomize``: a seed from each test's
# source), so CI passes or fails alike on a clean clone; ``HYPOTHESIS_PROFILE=explore`` draws
# fresh ones (how the fuzzers find new bugs: run it now and then, keep what it finds as a case).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Spawned gloo worlds start their ranks from one fork server (``start_method="forkserver"``)
# that imports these once, not once per rank: on two cores that was most of a small world's
# start. (torch only imports them; no thread pool or process group exists before the fork.)
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "canzona",
                                        "canzona.planner", "canzona.runtime"])


def _as_version_1(plan_json: str) -> dict:
    """A schema-2 plan's JSON as its schema-1 dict: no ``comm`` section, no bucket methods, no
    recorded objective (what canzona wrote before plan schema 2)."""
    data = json.loads(plan_json)
    data["schema_version"] = 1
    del data["comm"]
    del data["inputs"]["solver"]["objective"]
    for buf in data["buffers"]:
        for b in buf["buckets"]:
            del b["method"]
    return data


@pytest.fixture
def as_version_1():
    """:func:`_as_version_1`: a plan's JSON text → the schema-1 dict of the same plan."""
    return _as_version_1


@pytest.fixture
def refused_edit(tmp_path):
    """``refused_edit(plan, edit)``: the one-line ``PlanFileError`` that loading ``plan``'s JSON
    after ``edit(data)`` (a change in place) raises (the test fails if it loads)."""
    from canzona.planner.errors import PlanFileError
    from canzona.planner.plan.load import load_plan

    def refuse(plan, edit) -> str:
        data = json.loads(plan.to_json())
        edit(data)
        path = tmp_path / "edited.plan.json"
        path.write_text(json.dumps(data))
        with pytest.raises(PlanFileError) as info:
            load_plan(path)
        return str(info.value)

    return refuse


class _Examples:
    """``examples/<script>`` under torchrun (gloo, one thread per rank) from the repository
    root, as the README runs it; every run must exit 0 without an abort at shutdown."""

    def stdout(self, script: str, nproc: int, *args: str, timeout: float = 300) -> str:
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = Path(__file__).resolve().parents[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), str(root / "examples" / script), *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"exit status {proc.returncode}:\n{out[-3000:]}"
        assert "terminate called" not in out and "ChildFailedError" not in out, out[-3000:]
        return proc.stdout

    def losses(self, script: str, nproc: int, *args: str, timeout: float = 300) -> list[float]:
        """The losses the run printed (at least two)."""
        import re

        out = self.stdout(script, nproc, *args, timeout=timeout)
        losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)", out, re.M)]
        assert len(losses) >= 2, out
        return losses


@pytest.fixture
def examples():
    """:class:`_Examples`: run an example under torchrun."""
    return _Examples()
