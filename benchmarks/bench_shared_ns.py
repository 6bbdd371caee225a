"""Shared Newton–Schulz on CPU: one matrix orthogonalised by 2 gloo processes against one alone.

    python benchmarks/bench_shared_ns.py [--shapes 4096x1024 2048x2048] [--steps 5] [--reps 3]
                                         [--dtype float32] [--json]

Two processes (``torch.multiprocessing.spawn``, gloo over loopback, one intra-op thread each).
Per shape (rows × cols as stored; a wide one is transposed to its long dimension) and round, in
this order: **alone** — process 0 runs canzona's single-device ``newton_schulz`` on the whole
matrix while process 1 waits in a barrier; **shared** — ``shared_newton_schulz`` with each
process holding half the rows of the oriented matrix (per step one all-reduce of the Gram's
packed upper block rows); **split** — the same with ``split_polynomial=True`` (each process
also forms the upper parts of two block rows of the symmetric bG + cG², one all-gather of them
per step); **pair** — ``shared`` over a ``PeerPair`` (the DP pairs' transport: each Gram exchanged
point to point and summed, no collective). A shared time is the slower process's, from a common
barrier to the end of its call. Round 0 is a warm-up and not reported; reported are the median and
min–max over the other rounds, the achieved GFLOP/s (the single-device FLOP count over the time),
the speed-up alone / shared, the relative difference (Frobenius) of the shared results from the
alone one (the halves gathered on process 0) and of all three from a float64 Newton–Schulz of the
same input. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from canzona.planner import formulas
from canzona.runtime.optim.muon import DEFAULT_COEFFICIENTS, newton_schulz
from canzona.runtime.optim.orientation import orientation
from canzona.runtime.optim.shared_ns import shared_newton_schulz
from canzona.runtime.optim.transports import PeerPair

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
VARIANTS = ("alone", "shared", "split", "pair")
SHARED = VARIANTS[1:]
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rounds(rank: int, shape: tuple[int, int], args: argparse.Namespace) -> dict:
    """Every round of one shape on this process; process 0's dict is the result."""
    dtype = DTYPES[args.dtype]
    sched = (DEFAULT_COEFFICIENTS,) * args.steps
    o = orientation(shape)
    m, n = o.oriented_shape
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    oriented = o.orient(full).contiguous().to(dtype)
    half = (m + 1) // 2
    mine = oriented[:half] if rank == 0 else oriented[half:]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    outs: dict[str, torch.Tensor] = {}
    slowest = torch.zeros(1, dtype=torch.float64)
    for rnd in range(args.reps + 1):
        for v in VARIANTS:
            dist.barrier()
            if v == "alone":
                if rank == 0:
                    t0 = time.perf_counter()
                    outs[v] = newton_schulz(oriented, sched, dtype=dtype)
                    dt = time.perf_counter() - t0
                else:
                    dt = 0.0
            else:
                t0 = time.perf_counter()
                # pair: the DP pairs' transport, point-to-point exchanges on the default group
                group = PeerPair((0, 1), rank) if v == "pair" else None
                outs[v] = shared_newton_schulz(mine, group=group, coefficients=sched,
                                               steps=args.steps, dtype=dtype,
                                               split_polynomial=v == "split",
                                               timeout_s=600, what=f"{shape} {v}")
                dt = time.perf_counter() - t0
            slowest.fill_(dt)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rnd:
                times[v].append(slowest.item())
    # The shared results' halves, gathered on process 0 (equal halves: pad the odd row).
    diffs: dict[str, float] = {}
    whole = {"alone": outs.get("alone")}
    for v in SHARED:
        block = torch.zeros((half, n), dtype=dtype)
        block[:outs[v].shape[0]] = outs[v]
        both = torch.empty((2 * half, n), dtype=dtype)
        _all_gather(both, block)
        whole[v] = both[:m]
    if rank == 0:
        # float64 Newton–Schulz of the same input: how far each result is from exact arithmetic
        f64 = newton_schulz(oriented, sched, dtype=torch.float64)
        for v in SHARED:
            diffs[v] = _rel(whole[v], whole["alone"])
        for v in VARIANTS:
            diffs[f"{v}_vs_f64"] = _rel(whole[v], f64)
    dist.barrier()
    return {"times": times, "diffs": diffs, "m": m, "n": n}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    res = {}
    try:
        for shape in args.shapes:
            res[f"{shape[0]}x{shape[1]}"] = _rounds(rank, shape, args)
    finally:
        if rank == 0:
            torch.save(res, os.path.join(out, "result.pt"))
        dist.destroy_process_group()


