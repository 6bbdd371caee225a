"""Never behind the paper's method: the whole sweep behind ``test_never_behind.py``.

    python benchmarks/bench_never_behind.py [--hardware h100] [--quick] [--json FILE]

For each of qwen3-{1.7b,8b,32b} and llama3-{8b,70b}, dp 8–256 × tp 1–8, ``--share off`` and
``auto``, under the roofline cost: ``canzona compare``'s canzona and canzona-greedy rows (one
forward/backward of 6·N_active·tokens at MFU 0.4, all-gathers not overlapped). Prints one line
per configuration, then how many have canzona behind (the planner keeps the shorter simulated
step, so none should), the speed-up greedy / canzona (min, median, max), and how often the
planner kept the greedy plan or the plan sharing nothing (its solver status says so).
Torch-free; about 8 minutes on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

from canzona.planner import DPOptions, ParallelSizes, SizeError, TPOptions
from canzona.planner.strategies import compare

MODELS = ("qwen3-1.7b", "qwen3-8b", "qwen3-32b", "llama3-8b", "llama3-70b")
DPS = (8, 16, 32, 64, 128, 256)
TPS = (1, 2, 4, 8)
SHARES = ("off", "auto")


def run(model: str, dp: int, tp: int, share: str, hardware: str) -> dict | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = compare(model, ParallelSizes(dp=dp, tp=tp), hardware=hardware,
                        dp_options=DPOptions(cost="roofline"),
                        tp_options=TPOptions(share=share, hardware=hardware),
                        strategies=("canzona-greedy", "canzona"))
    except SizeError:
        return None  # sizes the model does not allow
    return {"model": model, "dp": dp, "tp": tp, "share": share,
            "canzona_s": c.run("canzona").sim.step_s,
            "greedy_s": c.run("canzona-greedy").sim.step_s,
            "status": c.plan.metrics.solver_status if c.plan is not None else ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--quick", action="store_true", help="dp 8 and 64, tp 1 and 8 only")
    ap.add_argument("--json", type=Path, help="write every result here")
    args = ap.parse_args(argv)
    dps, tps = ((8, 64), (1, 8)) if args.quick else (DPS, TPS)
    t0 = time.perf_counter()
    rows = []
    for model in MODELS:
        for dp in dps:
            for tp in tps:
                for share in SHARES:
                    r = run(model, dp, tp, share, args.hardware)
                    if r is None:
                        continue
                    rows.append(r)
                    print(f"{model} dp{dp} tp{tp} share {share}: canzona "
                          f"{r['canzona_s'] * 1e3:.3f} ms, greedy {r['greedy_s'] * 1e3:.3f} ms"
                          f"{'  BEHIND' if r['canzona_s'] > r['greedy_s'] else ''}", flush=True)
    behind = [r for r in rows if r["canzona_s"] > r["greedy_s"]]
    ratios = [r["greedy_s"] / r["canzona_s"] for r in rows]
    greedy_kept = sum("the paper's greedy plan" in r["status"] for r in rows)
    unshared_kept = sum("the plan sharing nothing" in r["status"] for r in rows)
    print(f"\n{len(rows)} configurations on {args.hardware} in {time.perf_counter() - t0:.0f} s; "
          f"canzona behind canzona-greedy in {len(behind)}; greedy / canzona: min "
          f"{min(ratios):.3f}×, median {statistics.median(ratios):.3f}×, max {max(ratios):.3f}×; "
          f"the planner kept the paper's greedy plan in {greedy_kept} and the plan sharing "
          f"nothing in {unshared_kept}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if behind else 0


if __name__ == "__main__":
    sys.exit(main())
