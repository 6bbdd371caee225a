"""Beyond whole matrices: plans whose TP groups share the heaviest Muon matrices against
whole-matrix plans, side by side on one model and cluster (torch-free, modelled).

    python benchmarks/bench_sharing.py [--hardware h800] [--json]

Per configuration, three plans: **canzona-greedy** (the paper: α-greedy DP cuts, TP greedy),
**canzona** (``--share off``: every TP-split matrix hosted whole) and **canzona --share auto**
(the planner shares matrices over their TP group; at tp 1 over DP pairs), and at tp > 1 the
last again with ``--objective max-load`` (the compute alone, where the default step-time also
weighs the bucket collectives the placement changes). Then Shampoo at tp 1:
whole matrices against block rows hosted by two DP ranks, and at tp > 1 hosted against
preconditioned shard by shard (where every shard is whole blocks). For each: the busiest GPU's load
over the mean useful work per GPU (every task's single-device cost once; a shared task's Gram
all-reduces, which each rank waits for in turn, count in the busiest GPU's load), the bounds (the
atomic LB, the bound with sharing over TP groups, a TP group with a second DP index, and DP
pairs/quads, ``planner.sharing``), and the simulated optimizer step's compute path (compute +
exposed TP gather/scatter of the critical rank, ``canzona simulate``, no backward to hide the DP
collectives behind, so they are left out: they are the same buckets in all three). Ratios: greedy /
shared of that path.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

from canzona.planner import DPOptions, ParallelSizes, TPOptions
from canzona.planner.hardware import load_hardware
from canzona.planner.pipeline import plan
from canzona.planner.plan.inverse import read_problem
from canzona.planner.report import pairs_dict, useful_mean
from canzona.planner.sharing import sharing_bound
from canzona.planner.simulate import simulate_plan

#: The FLOPs cost the tables below were measured under (the default is the roofline cost).
FLOPS = DPOptions(cost="flops")
CONFIGS = [("qwen3-32b", 32, 8), ("qwen3-8b", 64, 1), ("qwen3-32b", 128, 8),
           ("llama3-70b", 256, 8), ("qwen3-8b", 256, 1), ("qwen3-8b", 1024, 1)]
#: Shampoo at tp 1: blocks hosted by two DP ranks (``--share auto``) against whole matrices
SHAMPOO = [("qwen3-8b", 64), ("qwen3-8b", 256)]
#: Shampoo at tp > 1: blocks preconditioned shard by shard (``--share all``) against hosting
SHAMPOO_TP = [("qwen3-8b", 64, 4), ("qwen3-8b", 256, 4), ("qwen3-32b", 32, 8)]


def _row(p, hw) -> dict:
    b = simulate_plan(p, hw).breakdown()
    if p.tp is not None:
        mx, mean = p.tp.metrics.max_gpu_load, useful_mean(p)
        shared = sum(len(ix.shared) for ix in p.tp.indices)
    else:  # tp 1: DP pairs' pieces in lockstep, as the runtime runs them (pieces and exchanges
        # are in dp_load); the mean is the useful work
        pairs = pairs_dict(p)
        mx = pairs["run_max_over_useful_mean"] * pairs["useful_mean_load"] if pairs else \
            max(p.metrics.dp_load)
        mean = pairs["useful_mean_load"] if pairs else sum(p.metrics.dp_load) / p.inputs.dp
        shared = len(p.dp_shared)
    return {"max_over_useful_mean": round(mx / mean, 4), "path_ms": round(
        (b["compute"] + b["tp_gather_scatter"]) * 1e3, 2), "shared": shared,
        "dp_collectives_ms": round(p.comm.predicted_s * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    hw = load_hardware(args.hardware)
    out = []
    warnings.simplefilter("ignore")  # oversized-task notes of the whole-matrix plans
    for model, dp, tp in CONFIGS:
        t0 = time.perf_counter()
        sizes = ParallelSizes(dp=dp, tp=tp)
        greedy = plan(model, sizes, dp_options=DPOptions(solver="greedy", cost="flops"),
                      tp_options=TPOptions(hardware=args.hardware, share="off"))
        whole = plan(model, sizes, dp_options=FLOPS,
                     tp_options=TPOptions(hardware=args.hardware, share="off"))
        shared = plan(model, sizes, dp_options=FLOPS,
                      tp_options=TPOptions(hardware=args.hardware, share="auto"))
        bound = sharing_bound(read_problem(whole, model=True).problem, hardware=hw)
        rows = {"canzona-greedy": _row(greedy, hw), "canzona": _row(whole, hw),
                "canzona --share auto": _row(shared, hw)}
        # the compute alone decides (the default weighs the DP collectives too)
        rows["canzona --share auto --objective max-load"] = _row(plan(
            model, sizes, dp_options=DPOptions(objective="max-load", cost="flops"),
            tp_options=TPOptions(hardware=args.hardware, share="auto")), hw)
        out.append({"model": model, "dp": dp, "tp": tp, "rows": rows,
                    "atomic_lb": round(bound.atomic_ratio, 4),
                    "shared_lb": round(bound.shared_ratio, 4),
                    "greedy_over_shared_path": round(rows["canzona-greedy"]["path_ms"]
                                                     / rows["canzona --share auto"]["path_ms"], 3),
                    "seconds": round(time.perf_counter() - t0, 1)})
    blocks = []
    for model, dp in SHAMPOO:
        sizes = ParallelSizes(dp=dp, tp=1)
        rows = {s: _row(plan(model, sizes, "shampoo", dp_options=FLOPS,
                             tp_options=TPOptions(hardware=args.hardware, share=s)), hw)
                for s in ("off", "all", "auto")}
        blocks.append({"model": model, "dp": dp, "rows": rows})
    shards = []
    for model, dp, tp in SHAMPOO_TP:
        sizes = ParallelSizes(dp=dp, tp=tp)
        rows = {s: _row(plan(model, sizes, "shampoo", dp_options=FLOPS,
                             tp_options=TPOptions(hardware=args.hardware, share=s)), hw)
                for s in ("off", "all", "auto")}
        rows["all max-load"] = _row(plan(model, sizes, "shampoo",
                                         dp_options=DPOptions(objective="max-load", cost="flops"),
                                         tp_options=TPOptions(hardware=args.hardware,
                                                              share="all")), hw)
        shards.append({"model": model, "dp": dp, "tp": tp, "rows": rows})
    if args.json:
        print(json.dumps({"hardware": args.hardware, "configs": out, "shampoo": blocks,
                          "shampoo_tp": shards}, indent=2))
        return
    print(f"hardware {args.hardware}; max/mean: busiest GPU over the mean useful work per GPU; "
          "path: simulated compute + TP of the critical rank, ms")
    print(f"{'config':26} {'atomic LB':>9} {'share LB':>8} | {'greedy':>15} | {'canzona':>15} | "
          f"{'--share auto':>21} | greedy/shared path")
    for c in out:
        r = c["rows"]
        cells = [f"{r[k]['max_over_useful_mean']:6.3f} {r[k]['path_ms']:7.1f}"
                 for k in ("canzona-greedy", "canzona")]
        s = r["canzona --share auto"]
        name = f"{c['model']} dp{c['dp']} tp{c['tp']}"
        print(f"{name:26} {c['atomic_lb']:9.3f} {c['shared_lb']:8.3f}"
              f" | {cells[0]:>15} | {cells[1]:>15} | {s['max_over_useful_mean']:6.3f} "
              f"{s['path_ms']:7.1f} ({s['shared']:3d}) | {c['greedy_over_shared_path']:.2f}×")
    print("\n--share auto, default objective (step-time) against --objective max-load (the compute "
          "alone): max/mean, path ms, the bucket collectives `canzona plan` predicts per iteration")
    for c in out:
        r = c["rows"]
        if "canzona --share auto --objective max-load" not in r:
            continue
        cells = [f"{x['max_over_useful_mean']:6.3f} {x['path_ms']:6.1f} "
                 f"{x['dp_collectives_ms']:7.1f} ms"
                 for x in (r["canzona --share auto"],
                           r["canzona --share auto --objective max-load"])]
        name = f"{c['model']} dp{c['dp']} tp{c['tp']}"
        print(f"{name:26} step-time {cells[0]} | max-load {cells[1]}")
    print("\nShampoo, tp 1: whole matrices against block rows hosted by two DP ranks (--share "
          "all; max/mean, path ms, DP collectives ms, matrices split), and what --share auto "
          "keeps under the default step-time objective")
    for c in blocks:
        off, every, auto = (c["rows"][k] for k in ("off", "all", "auto"))
        print(f"{c['model']} dp{c['dp']:<5} whole {off['max_over_useful_mean']:6.3f} "
              f"{off['path_ms']:5.1f} {off['dp_collectives_ms']:7.1f} | blocks apart "
              f"{every['max_over_useful_mean']:6.3f} {every['path_ms']:5.1f} "
              f"{every['dp_collectives_ms']:7.1f} ({every['shared']:3d}) | auto keeps "
              f"{'blocks apart' if auto['shared'] else 'whole matrices'}")
    print("\nShampoo, tp > 1: whole matrices hosted against blocks preconditioned shard by shard "
          "(--share all; max/mean, path ms, DP collectives ms, matrices shared; again with "
          "--objective max-load), and what --share auto keeps under the default step-time "
          "objective")
    for c in shards:
        off, every, auto, ml = (c["rows"][k] for k in ("off", "all", "auto", "all max-load"))
        name = f"{c['model']} dp{c['dp']} tp{c['tp']}"
        print(f"{name:22} hosted {off['max_over_useful_mean']:6.3f} {off['path_ms']:6.2f} "
              f"{off['dp_collectives_ms']:6.1f} | shard blocks "
              f"{every['max_over_useful_mean']:6.3f} "
              f"{every['path_ms']:6.2f} {every['dp_collectives_ms']:6.1f} ({every['shared']:3d}) | "
              f"max-load {ml['max_over_useful_mean']:6.3f} {ml['path_ms']:6.2f} "
              f"{ml['dp_collectives_ms']:6.1f} | auto keeps "
              f"{'shard blocks' if auto['shared'] else 'hosting'}")


if __name__ == "__main__":
    main()
