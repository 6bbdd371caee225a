"""The simulator checked against this machine: calibrate, then time and simulate the same steps.

    python benchmarks/bench_model_check.py [--rounds 6] [--write-readme]

In one run:

1. ``canzona.runtime.calibrate`` measures this machine with one thread (the ranks below run one
   thread each): the gloo link between two processes (α, bus bandwidth), the memory bandwidth,
   and Newton–Schulz at the model's own matrix shapes. The profile's fp32 rate is that
   Newton–Schulz rate (FLOP-weighted over the model's matrices), not the large-matmul peak: the
   model's matrices are small, and Muon's kernel is what runs.
2. Two gloo processes (one thread each) run ``benchmarks/bench_dp_step.py``'s model and
   strategies — ``sync`` (DDP all-reduce, every rank updates everything), ``layerwise`` (DDP
   all-reduce, LPT-dealt owners, a padded all-gather) and ``canzona`` (``CanzonaOptimizer``) —
   plus a plain local model (no communication) for the compute-only forward/backward, round by
   round, interleaved, at least 5 rounds.
3. ``canzona.planner.strategies.compare_problem`` simulates ``sc`` (= sync), ``layerwise-lpt``
   (= layerwise, the same LPT dealing; its all-gather ``padded``, as gloo runs it) and
   ``canzona`` (the very plan the runtime ran) on the calibrated profile, with the measured
   compute-only forward/backward.

Compared quantity: the optimizer step including its exposed communication, i.e. iteration −
compute-only forward/backward (measured) against the simulated step (end of backward →
parameters ready), and the whole iteration. The benchmark's own narrow "step" (after
``backward()`` returns, which for DDP is after its all-reduce) is reported too. Nothing is fitted
to the outcome: the profile comes from the calibration alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_dp_step import (VOCAB, Model, free_port, model_arguments, strategies,  # noqa: E402
                           timed_iteration)

STRATEGIES = ("sync", "layerwise", "canzona")
#: The simulated strategy of each measured one (bench_dp_step's layerwise deals by LPT).
SIM_NAME = {"sync": "sc", "layerwise": "layerwise-lpt", "canzona": "canzona"}
SECTION = "## Simulator against this machine"
CRITERION = 0.20  # simulated ratios within 20 % of the measured ones


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    _, opts, fwd = strategies(rank, world, args)
    local = Model(args.dim, args.layers)  # compute only: no hooks, no communication
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, dict[str, list[float]]] = {n: {"step": [], "iter": []} for n in STRATEGIES}
    times["local"] = {"fb": []}

    def batch():
        return torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen)

    def iteration(name: str, record: bool) -> None:
        fb, step = timed_iteration(fwd[name], opts[name], batch())
        if record:
            times[name]["step"].append(step)
            times[name]["iter"].append(fb + step)

    def local_fb(record: bool) -> None:
        fb, _ = timed_iteration(local, None, batch())
        if record:
            times["local"]["fb"].append(fb)

    for name in STRATEGIES:  # warm-up
        iteration(name, False)
    local_fb(False)
    for _ in range(args.rounds):
        for name in STRATEGIES:
            for _ in range(args.iters):
                iteration(name, True)
        for _ in range(args.iters):
            local_fb(True)
    # A step is as slow as its slowest rank: max over ranks, per iteration.
    result: dict = {}
    for name, tt in times.items():
        rec = {}
        for key, vals in tt.items():
            t = torch.tensor(vals, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rec[key] = t.tolist()
        result[name] = rec
    if rank == 0:
        result["plan"] = opts["canzona"].plan.to_json()
        Path(out).write_text(json.dumps(result))
    opts["canzona"].close()
    dist.destroy_process_group()


def _model_shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    from canzona.runtime.introspect import inventory

    spec = inventory(Model(dim, layers))
    return sorted({tuple(p.shape) for p in spec.params if p.optimizer == "matrix"})


def calibrated_profile(args: argparse.Namespace, say) -> tuple[object, dict]:
    """The calibrated profile, its fp32 rate set to Newton–Schulz at the model's shapes."""
    from canzona.planner import formulas
    from canzona.runtime.calibrate import calibrate

    torch.set_num_threads(1)
    shapes = _model_shapes(args.dim, args.layers)
    hw = calibrate(ns_shapes=shapes, progress=say, name="this-machine-1-thread")
    from canzona.runtime.introspect import inventory

    spec = inventory(Model(args.dim, args.layers))
    flops = seconds = 0.0
    for p in spec.params:
        if p.optimizer != "matrix":
            continue
        m, n = p.shape
        f = formulas.muon_flops(m, n)
        rate = hw.calibration[f"newton_schulz_fp32_{m}x{n}_flops_per_s"]
        flops += f
        seconds += f / rate
    ns_rate = flops / seconds
    facts = {"ns_rate": ns_rate, "matmul_fp32": hw.peak_flops["fp32"],
             "memory_bandwidth": hw.memory_bandwidth, "alpha": hw.intra_node.latency_s,
             "busbw": hw.intra_node.busbw, "shapes": shapes}
    rates = dict(hw.peak_flops, fp32=ns_rate, tf32=ns_rate)
    return hw.model_copy(update={"peak_flops": rates, "compute_efficiency": 1.0}), facts