def _shape(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxCOLS") from None
    if rows < 2 or cols < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 2 rows (one per process)")
    return rows, cols


def _summary(name: str, r: dict, args: argparse.Namespace) -> dict:
    m, n = r["m"], r["n"]
    flops = formulas.muon_flops(m, n, ns_steps=args.steps)
    elem = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    row: dict = {"shape": name, "oriented": [m, n], "single_device_gflop": flops / 1e9}
    for v in VARIANTS:
        ts = r["times"][v]
        med = statistics.median(ts)
        row[v] = {"median_s": med, "min_s": min(ts), "max_s": max(ts),
                  "gflops": flops / med / 1e9}
    for v in SHARED:
        row[v]["speedup"] = row["alone"]["median_s"] / row[v]["median_s"]
        row[v]["rel_diff"] = r["diffs"][v]
    for v in VARIANTS:
        row[v]["rel_diff_vs_float64"] = r["diffs"][f"{v}_vs_f64"]
        row[v]["bytes_sent_per_rank"] = formulas.shared_ns_bytes(n, 2, steps=args.steps,
                                                        split_polynomial=v == "split",
                                                        element_size=elem)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=_shape,
                        default=[(4096, 1024), (2048, 2048)], help="ROWSxCOLS, as stored")
    parser.add_argument("--steps", type=int, default=5, help="Newton–Schulz steps")
    parser.add_argument("--reps", type=int, default=3, help="measured rounds (after a warm-up)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        torch.multiprocessing.spawn(_worker, args=(_free_port(), out, args), nprocs=2, join=True)
        wall = time.perf_counter() - t0
        res = torch.load(os.path.join(out, "result.pt"), weights_only=False)
    rows = [_summary(name, r, args) for name, r in res.items()]
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "backend": "gloo", "processes": 2,
            "threads_per_process": 1, "dtype": args.dtype, "steps": args.steps,
            "reps": args.reps, "wall_s": wall}
    if args.json:
        json.dump({"meta": meta, "results": rows}, sys.stdout, indent=2)
        print()
        return
    print(f"{meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}, gloo, 2 processes × 1 "
          f"thread, {args.dtype}, {args.steps} Newton–Schulz steps, median (min–max) of "
          f"{args.reps} rounds after a warm-up; {wall:.1f} s in all")
    print()
    print("| shape (oriented) | GFLOP | alone s | shared s | split s | pair s | speed-up shared "
          "| speed-up split | speed-up pair | GFLOP/s alone / shared / split / pair | "
          "shared / split / pair vs alone | alone / shared / split / pair vs float64 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        def cell(v: str) -> str:
            x = r[v]
            return f"{x['median_s']:.3f} ({x['min_s']:.3f}–{x['max_s']:.3f})"

        print(f"| {r['shape']} ({r['oriented'][0]}×{r['oriented'][1]}) | "
              f"{r['single_device_gflop']:.1f} | {cell('alone')} | {cell('shared')} | "
              f"{cell('split')} | {cell('pair')} | {r['shared']['speedup']:.2f}× | "
              f"{r['split']['speedup']:.2f}× | {r['pair']['speedup']:.2f}× | "
              + " / ".join(f"{r[v]['gflops']:.0f}" for v in VARIANTS) + " | "
              + " / ".join(f"{r[v]['rel_diff']:.1e}" for v in SHARED) + " | "
              + " / ".join(f"{r[v]['rel_diff_vs_float64']:.1e}" for v in VARIANTS) + " |")


if __name__ == "__main__":
    main()
