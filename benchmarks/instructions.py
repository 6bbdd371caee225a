"""Instructions ``canzona plan`` executes, counted by valgrind (callgrind's ``Ir``): a measure of
planning work that repeats exactly from run to run, where CPU time on a shared machine varies by
tens of percent.

    python benchmarks/instructions.py qwen3-32b --dp 32 --tp 8             # this checkout
    python benchmarks/instructions.py qwen3-32b --dp 32 --tp 8 --tree DIR  # another checkout
    python benchmarks/instructions.py qwen3-32b --dp 32 --tp 8 --inspect   # canzona inspect

The process runs ``python -m canzona.cli.main plan --model M … --quiet`` under valgrind, with
canzona's bytecode compiled first and ``PYTHONHASHSEED=0``; ``--tree`` puts another checkout's
``canzona`` first on the path (an older commit, to compare). ``--inspect`` counts ``canzona
inspect PLAN --quiet`` instead, of the plan that the same command makes first (not counted).
Valgrind slows Python about 50×: qwen3-32b takes minutes. Needs ``valgrind`` on the PATH.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def instructions(model: str, sizes: list[str], tree: Path, *, inspect: bool = False) -> int:
    """Instructions (``Ir``) of one ``canzona plan`` process for ``model`` at ``sizes`` (CLI
    flags), with ``tree``'s canzona; ``inspect``: of ``canzona inspect`` of that plan."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on the PATH; install it (apt install valgrind).")
    if not (tree / "canzona" / "__init__.py").is_file():  # else the installed one would run
        raise SystemExit(f"--tree {tree}: not a canzona checkout (no canzona/__init__.py "
                         "there); give an older commit's worktree, e.g. git worktree add "
                         "/tmp/old COMMIT.")
    compileall.compile_dir(str(tree / "canzona"), quiet=1)
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)}
    cli = [sys.executable, "-m", "canzona.cli.main"]
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    with tempfile.TemporaryDirectory() as tmp:
        plan = os.path.join(tmp, "p.json")
        make = [*cli, "plan", "--model", model, *sizes, "-o", plan, "--quiet"]
        # (the working folder is not this one: ``-m`` puts it before PYTHONPATH)
        if inspect:
            subprocess.run(make, env=env, capture_output=True, check=True, cwd=tmp)
        out = subprocess.run([*valgrind, *cli, "inspect", plan, "--quiet"] if inspect
                             else [*valgrind, *make],
                             env=env, capture_output=True, text=True, check=True, cwd=tmp)
    got = re.search(r"Collected : (\d+)", out.stderr)
    if got is None:
        raise SystemExit(f"valgrind printed no count:\n{out.stderr[-2000:]}")
    return int(got.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dp", default="1")
    ap.add_argument("--tp", default="1")
    ap.add_argument("--ep", default="1")
    ap.add_argument("--tree", type=Path, default=ROOT,
                    help="the checkout whose canzona runs (default: this one)")
    ap.add_argument("--inspect", action="store_true",
                    help="count canzona inspect of the plan instead of canzona plan")
    args = ap.parse_args(argv)
    sizes = ["--dp", args.dp, "--tp", args.tp, "--ep", args.ep]
    n = instructions(args.model, sizes, args.tree.resolve(), inspect=args.inspect)
    what = "inspect of " if args.inspect else ""
    print(f"{what}{args.model} dp{args.dp} tp{args.tp} ep{args.ep}: {n / 1e9:.2f} G "
          "instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