def simulate(res: dict, hw, args: argparse.Namespace) -> dict:
    from canzona.planner import OptimizerSettings, ParallelSizes
    from canzona.planner.plan.load import parse_plan
    from canzona.planner.planning import make_problem
    from canzona.planner.strategies import compare_problem
    from canzona.runtime.introspect import inventory

    plan = parse_plan(res["plan"])
    spec = inventory(Model(args.dim, args.layers))
    problem = make_problem(spec, ParallelSizes(dp=2, tp=1), OptimizerSettings(name="muon"),
                           bucket_size=args.bucket_size)
    fb = statistics.median(res["local"]["fb"])
    comp = compare_problem(problem, hw, strategies=tuple(SIM_NAME.values()), plan=plan,
                           forward_backward_s=fb, matrix_dtype="fp32", adamw_dtype="fp32",
                           gather_method="padded")
    return {k: comp.run(v) for k, v in SIM_NAME.items()}, fb


def _spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [min(xs), 0, max(xs)]
    return f"{statistics.median(xs) * 1e3:.1f} ({q[0] * 1e3:.1f}–{q[2] * 1e3:.1f})"


def render(res: dict, sim: dict, fb: float, facts: dict, args: argparse.Namespace,
           wall: float) -> tuple[str, bool]:
    fb_all = res["local"]["fb"]
    # iteration − the median compute-only forward/backward, per recorded iteration
    meas_step = {n: [i - fb for i in res[n]["iter"]] for n in STRATEGIES}
    med = {n: statistics.median(res[n]["iter"]) - fb for n in STRATEGIES}
    it = {n: statistics.median(res[n]["iter"]) for n in STRATEGIES}
    lines = [
        SECTION, "",
        f"`python benchmarks/bench_model_check.py --rounds {args.rounds}` ({wall:.0f} s: "
        f"calibration, {args.rounds} interleaved rounds × {args.iters} iterations per strategy, "
        f"simulation). {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"gloo, DP = 2, one thread per rank; `bench_dp_step.py`'s model ({args.layers} blocks of "
        f"width {args.dim}, {args.batch}×{args.seq} tokens per rank), Muon with float32 "
        "Newton–Schulz.", "",
        f"Calibrated (one thread): Newton–Schulz at the model's shapes "
        f"{facts['ns_rate'] / 1e9:.1f} GFLOP/s (the profile's fp32 rate; large fp32 matmul "
        f"{facts['matmul_fp32'] / 1e9:.1f}), memory {facts['memory_bandwidth'] / 1e9:.1f} GB/s, "
        f"gloo α {facts['alpha'] * 1e6:.0f} µs and bus bandwidth {facts['busbw'] / 1e9:.2f} GB/s. "
        f"Compute-only forward/backward measured {_spread(fb_all)} ms (median, IQR), given to "
        "the simulator.", "",
        "| strategy | measured iteration ms | measured step incl. exposed comm ms | simulated "
        "step ms | simulated iteration ms | benchmark's own step ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n in STRATEGIES:
        s = sim[n]
        lines.append(f"| {n} | {_spread(res[n]['iter'])} | {_spread(meas_step[n])} | "
                     f"{s.step_s * 1e3:.1f} | {s.iteration_s * 1e3:.1f} | "
                     f"{_spread(res[n]['step'])} |")
    lines += ["", "| ratio | measured | simulated | simulated / measured | within 20 % |",
              "|---|---:|---:|---:|:---:|"]
    ok = True
    for what, a, b in (("step", "canzona", "sync"), ("step", "canzona", "layerwise"),
                       ("iteration", "canzona", "sync"), ("iteration", "canzona", "layerwise")):
        if what == "step":
            m, s = med[a] / med[b], sim[a].step_s / sim[b].step_s
        else:
            m, s = it[a] / it[b], sim[a].iteration_s / sim[b].iteration_s
        good = abs(s / m - 1) <= CRITERION
        ok &= good
        lines.append(f"| {what} {a} / {b} | {m:.3f} | {s:.3f} | {s / m:.2f} | "
                     f"{'yes' if good else '**no**'} |")
    lines += ["", "Measured figures: median over the recorded iterations of the slowest rank "
              "(IQR in brackets); the step incl. exposed comm is each iteration minus the median "
              "compute-only forward/backward. Simulated breakdown (compute / exposed DP reduce / "
              "exposed DP gather, ms): " + "; ".join(
                  f"{n} {b['compute'] * 1e3:.1f} / {b['dp_reduce'] * 1e3:.1f} / "
                  f"{b['dp_gather'] * 1e3:.1f}"
                  for n, b in ((n, sim[n].sim.breakdown()) for n in STRATEGIES)) + "."]
    return "\n".join(lines) + "\n", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(ap, rounds=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.rounds < 5:
        ap.error("--rounds must be at least 5")
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.1f} s] {msg}", file=sys.stderr, flush=True)

    hw, facts = calibrated_profile(args, lambda m: say(f"calibrate: {m}"))
    say("timing the strategies (2 gloo processes)")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        torch.multiprocessing.spawn(worker, args=(2, free_port(), args, out), nprocs=2,
                                    join=True)
        res = json.loads(Path(out).read_text())
    say("simulating")
    sim, fb = simulate(res, hw, args)
    text, ok = render(res, sim, fb, facts, args, time.perf_counter() - t0)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in res.items() if k != "plan"}
                                        | {"facts": facts, "fb": fb}, default=str))
    if args.write_readme:
        readme = HERE / "README.md"
        body = readme.read_text()
        pat = re.compile(rf"{re.escape(SECTION)}\n.*?(?=\n## |\Z)", re.S)
        body = pat.sub(lambda _m: text, body) if pat.search(body) else \
            body.rstrip("\n") + "\n\n" + text
        readme.write_text(body)
    print("within 20 %: " + ("all" if ok else "NOT all"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
