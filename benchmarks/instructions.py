"""Instructions ``canzona plan`` executes, counted by valgrind (callgrind's ``Ir``): a measure of
planning work that repeats exactly from run to run, where CPU time on a shared machine varies by
tens of percent.

    python benchmarks/instructions.py qwen3-32b --dp 32 --tp 8             # this checkout
    python benchmarks/instructions.py qwen3-32b --dp 32 --tp 8 --tree DIR  # another checkout

The process runs ``python -m canzona.cli.main plan --model M … --quiet`` under valgrind, with
canzona's bytecode compiled first and ``PYTHONHASHSEED=0``; ``--tree`` puts another checkout's
``canzona`` first on the path (an older commit, to compare). Valgrind slows Python about 50×:
qwen3-32b takes minutes. Needs ``valgrind`` on the PATH.
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


def instructions(model: str, sizes: list[str], tree: Path) -> int:
    """Instructions (``Ir``) of one ``canzona plan`` process for ``model`` at ``sizes`` (CLI
    flags), with ``tree``'s canzona."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on the PATH; install it (apt install valgrind).")
    compileall.compile_dir(str(tree / "canzona"), quiet=1)
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             "-m", "canzona.cli.main", "plan", "--model", model, *sizes,
             "-o", os.path.join(tmp, "p.json"), "--quiet"],
            env=env, capture_output=True, text=True, check=True, cwd=tmp)  # (not this
        # folder: ``-m`` puts the working folder before PYTHONPATH)
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
    args = ap.parse_args(argv)
    sizes = ["--dp", args.dp, "--tp", args.tp, "--ep", args.ep]
    n = instructions(args.model, sizes, args.tree.resolve())
    print(f"{args.model} dp{args.dp} tp{args.tp} ep{args.ep}: {n / 1e9:.2f} G instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
