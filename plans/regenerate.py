"""Regenerate the example plans in this folder (and its README index), byte for byte.

    python plans/regenerate.py            # rewrite every plan and plans/README.md
    python plans/regenerate.py --check    # exit 1 if a committed file differs

Each plan is what ``canzona plan --model M --dp D --tp T`` writes with the defaults (Muon, α = 1,
roofline cost on h100, sharing auto, solver auto). Plans hold no wall-clock time, so identical
code gives identical bytes.

``--check`` also loads ``plans/old/``: one file of every older plan schema version this canzona
reads (:func:`old_versions_problems`), never rewritten.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from canzona.planner import ParallelSizes, PlanFileError
from canzona.planner.pipeline import plan
from canzona.planner.plan import BASE_VERSION, SCHEMA_VERSION, Plan, save_plan
from canzona.planner.plan.convert import OLDEST_VERSION
from canzona.planner.plan.load import load_plan
from canzona.planner.planning import default_plan_name

HERE = Path(__file__).resolve().parent
#: One plan file of every older schema version (``NAME-vN.plan.json``), kept as written.
OLD = HERE / "old"
MODELS = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
SIZES = ((32, 8), (16, 8), (32, 4))  # the paper's (dp, tp)
CASES = tuple((m, dp, tp) for m in MODELS for dp, tp in SIZES)


def plan_name(model: str, dp: int, tp: int) -> str:
    return default_plan_name(model, ParallelSizes(dp=dp, tp=tp), "muon")


def build(model: str, dp: int, tp: int) -> Plan:
    """The plan ``canzona plan --model model --dp dp --tp tp`` makes with default options."""
    return plan(model, ParallelSizes(dp=dp, tp=tp), "muon")  # TP: C_max 512 MiB, greedy


def index(plans: dict[str, Plan]) -> str:
    """plans/README.md: what each file is and how balanced it is."""
    lines = [
        "# Example plans",
        "",
        "Written by `python plans/regenerate.py` (do not edit; re-run it after a planner change).",
        "Each is `canzona plan --model M --dp D --tp T` with the defaults: Muon, α = 1, "
        "roofline cost on",
        "h100 (loads in seconds), `--share auto`, solver `auto`. Read one with "
        "`canzona inspect plans/FILE`.",
        "",
        "| plan | GPUs | max/mean load | gap to certified bound | max/mean state | status |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, p in plans.items():
        m = p.metrics
        st = m.dp_state_bytes
        lines.append(f"| `{name}` | {p.inputs.dp * p.inputs.tp} | {m.max_over_mean:.4f} | "
                     f"{m.gap_to_bound:.2%} | {max(st) / (sum(st) / len(st)):.3f} | "
                     f"{m.solver_status} |")
    return "\n".join(lines) + "\n"


def old_versions_problems() -> list[str]:
    """What is wrong with ``plans/old/`` (nothing: an empty list): every schema version from the
    oldest read to the one before the newest has a file there, and each loads with every check
    (:func:`canzona.planner.plan.load.load_plan`): a version-1 file converted to version
    2 (``comm.converted_from = 1``), a newer one as itself, saving byte for byte as read."""
    problems = []
    found: dict[int, Path] = {}
    for path in sorted(OLD.glob("*.plan.json")):
        m = re.search(r"-v(\d+)\.plan\.json$", path.name)
        if m is None:
            problems.append(f"plans/old/{path.name}: not named NAME-vN.plan.json")
            continue
        found[int(m.group(1))] = path
    for version in range(OLDEST_VERSION, SCHEMA_VERSION):
        if version not in found:
            problems.append(f"plans/old: no file of schema version {version} (NAME-v{version}"
                            f".plan.json)")
    for version, path in sorted(found.items()):
        where = f"plans/old/{path.name}"
        try:
            p = load_plan(path)
        except PlanFileError as exc:
            problems.append(f"{where}: does not load: {exc}")
            continue
        if version < BASE_VERSION:
            if (p.schema_version, p.comm.converted_from) != (BASE_VERSION, version):
                problems.append(f"{where}: loads as version {p.schema_version} with "
                                f"comm.converted_from {p.comm.converted_from}, not as version "
                                f"{BASE_VERSION} converted from {version}")
        elif p.schema_version != version or p.to_json() != path.read_text(encoding="utf-8"):
            problems.append(f"{where}: does not load as the version-{version} plan it is "
                            f"(schema_version {p.schema_version}, or other text when saved)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the files; write nothing")
    args = ap.parse_args(argv)
    plans = {plan_name(*c): build(*c) for c in CASES}
    files = {name: p.to_json() for name, p in plans.items()}
    files["README.md"] = index(plans)
    stale = []
    for name, text in files.items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        elif name.endswith(".json"):
            save_plan(plans[name], path)
        else:
            path.write_text(text, encoding="utf-8")
    if args.check:
        for name in stale:
            print(f"stale: plans/{name}", file=sys.stderr)
        if stale:
            print("run: python plans/regenerate.py", file=sys.stderr)
        old = old_versions_problems()
        for problem in old:
            print(problem, file=sys.stderr)
        return 1 if stale or old else 0
    print(f"wrote {len(files)} files to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
