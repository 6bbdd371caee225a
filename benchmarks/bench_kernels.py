"""Batched Muon against a per-matrix loop, side by side in one run.

For each case (a stack of same-shape matrices, the Newton–Schulz dtype) it times

* ``batched``: one ``Muon.direction`` call on all matrices (stacked, ``bmm``/``baddbmm``);
* ``loop``: one ``Muon.direction`` call per matrix (``mm``/``addmm``), what a runtime that does
  not group by shape would do;

interleaving the two (alternating repetitions) so machine noise hits both alike, and reports the
best time of the repetitions (the least disturbed by other load on a shared machine), the speed-up, and achieved FLOP/s (``canzona.planner._flops.muon_flops``) against a
plain large square matmul in the same dtype on the same machine.

Usage::

    python benchmarks/bench_kernels.py [--repeats 7] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canzona.planner._flops import muon_flops  # noqa: E402
from canzona.runtime.optim import Muon, MuonConfig  # noqa: E402

CASES = [(64, 128, 384), (16, 512, 1536)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_peak(dtype: torch.dtype, size: int, repeats: int) -> float:
    """FLOP/s of one square ``size``³ matmul in ``dtype`` (best of ``repeats``)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    a @ b  # warm-up
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def bench_case(count: int, m: int, n: int, dtype: torch.dtype, repeats: int) -> dict:
    opt = Muon(MuonConfig(ns_dtype=dtype))
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(m, n, generator=gen) for _ in range(count)]
    states_b = [opt.init_state((m, n)) for _ in range(count)]
    states_l = [opt.init_state((m, n)) for _ in range(count)]

    def batched():
        opt.direction(grads, states_b)

    def loop():
        for g, s in zip(grads, states_l):
            opt.direction([g], [s])

    batched(), loop()  # warm-up
    tb, tl = [], []
    for _ in range(repeats):
        tb.append(_time(batched))
        tl.append(_time(loop))
    flops = count * muon_flops(m, n, ns_steps=opt.config.ns_steps)
    b, l = min(tb), min(tl)
    spread = max(statistics.median(tb) / b, statistics.median(tl) / l)
    return {"batched_s": b, "loop_s": l, "speedup": l / b, "flops": flops, "spread": spread}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="2 repetitions (smoke test)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats

    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, best of {repeats} (median/best in the last column)")
    peaks = {name: matmul_peak(dt, 1024, max(3, repeats)) for name, dt in DTYPES.items()}
    for name, peak in peaks.items():
        print(f"# plain 1024³ matmul, {name}: {peak / 1e9:.1f} GFLOP/s")
    print()
    print("| matrices | NS dtype | loop (ms) | batched (ms) | speed-up | loop GFLOP/s | batched GFLOP/s "
          "| batched / plain matmul | noise |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for count, m, n in CASES:
        for name, dt in DTYPES.items():
            r = bench_case(count, m, n, dt, repeats)
            fb, fl = r["flops"] / r["batched_s"], r["flops"] / r["loop_s"]
            print(
                f"| {count} × {m}×{n} | {name} | {r['loop_s'] * 1e3:.1f} | {r['batched_s'] * 1e3:.1f} "
                f"| {r['speedup']:.2f}× | {fl / 1e9:.1f} | {fb / 1e9:.1f} | {fb / peaks[name]:.0%} "
                f"| {r['spread']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
