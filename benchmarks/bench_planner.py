"""Plan quality and planner time over the dense Qwen3 sweep.

    python benchmarks/bench_planner.py                  # print the table
    python benchmarks/bench_planner.py --write-readme   # also rewrite the "## Planner (DP
                                                        # partition)" section of
                                                        # benchmarks/README.md
    python benchmarks/bench_planner.py --profile        # planning time at scale: the four
                                                        # large cases (add --write-readme for
                                                        # its section, --top N for each case's
                                                        # cProfile, slowest functions first,
                                                        # --against DIR to time an older
                                                        # checkout run by run beside)

For every {qwen3-0.6b … qwen3-32b} × dp {8, 16, 32, 64} × tp {1, 4, 8} (Muon, FLOPs cost, α = 1):
the gap of the busiest DP index's load to the best proven lower bound (max(mean, largest task),
the pigeonhole bound over atomic matrices, or CP-SAT's bound) for ours (the default solver, auto),
the paper's greedy and megatron-core's layer-wise dealing; ZeRO-1's count of split matrices;
the bounds; the solve time. Then the wall time of ``canzona plan --model qwen3-32b --dp 32 --tp 8``
as a separate process (import included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from canzona.planner import OptimizerSettings, ParallelSizes, SizeError, build_inventory, get_preset
from canzona.planner.options import DPOptions
from canzona.planner.pipeline import plan_problem
from canzona.planner.planning import make_problem
from canzona.planner.strategies import baseline_rows

MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
DPS = (8, 16, 32, 64)
TPS = (1, 4, 8)
SECTION = "## Planner (DP partition)"
SCALE_SECTION = "## Planner time at scale"
#: The cases of ``--profile``: (name, ``canzona plan`` arguments, CPU seconds allowed).
SCALE_CASES = (
    ("qwen3-32b dp32 tp8", ("--model", "qwen3-32b", "--dp", "32", "--tp", "8"), 1.5),
    ("llama3-70b dp256 tp8", ("--model", "llama3-70b", "--dp", "256", "--tp", "8"), 5.0),
    ("qwen3-235b-a22b dp64 tp4 ep8",
     ("--model", "qwen3-235b-a22b", "--dp", "64", "--tp", "4", "--ep", "8"), 5.0),
    ("qwen3-8b dp1024 tp1", ("--model", "qwen3-8b", "--dp", "1024", "--tp", "1"), 10.0),
)
README = Path(__file__).resolve().parent / "README.md"
CLI_ARGS = ("plan", "--model", "qwen3-32b", "--dp", "32", "--tp", "8")


def run_case(model: str, dp: int, tp: int) -> dict | None:
    """One sweep case, or None if the sizes are invalid for the model."""
    try:
        problem = make_problem(build_inventory(get_preset(model)), ParallelSizes(dp=dp, tp=tp),
                               OptimizerSettings(name="muon"), cost="flops")
    except SizeError:
        return None
    # The DP partition is what this sweep studies: the compute objective (max-load); the default
    # (step-time) may trade DP-index balance for collectives under TP (its own column).
    plan = plan_problem(problem, dp_options=DPOptions(objective="max-load"), dp_only=True)
    rows = {r.name: r for r in baseline_rows(problem, plan)}  # all against the same certified bound
    t0 = time.perf_counter()
    default = plan_problem(problem, dp_only=True)
    solve_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rplan = plan_problem(problem, dp_options=DPOptions(reorder=False, objective="max-load"),
                         dp_only=True)
    reorder_s = time.perf_counter() - t0
    bound = max(plan.metrics.certified_bound, rplan.metrics.certified_bound,
                default.metrics.certified_bound)
    return {
        "reorder": max(rplan.metrics.dp_load) / bound - 1, "reorder_s": reorder_s,
        "default": max(default.metrics.dp_load) / bound - 1,
        "model": model, "dp": dp, "tp": tp,
        "ours": max(plan.metrics.dp_load) / bound - 1,
        "greedy": rows["canzona-greedy"].max_load / bound - 1,
        "layerwise": rows["layerwise"].max_load / bound - 1,
        "zero1_split": rows["zero1"].split_matrices,
        "lb": plan.metrics.lower_bound, "bound": plan.metrics.certified_bound,
        "status": plan.metrics.solver_status, "solve_s": solve_s,
        "worse": rows["canzona"].max_load > rows["canzona-greedy"].max_load,
    }


def time_cli(repeats: int = 3) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of the whole ``canzona plan`` process, ``repeats`` times."""
    compiled()
    with tempfile.TemporaryDirectory() as tmp:
        return [_child([*_cli(), *CLI_ARGS, "-o", os.path.join(tmp, "p.json")])[:2]
                for _ in range(repeats)]


