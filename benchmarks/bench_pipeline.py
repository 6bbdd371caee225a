"""Pipeline stages, simulated: every strategy's 1F1B iteration next to canzona's, and the
planner's time for a pipeline's plan.

    python benchmarks/bench_pipeline.py                 # the table
    python benchmarks/bench_pipeline.py --write-readme  # and its section of benchmarks/README.md

Cases: qwen3-32b at pp 4 × dp 32 × tp 8 and llama3-70b at pp 8 × dp 32 × tp 8, Muon, on the H800
profile, 4 · pp microbatches (:func:`canzona.planner.strategies.compare_pipeline`: every strategy
on each stage, each stage's optimizer step behind its own last backward, forward and backward
6 · the stage's active parameters · one 4096-token sequence per DP rank at MFU 0.4). Printed per
strategy: the iteration, the optimizer step beyond the forwards and backwards (the slowest
stage's), its ratio to canzona's, and the critical stage. Then the CPU seconds of planning each
case: the planning alone (in this process, after a warm-up), and the whole ``canzona plan --pp``
process (start-up and imports included).
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from canzona.planner import CanzonaWarning, DPOptions, ParallelSizes, TPOptions
from canzona.planner.pipeline import plan
from canzona.planner.stages import StageSplit
from canzona.planner.strategies import compare_pipeline

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
CASES = (("qwen3-32b", 4, 32, 8), ("llama3-70b", 8, 32, 8))
HARDWARE = "h800"
SECTION = "## Pipeline stages, simulated"


def table(model: str, pp: int, dp: int, tp: int) -> list[str]:
    comp = compare_pipeline(model, ParallelSizes(dp=dp, tp=tp), stages=StageSplit(pp=pp),
                            hardware=HARDWARE, dp_options=DPOptions(),
                            tp_options=TPOptions(hardware=HARDWARE))
    base = comp.run("canzona")
    lines = [f"**{model}, pp {pp} × dp {dp} × tp {tp}** ({pp * dp * tp} GPUs, {HARDWARE}, "
             f"{comp.microbatches} microbatches):", "",
             "| strategy | iteration | step beyond the backwards | × canzona | critical stage |",
             "|---|---:|---:|---:|---:|"]
    for name, sim in comp.runs:
        exact = "" if comp.stages[0].run(name).exact else " ✗"
        lines.append(f"| {name}{exact} | {sim.iteration_s * 1e3:.1f} ms | "
                     f"{sim.step_s * 1e3:.1f} ms | {sim.step_s / base.step_s:.2f} | "
                     f"{sim.critical_stage} |")
    return lines


def plan_seconds(model: str, pp: int, dp: int, tp: int) -> float:
    t = time.process_time()
    plan(model, ParallelSizes(dp=dp, tp=tp), stages=StageSplit(pp=pp))
    return time.process_time() - t


def cli_seconds(model: str, pp: int, dp: int, tp: int) -> float:
    """CPU seconds of the whole ``canzona plan`` process (start-up, imports, planning, writing
    the file), as a user runs it."""
    with tempfile.TemporaryDirectory() as folder:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "canzona.cli.main", "plan", "--model", model,
                        "--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "-q", "-o", folder],
                       check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore", CanzonaWarning)  # the plans' notes (oversized matrices)
    lines = [SECTION, "", "`python benchmarks/bench_pipeline.py --write-readme` (modelled, not "
             "measured; ✗: not the exact optimizer):", ""]
    for case in CASES:
        lines += table(*case) + [""]
    plan("qwen3-0.6b", ParallelSizes(dp=2, tp=1), stages=StageSplit(pp=2))  # warm-up
    times = [f"{m} pp {pp} × dp {dp} × tp {tp}: {plan_seconds(m, pp, dp, tp):.2f} s "
             f"(the whole `canzona plan` process {cli_seconds(m, pp, dp, tp):.2f} s)"
             for m, pp, dp, tp in CASES]
    lines += ["CPU seconds of the planning (in this process, after a warm-up): "
              + "; ".join(times) + ".", ""]
    text = "\n".join(lines)
    print(text)
    if args.write_readme:
        old = README.read_text(encoding="utf-8")
        if SECTION in old:
            start = old.index(SECTION)
            end = old.find("\n## ", start + len(SECTION))
            new = old[:start] + text + (old[end:] if end >= 0 else "")
        else:
            new = old.rstrip("\n") + "\n\n" + text
        README.write_text(re.sub(r"\n{3,}", "\n\n", new), encoding="utf-8")


if __name__ == "__main__":
    main()
