"""Measuring this machine: a hardware profile for the cost model and the simulator.

``calibrate()`` times, on the current device (CUDA when available, else the CPU):

* matmul throughput per dtype (fp32, bf16) over a few square and rectangular shapes, up to
  8192³ on CUDA — the best achieved FLOP/s is the profile's ``peak_flops`` (with
  ``compute_efficiency`` = 1: measured rates are already achieved rates);
* Muon's Newton–Schulz (``canzona.runtime.optim.muon.newton_schulz``, the kernel the runtime runs)
  per shape, as achieved FLOP/s of ``canzona.planner.formulas.muon_flops``; and ``eigh`` / QR
  seconds per size (Shampoo's and SOAP's work) — both kept in ``calibration``;
* memory bandwidth (a large copy: read + write);
* the collective link, with two local processes over gloo (NCCL when two GPUs are visible):
  ``all_reduce`` of a small message gives α, ``all_gather_into_tensor`` of a large one the bus
  bandwidth, busbw = (R−1)/R · S / (t − α). One machine has one link: it is
  both ``intra_node`` and ``inter_node``.

Timings take the best of a few repetitions after a warm-up; on CUDA each is bracketed by
``torch.cuda.synchronize()``. ``quick=True`` uses tiny shapes and few repetitions (seconds), for
tests. Needs torch; the planner and the simulator only read the profile it writes.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canzona.planner import formulas
from canzona.planner.hardware import HardwareProfile, LinkProfile
from canzona.runtime.optim.muon import DEFAULT_COEFFICIENTS, newton_schulz

__all__ = ["calibrate"]

# torch ≥ 2.10 renamed the tensor collectives (the old names warn).
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Best wall time of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _matmul_rates(device: torch.device, quick: bool, reps: int) -> dict[str, float]:
    shapes = [(256, 256, 256), (512, 128, 512)] if quick else \
        [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 4096), (1024, 4096, 1024)]
    if device.type == "cuda" and not quick:
        # a large GPU reaches its rate only on large products (an H200: 8192³ runs at about
        # 1.5× what 2048³ does); the matrices canzona orthogonalise are of this size
        shapes += [(4096, 4096, 4096), (8192, 8192, 8192)]
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = 0.0
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            best = max(best, 2 * m * k * n / _best(lambda: a @ b, device, reps))
        rates[name] = best
    rates["tf32"] = rates["fp32"] if device.type == "cpu" else rates["bf16"] / 2
    return rates


def _kernels(device: torch.device, quick: bool, reps: int,
             ns_shapes: list[tuple[int, int]] | None = None) -> dict[str, float]:
    """Newton–Schulz achieved FLOP/s per shape; eigh and QR seconds per size."""
    out = {}
    ns = [(128, 256)] if quick else [(512, 512), (1024, 2048), (2048, 2048)]
    for m, n in ns_shapes or ():
        if (m, n) not in ns:
            ns.append((m, n))
    for m, n in ns:
        x = torch.randn(m, n, device=device)
        schedule = [DEFAULT_COEFFICIENTS] * 5
        t = _best(lambda: newton_schulz(x, schedule, dtype=None), device, reps)
        out[f"newton_schulz_fp32_{m}x{n}_flops_per_s"] = formulas.muon_flops(m, n) / t
    for d in ([64] if quick else [256, 1024]):
        a = torch.randn(d, d, device=device)
        sym = a @ a.T + d * torch.eye(d, device=device)
        out[f"eigh_{d}_s"] = _best(lambda: torch.linalg.eigh(sym), device, reps)
        out[f"qr_{d}_s"] = _best(lambda: torch.linalg.qr(a), device, reps)
    return out


def _memory_bandwidth(device: torch.device, quick: bool, reps: int) -> float:
    n = (1 << 20) if quick else (1 << 26)  # 4 MiB or 256 MiB of fp32
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), device, reps)


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_worker(rank: int, world: int, port: int, backend: str, quick: bool, reps: int,
                 out: str) -> None:
    """One of the two processes timing the collectives; rank 0 writes (α, t_large, bytes)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        small = torch.zeros(1, device=device)
        numel = (1 << 18) if quick else (1 << 24)  # 1 MiB or 64 MiB of fp32 gathered
        part = torch.ones(numel // world, device=device)
        whole = torch.empty(numel, device=device)

        def timed(fn: Callable[[], object]) -> float:
            fn()
            _sync(device)
            best = math.inf
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                _sync(device)
                best = min(best, time.perf_counter() - t0)
            return best

        alpha = timed(lambda: dist.all_reduce(small))
        large = timed(lambda: _all_gather(whole, part))
        if rank == 0:
            with open(out, "w", encoding="ascii") as f:
                f.write(f"{alpha} {large} {numel * 4}")
    finally:
        dist.destroy_process_group()


def _link(backend: str, quick: bool, reps: int) -> tuple[LinkProfile, dict[str, float]]:
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link.txt")
        mp.start_processes(_link_worker, args=(world, _free_port(), backend, quick, reps, out),
                           nprocs=world, join=True, start_method="spawn")
        with open(out, encoding="ascii") as f:
            alpha, large, nbytes = (float(x) for x in f.read().split())
    moved = (world - 1) / world * nbytes  # what a ring all-gather moves through each rank
    busbw = moved / max(large - alpha, 1e-9)
    return LinkProfile(busbw=busbw, latency_s=alpha), {
        "link_all_reduce_small_s": alpha, "link_all_gather_s": large,
        "link_all_gather_bytes": float(nbytes)}


def calibrate(*, quick: bool = False, name: str | None = None, backend: str | None = None,
              progress: Callable[[str], None] | None = None,
              ns_shapes: list[tuple[int, int]] | None = None) -> HardwareProfile:
    """Measure this machine and return its hardware profile (see the module docstring).

    Args:
        quick: tiny shapes and few repetitions (a few seconds; for tests).
        name: the profile's name (default ``calibrated-<hostname>``).
        backend: collectives backend for the link (default: nccl with two GPUs, else gloo).
        progress: told each stage's name.
        ns_shapes: more (m, n) shapes to time Newton–Schulz at (e.g. a model's own matrices);
            each adds ``newton_schulz_fp32_MxN_flops_per_s`` to ``calibration``.
    """
    say = progress or (lambda _msg: None)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    backend = backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    reps = 2 if quick else 5
    threads = torch.get_num_threads()
    say("matmul")
    rates = _matmul_rates(device, quick, reps)
    say("Newton–Schulz, eigh, QR")
    extra = _kernels(device, quick, reps, ns_shapes)
    say("memory bandwidth")
    bandwidth = _memory_bandwidth(device, quick, reps)
    say(f"collectives ({backend}, 2 processes)")
    link, link_extra = _link(backend, quick, reps)
    extra.update(link_extra)
    what = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"{platform.machine()} CPU, {threads} threads")
    today = datetime.date.today().isoformat()
    return HardwareProfile(
        name=name or f"calibrated-{socket.gethostname()}", version=1,
        description=(f"measured by canzona calibrate{' --quick' if quick else ''} on {today}: "
                     f"{what}; torch {torch.__version__}; {backend} link between 2 local "
                     "processes; peak_flops are the best achieved matmul rates "
                     "(compute_efficiency 1)"),
        gpus_per_node=2, peak_flops=rates, compute_efficiency=1.0,
        memory_bytes=_memory_bytes(device), memory_bandwidth=bandwidth,
        intra_node=link, inter_node=link,
        calibration={k: float(v) for k, v in sorted(extra.items())})