def compiled() -> None:
    """canzona's bytecode written, as an installed package has it (pip compiles on install):
    the timed processes then do not compile its sources each run (where ``PYTHONDONTWRITEBYTECODE``
    is set, they would)."""
    import compileall

    import canzona

    compileall.compile_dir(os.path.dirname(canzona.__file__), quiet=1)


def _cli() -> list[str]:
    exe = shutil.which("canzona")
    return [exe] if exe else [sys.executable, "-m", "canzona.cli.main"]


def _child(args: list[str], tree: Path | None = None, cwd: str | None = None
           ) -> tuple[float, float, str]:
    """(wall, CPU) seconds and stdout of one child process (``tree``: with that checkout's
    canzona first on the path, run in ``cwd``, not this folder: ``-m`` puts the working folder
    before PYTHONPATH)."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=env,
                         cwd=cwd).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def scale_case(name: str, args: tuple[str, ...], repeats: int, top: int,
               against: Path | None = None) -> dict:
    """One case of ``--profile``: ``repeats`` runs of ``canzona plan`` (default options) and of
    ``canzona inspect`` on its plan, each a process; the plan's file size, load time and
    figures; with ``top``, one in-process cProfile run's slowest functions on stderr. With
    ``against`` (another checkout), each run of this canzona follows one of that checkout's,
    so the two meet the same machine."""
    from canzona.planner.plan.load import load_plan

    old_cli = [sys.executable, "-m", "canzona.cli.main"]
    with tempfile.TemporaryDirectory() as tmp:
        path, old_path = os.path.join(tmp, "p.json"), os.path.join(tmp, "old.json")
        runs, old = [], []
        for _ in range(repeats):
            if against is not None:
                old.append(_child([*old_cli, "plan", *args, "-o", old_path, "--quiet"],
                                  against, tmp)[1])
            runs.append(_child([*_cli(), "plan", *args, "-o", path, "--json", "--quiet"]))
        got = json.loads(runs[-1][2])
        size = os.path.getsize(path)
        loads = []
        for _ in range(repeats):
            t0 = time.process_time()
            load_plan(path)
            loads.append(time.process_time() - t0)
        inspects, old_inspects = [], []
        for _ in range(repeats):
            if against is not None:
                old_inspects.append(_child([*old_cli, "inspect", old_path, "--quiet"],
                                           against, tmp)[1])
            inspects.append(_child([*_cli(), "inspect", path, "--quiet"])[:2])
        if top:
            import cProfile
            import pstats

            from canzona.cli.main import main as cli_main
            prof = cProfile.Profile()
            argv = sys.argv
            sys.argv = ["canzona", "plan", *args, "-o", path, "--quiet"]
            try:
                prof.runcall(cli_main)
            except SystemExit:
                pass
            finally:
                sys.argv = argv
            print(f"--- {name}: the {top} functions with the most time of their own",
                  file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(top)
    tp = got.get("tp_per_gpu") or {}
    return {"name": name, "cpu": [c for _, c, _ in runs], "wall": [w for w, _, _ in runs],
            "old": old, "old_inspect": old_inspects,
            "size": size, "load": loads, "inspect": [c for _, c in inspects],
            "busiest": tp.get("max", got["per_dp_index"]["load"]["max"]),
            "step": (got.get("predicted") or {}).get("step_s"), "status": got["solver_status"]}


def render_scale(cases: list[dict], limits: dict[str, float], against: str | None = None
                 ) -> str:
    med = statistics.median
    lines = [
        SCALE_SECTION, "",
        "Produced by `python benchmarks/bench_planner.py --profile --write-readme"
        + (f" --against WORKTREE_OF_{against}`" if against else "`")
        + f" ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f}). `canzona plan` with the default options "
        "(roofline cost on h100, `--share auto`, solver auto), each run a process, imports "
        "included (canzona's bytecode compiled first, as pip installs it); CPU = user + sys, "
        "the median of the runs (all of them in brackets). "
        "*load* is `canzona.load_plan` of the file (every check), *inspect* the whole "
        "`canzona inspect` process; the busiest GPU's work and the predicted step are the "
        "plan's (roofline loads are nanoseconds). `--top N` prints each case's profile.", "",
        "| case | plan CPU s | limit | wall s | plan file | load s | inspect CPU s | busiest GPU "
        "(ms of work) | predicted step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        step = f"{c['step'] * 1e3:.2f} ms" if c["step"] is not None else "—"
        cpu = f"**{med(c['cpu']):.2f}** ({', '.join(f'{x:.2f}' for x in c['cpu'])})"
        lines.append(
            f"| {c['name']} | {cpu} | {limits[c['name']]:g} | {med(c['wall']):.2f} | "
            f"{c['size'] / 1e6:.2f} MB | {med(c['load']):.2f} | {med(c['inspect']):.2f} | "
            f"{c['busiest'] / 1e6:.3f} | {step} |")
    if against is not None:
        lines += [
            "", f"Run by run against `--against` {against} (each run of this canzona right after "
                "one of that checkout's, so both meet the machine alike), CPU seconds, medians:",
            "", f"| case | plan at {against} | plan now | now / then | inspect at {against} | "
                "inspect now | now / then |", "|---|---:|---:|---:|---:|---:|---:|"]
        for c in cases:
            p, q = med(c["old"]), med(c["cpu"])
            i, j = med(c["old_inspect"]), med(c["inspect"])
            lines.append(f"| {c['name']} | {p:.2f} | {q:.2f} | {q / p:.2f} | {i:.2f} | {j:.2f} "
                         f"| {j / i:.2f} |")
    lines.append("")
    return "\n".join(lines)


def _t(x: float) -> str:
    return f"{x / 1e12:.3f}T" if x >= 1e11 else f"{x / 1e9:.2f}G"


def render(cases: list[dict], cli_s: list[tuple[float, float]], skipped: list[str]) -> str:
    lines = [
        SECTION,
        "",
        "Produced by `python benchmarks/bench_planner.py --write-readme` "
        f"({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}).",
        "Muon, FLOPs cost, α = 1, default sizes of buckets. Gap = busiest DP index's load / "
        "certified bound − 1;",
        "the certified bound is the best proven lower bound (max(mean, largest matrix), the "
        "pigeonhole bound over",
        "whole matrices, or the bin-packing bound — CP-SAT covering over load patterns, which "
        "drops the bucket order and so bounds both columns). *ours* is the default solver (`auto`, "
        "parameters may change places inside their bucket) with the compute objective "
        "(`--objective max-load`: the DP partition is what this table studies), *ours "
        "--no-reorder* keeps Megatron's order inside every bucket, *default* is the default "
        "objective `step-time` (the plan `canzona plan` writes; under TP it may keep a less "
        "balanced DP partition whose busiest GPU is as light and whose collectives are faster: "
        "see the collectives and simulator sections), *greedy* the paper's α-balanced",
        "greedy, *layerwise* megatron-core's layer-wise dealing (`shard_params`: ascending size, "
        "ping-pong; gradients all-reduced, no ZeRO-1 geometry); *zero1 split*",
        "counts the matrices ZeRO-1's equal chunks cut across DP ranks. Loads in optimizer FLOPs "
        "per step.",
        "",
        "| model | dp | tp | ours | ours --no-reorder | default | greedy | layerwise | zero1 split "
        "| LB | certified bound | status | default solve s | no-reorder s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for c in cases:
        mark = " ⚠" if c["worse"] else ""
        lines.append(
            f"| {c['model']} | {c['dp']} | {c['tp']} | {c['ours']:.2%}{mark} | "
            f"{c['reorder']:.2%} | {c['default']:.2%} | {c['greedy']:.2%} | "
            f"{c['layerwise']:.2%} | {c['zero1_split']} | {_t(c['lb'])} | {_t(c['bound'])} | "
            f"{c['status']} | {c['solve_s']:.2f} | {c['reorder_s']:.2f} |")
    gaps = [c["ours"] for c in cases]
    worse = sum(c["worse"] for c in cases)
    lines += [
        "",
        f"Over {len(cases)} cases: ours median gap **{statistics.median(gaps):.2%}**, max "
        f"**{max(gaps):.2%}** (targets: median ≤ 2 %, max ≤ 5 %); worse than the paper's greedy "
        f"in **{worse}** case(s){' (⚠)' if worse else ''}; with `--no-reorder` (Megatron's order) "
        f"median "
        f"**{statistics.median(c['reorder'] for c in cases):.2%}**, max "
        f"**{max(c['reorder'] for c in cases):.2%}**; the default objective (step-time) median "
        f"{statistics.median(c['default'] for c in cases):.2%}, max "
        f"{max(c['default'] for c in cases):.2%} (at tp 1: max "
        f"{max((c['default'] for c in cases if c['tp'] == 1), default=0):.2%}); paper's greedy "
        f"median "
        f"{statistics.median(c['greedy'] for c in cases):.2%}, max "
        f"{max(c['greedy'] for c in cases):.2%}.",
    ]
    if skipped:
        lines.append(f"Skipped (invalid sizes): {', '.join(skipped)}.")
    lines += [
        "",
        f"Planner time, whole process with imports: `canzona {' '.join(CLI_ARGS)}` took "
        + ", ".join(f"{w:.2f}" for w, _ in cli_s)
        + f" s wall ({len(cli_s)} runs; median {statistics.median(w for w, _ in cli_s):.2f} s; "
        "target < 2 s) and "
        + ", ".join(f"{c:.2f}" for _, c in cli_s)
        + f" s of CPU (user + sys; median {statistics.median(c for _, c in cli_s):.2f} s), with "
        f"the load average at {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.",
        "",
    ]
    return "\n".join(lines)


def write_section(text: str, path: Path = README, *, section: str = SECTION) -> None:
    """Replace (or append) our section, leaving every other section as it is."""
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    start = old.find(section)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + len(section))
        tail = old[nxt + 1:] if nxt >= 0 else ""
        new = old[:start] + text + ("\n" + tail if tail else "")
    path.write_text(new, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Planner quality and time over the Qwen3 sweep.")
    ap.add_argument("--write-readme", action="store_true",
                    help=f"rewrite the '{SECTION}' section of {README.name}")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--profile", action="store_true",
                    help="time the four large cases instead (the '" + SCALE_SECTION + "' "
                         "section with --write-readme)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (--profile)")
    ap.add_argument("--top", type=int, default=0,
                    help="--profile: print each case's N slowest functions (cProfile)")
    ap.add_argument("--cases", nargs="*", help="--profile: only these cases (by model name)")
    ap.add_argument("--against", type=Path,
                    help="--profile: another checkout (an older commit's worktree) timed run "
                         "by run beside this one")
    args = ap.parse_args(argv)
    if args.profile:
        picked = [c for c in SCALE_CASES
                  if not args.cases or any(m in c[0] for m in args.cases)]
        compiled()
        against = label = None
        if args.against is not None:
            import compileall

            against = args.against.resolve()
            if not (against / "canzona" / "__init__.py").is_file():
                raise SystemExit(f"--against {args.against}: not a canzona checkout (no "
                                 "canzona/__init__.py there); give an older commit's worktree, "
                                 "e.g. git worktree add /tmp/old COMMIT.")
            compileall.compile_dir(str(against / "canzona"), quiet=1)
            label = subprocess.run(["git", "-C", str(against), "rev-parse", "--short", "HEAD"],
                                   capture_output=True, text=True).stdout.strip() or against.name
        got = []
        for name, cli_args, _ in picked:
            got.append(scale_case(name, cli_args, args.repeats, args.top, against))
            print(f"{name}: CPU {statistics.median(got[-1]['cpu']):.2f} s", file=sys.stderr,
                  flush=True)
        text = render_scale(got, {n: lim for n, _, lim in SCALE_CASES}, label)
        print(text)
        if args.write_readme:
            write_section(text, section=SCALE_SECTION)
        return 0
    cases, skipped = [], []
    for model in args.models:
        for dp in DPS:
            for tp in TPS:
                c = run_case(model, dp, tp)
                if c is None:
                    skipped.append(f"{model} dp{dp} tp{tp}")
                    continue
                cases.append(c)
                print(f"{model:11s} dp={dp:<3d} tp={tp}  ours {c['ours']:7.2%}  greedy "
                      f"{c['greedy']:7.2%}  layerwise {c['layerwise']:7.2%}  {c['solve_s']:.2f} s",
                      file=sys.stderr, flush=True)
    text = render(cases, time_cli(), skipped)
    print(text)
    if args.write_readme:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
