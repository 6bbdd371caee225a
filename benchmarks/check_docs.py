"""Check that the figures the README and docs/ quote are what the benchmarks produce.

    python benchmarks/check_docs.py            # exit 1 on a mismatch, naming figure and source

Every quoted result carries a marker right after its number, ``0.954× <!-- fig:ID -->``, and
``benchmarks/figures.json`` maps each ID to the script that produces it and how to read its
value. This script recomputes the cheap ones (the planner and the simulator: about 10 s), reads
the GPU figures from the raw runs kept in ``benchmarks/results/``, and compares each with the
number written before its marker, as formatted there (ranges ``lo–hi`` as min and max). It also
fails on a number in the figure column of the README's *Results* table that carries no marker,
and on a marker whose ID ``figures.json`` does not know. CI runs it (``tests/test_check_docs.py``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FIGURES = ROOT / "benchmarks" / "figures.json"
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a number (or a range lo–hi), an optional unit glued or after one space, then the marker
MARKED = re.compile(r"(\d[\d.,]*(?:e-?\d+)?(?:–\d[\d.,]*(?:e-?\d+)?)?)\s?[^\s<|]*\s*"
                    r"<!-- fig:([\w-]+) -->")
MARKER = re.compile(r"<!-- fig:([\w-]+) -->")


def _paper() -> dict[str, float]:
    import bench_compare

    lw, cz = bench_compare.paper_steps(bench_compare.paper("h800"))
    return {"layerwise_step": lw, "canzona_step": cz}


def _paper_constants() -> dict[str, float]:
    import bench_compare

    return dict(bench_compare.PAPER)


def _plan() -> dict[str, float]:
    from canzona.planner import DPOptions, OptimizerSettings, ParallelSizes, TPOptions
    from canzona.planner.pipeline import plan
    from canzona.planner.report import useful_mean

    split = OptimizerSettings(name="muon", split_qkv=True, split_gate_up=True)
    flops = DPOptions(cost="flops")
    variants = {"off": ("muon", None, TPOptions(share="off")),
                "off-flops": ("muon", flops, TPOptions(share="off")),
                "auto": ("muon", None, TPOptions(share="auto")),
                "auto-h800": ("muon", None, TPOptions(share="auto", hardware="h800")),
                "split": (split, flops, TPOptions(share="off"))}
    out = {}
    for key, (settings, dp_options, options) in variants.items():
        p = plan("qwen3-32b", ParallelSizes(dp=32, tp=8), settings, dp_options=dp_options,
                 tp_options=options)
        assert p.tp is not None
        out[key] = p.tp.metrics.max_gpu_load / useful_mean(p)
    return out


def _gpu() -> dict[str, tuple[float, float]]:
    """(min, max) of each figure over every recorded H200 run."""
    values: dict[str, list[float]] = {}
    for path in sorted(RESULTS.glob("gpu_check-h200-*.json")):
        s = json.loads(path.read_text())["sections"]
        for row in s["newton_schulz"]["rows"]:
            values.setdefault("ns_tflops", []).append(row["ns_tflops"])
            values.setdefault("ns_of_peak", []).append(row["ns_of_peak"])
        for key in ("max_rel_diff_vs_cpu", "max_rel_diff_between_methods"):
            values.setdefault(key, []).append(s["runtime"][key])
    return {k: (min(v), max(v)) for k, v in values.items()}


def _fsdp2() -> dict[str, float]:
    import bench_fsdp2

    return bench_fsdp2.figures()


def _sub_groups() -> dict[str, float]:
    """llama3-70b dp256 tp8 on the H800 profile (``--cost flops``, as the sharing tables):
    the busiest GPU and the certified floor with any sharing option, over the mean useful
    work."""
    from canzona.planner import DPOptions, ParallelSizes, TPOptions
    from canzona.planner.hardware import load_hardware
    from canzona.planner.pipeline import plan
    from canzona.planner.plan.inverse import read_problem
    from canzona.planner.report import useful_mean
    from canzona.planner.sharing import pattern_bound

    p = plan("llama3-70b", ParallelSizes(dp=256, tp=8), dp_options=DPOptions(cost="flops"),
             tp_options=TPOptions(hardware="h800"))
    assert p.tp is not None
    mean = useful_mean(p)
    busiest = p.tp.metrics.max_gpu_load
    floor = pattern_bound(read_problem(p, model=True).problem, load_hardware("h800"), busiest)
    assert floor is not None
    return {"busiest": busiest / mean, "floor": floor.bound / mean}


SOURCES: dict[str, Callable[[], dict[str, Any]]] = {
    "paper": _paper, "paper_constants": _paper_constants, "plan": _plan, "gpu": _gpu,
    "fsdp2": _fsdp2, "sub_groups": _sub_groups}


def expected(spec: dict[str, Any], value: Any) -> str:
    """The figure as the docs must write it."""
    scale = spec.get("scale", 1)
    fmt = spec["format"]
    if spec.get("range"):
        lo, hi = value
        return f"{fmt.format(lo * scale)}–{fmt.format(hi * scale)}"
    if isinstance(value, tuple):  # the largest of the runs
        value = value[1]
    return re.sub(r"e([+-]?)0*(\d)", lambda m: f"e{m[1].replace('+', '')}{m[2]}",
                  fmt.format(value * scale))


def unmarked_results(text: str) -> list[str]:
    """Numbers in the figure column (the second) of the README's Results table without a
    marker."""
    section = text.split("## Results", 1)[-1].split("\n## ", 1)[0]
    bad = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or set(line) <= set("|-: "):
            continue
        figure = MARKER.sub("", MARKED.sub("", cells[2]))
        if re.search(r"\d", figure):
            bad.append(cells[2].strip())
    return bad[1:] if bad and "figure" in bad[0] else bad


#: Each source's figures, computed once per process (a source plans or simulates models).
_COMPUTED: dict[str, dict[str, Any]] = {}


def check() -> list[str]:
    specs = json.loads(FIGURES.read_text())
    computed = _COMPUTED
    problems = []
    for page in PAGES:
        text = page.read_text()
        rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
        written = {fid: number for number, fid in MARKED.findall(text)}
        for fid in MARKER.findall(text):
            spec = specs.get(fid)
            if spec is None:
                problems.append(f"{rel}: fig:{fid} is not in {FIGURES.name}")
                continue
            if spec["source"] not in computed:
                computed[spec["source"]] = SOURCES[spec["source"]]()
            value = computed[spec["source"]][spec["key"]]
            if spec.get("text") is False:  # a statement, not a number: the value must be 0
                low = value[1] if isinstance(value, tuple) else value
                if low != 0:
                    problems.append(f"{rel}: fig:{fid} states {spec['what']!r}, but the source "
                                    f"gives {low!r} ({spec['script']})")
                continue
            want = expected(spec, value)
            got = written.get(fid)
            if got != want:
                problems.append(f"{rel}: fig:{fid} reads {got!r} where {spec['script']} gives "
                                f"{want!r} ({spec['what']})")
        if page.name == "README.md":
            problems += [f"README.md: a Results figure without a marker: {c!r}"
                         for c in unmarked_results(text)]
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print("every quoted figure matches its source" if not problems
          else f"{len(problems)} figure(s) disagree")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
