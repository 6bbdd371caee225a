"""The GPU check: every CUDA/NCCL path one GPU can run, and canzona's kernels measured on the card.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--budget-s 300] [--no-compile]
    python benchmarks/gpu_check.py --smoke          # the same code paths on the CPU (CI)

Unattended on one CUDA GPU in at most ``--budget-s`` seconds (default 300). After each section it
rewrites ``--out`` (JSON, atomically), so a run cut short keeps what finished; at the end it prints
one table and exits 1 if a check failed. A section that would start after the budget is spent is
recorded as skipped. Sections, cheapest first:

1. ``runtime`` — ``CanzonaOptimizer`` at world size 1 on NCCL with CUDA tensors: a small GPT in
   bf16 with fp32 main copies (``main_params="fp32"``) and ``overlap_param_gather=True``, trained
   a few steps once per DP collective method (the bucket's own ``local`` copy, then ``padded``,
   ``per_root`` — NCCL's coalesced launches, ``_coalescing_manager`` —, ``all_to_all`` and
   ``all_reduce``, each run over the one-rank group). Checks: every run's losses equal the CPU
   run's within bf16 tolerance (relative 3e-2), the methods agree with each other (relative
   1e-6), the loss falls, and after ``finish()`` the CUDA stream is idle.
2. ``streams`` — the ordering the TP and sharing paths rely on: an asynchronous
   ``all_to_all_single`` (the micro-groups' gather and scatter) launched right after a large
   matmul writes its input and waited for with canzona's ``wait_for``, then read, twenty times,
   bit-compared; and the shared Newton–Schulz kernel's chunked Gram all-reduces
   (``shared_newton_schulz(..., gram_at_one=True)``) against the single-device kernel, fp32 and
   bf16.
3. ``newton_schulz`` — batched Newton–Schulz throughput in bf16 for the matrix shapes of qwen3-8b
   and qwen3-32b (a stack of ``--stack`` matrices per shape, as the runtime batches same-shape
   matrices), against ``torch.optim.Muon`` stepping the same matrices one by one (with canzona's
   ``Muon.direction`` on them as the like-for-like optimizer call). FLOP/s count
   ``formulas.muon_flops``; the fraction is of the card's nominal bf16 peak (the nearest shipped
   profile) and of a plain 8192³ bf16 matmul measured in the same run.
4. ``shared_ns`` — the shared Newton–Schulz Gram kernel (``shared_newton_schulz_many`` in
   lockstep, one rank: its chunked Gram products, packing and all-reduces) against the plain
   batched kernel on the same stacks: time ratio and relative difference.
5. ``calibrate`` — ``canzona.runtime.calibrate.calibrate()`` on the card, printed beside the
   nearest shipped profile (H100 for an H100 or H200, H800 for an H800), and the simulator's step
   for qwen3-32b dp32 tp8 under both. The calibrated profile for the simulation keeps the shipped
   profile's links (one GPU has no NVLink or InfiniBand to measure) and takes the measured matmul
   rates, memory bandwidth and memory.
6. ``compile`` — ``torch.compile`` of the Newton–Schulz kernel on one stack: compile seconds,
   then steady-state time against eager. Last, as it is optional (``--no-compile`` skips it).

What one GPU cannot show: NCCL needs one device per rank, so the per-root reduces and broadcasts
to other ranks, the micro-groups' all-to-alls between TP ranks (at tp = 1 the runner copies), the
DP pairs' point-to-point exchanges and every shared Newton–Schulz with k > 1 need two or more GPUs.
Here their launches, stream ordering and waits run over a one-rank group.

``--smoke`` runs every section on the CPU (gloo in place of NCCL, matrix shapes divided by 32,
fewer steps and repetitions, ``calibrate(quick=True)``, no ``torch.compile``); CI runs it so that
the script keeps working. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import canzona  # noqa: E402
from canzona.planner import build_inventory, formulas  # noqa: E402
from canzona.planner.hardware import load_hardware  # noqa: E402
from canzona.planner.models import get_preset  # noqa: E402
from canzona.runtime.waits import wait_for  # noqa: E402
from train_gpt import GPT  # noqa: E402  (the README's example model)
from canzona.runtime.optim import Muon, MuonConfig, newton_schulz  # noqa: E402
from canzona.runtime.optim.shared_ns import (  # noqa: E402
    shared_newton_schulz, shared_newton_schulz_many)

SECTIONS = ("runtime", "streams", "newton_schulz", "shared_ns", "calibrate", "compile")
METHODS = (None, "padded", "per_root", "all_to_all", "all_reduce")
MODELS = ("qwen3-8b", "qwen3-32b")
SIM_MODEL, SIM_DP, SIM_TP = "qwen3-32b", 32, 8
LOSS_RTOL = 3e-2  # CUDA bf16 against CPU bf16, per step
SAME_RTOL = 1e-6  # the collective methods against each other (one rank: the same arithmetic)
BF16_RTOL = 6e-2  # two bf16 Newton–Schulz results (summation order differs), Frobenius


class CheckFailed(AssertionError):
    """A section's check did not hold; the message says which and by how much."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


# -- setting ---------------------------------------------------------------------------------------


class Setting:
    """What differs between the GPU run and ``--smoke``: device, backend, sizes, repetitions."""

    def __init__(self, smoke: bool, stack: int, budget_s: float) -> None:
        self.smoke = smoke
        self.device = torch.device("cpu") if smoke else torch.device("cuda", 0)
        self.backend = "gloo" if smoke else "nccl"
        self.divide = 32 if smoke else 1
        self.stack = 2 if smoke else stack
        self.reps = 2 if smoke else 5
        self.steps = 4 if smoke else 8
        self.budget_s = budget_s
        self.start = time.monotonic()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], object], reps: int | None = None) -> dict[str, float]:
        """Best and median seconds of ``fn`` over ``reps`` runs after one warm-up."""
        fn()
        self.sync()
        times = []
        for _ in range(reps or self.reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return {"best_s": min(times), "median_s": statistics.median(times)}


def nearest_profile(device: torch.device) -> str:
    """The shipped hardware profile nearest the card: the H200 computes as the H100 does."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).upper()
    return "h800" if "H800" in name else "h100"


# -- 1. the runtime ------------------------------------------------------------------------------


def _gpt_sizes(s: Setting) -> dict[str, int]:
    return (dict(vocab=128, dim=64, layers=2, heads=4, seq=16, batch=4) if s.smoke
            else dict(vocab=512, dim=256, layers=2, heads=4, seq=64, batch=16))


def _batches(s: Setting, sizes: dict[str, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Arithmetic progressions mod vocab (the loss falls within a few steps)."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(s.steps):
        start = torch.randint(0, sizes["vocab"], (sizes["batch"], 1), generator=gen)
        stride = torch.randint(1, 5, (sizes["batch"], 1), generator=gen)
        data = (start + stride * torch.arange(sizes["seq"] + 1)) % sizes["vocab"]
        out.append((data[:, :-1], data[:, 1:]))
    return out


def _train(device: torch.device, method: str | None, s: Setting) -> dict[str, Any]:
    """The small GPT in bf16 with fp32 main copies, ``s.steps`` steps; losses and step times."""
    sizes = _gpt_sizes(s)
    torch.manual_seed(0)
    model = GPT(sizes["vocab"], sizes["dim"], sizes["layers"], sizes["heads"], sizes["seq"])
    model = model.to(torch.bfloat16).to(device)
    plan = canzona.plan_model(model, dp=1, bucket_size=sizes["dim"] ** 2 * 4)
    opt = canzona.CanzonaOptimizer(model, plan, lr=0.02, adamw_lr=3e-3, main_params="fp32",
                                   overlap_param_gather=True, collective=method)
    losses, times = [], []
    try:
        for x, y in _batches(s, sizes):
            s.sync()
            t0 = time.perf_counter()
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))  # synchronises: the step's time
            times.append(time.perf_counter() - t0)
        opt.finish()
        idle = (torch.cuda.current_stream(device).query() if device.type == "cuda" else True)
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    finally:
        opt.close()
    return {"losses": losses, "step_ms": statistics.median(times[1:] or times) * 1e3,
            "stream_idle_after_finish": bool(idle), "params_finite": finite,
            "buckets": len(plan.buffers[0].buckets)}


def section_runtime(s: Setting) -> dict[str, Any]:
    # the CPU run: no process group (dp = 1 needs none), the buckets' local copies
    reference = _train(torch.device("cpu"), None, s)
    runs = {}
    for method in METHODS:
        runs[method or "local"] = _train(s.device, method, s)
    ref = reference["losses"]
    worst_cpu = max(abs(a - b) / abs(b) for r in runs.values() for a, b in zip(r["losses"], ref))
    local = runs["local"]["losses"]
    worst_same = max(abs(a - b) / max(abs(b), 1e-12) for r in runs.values()
                     for a, b in zip(r["losses"], local))
    out = {"cpu_losses": ref, "runs": runs, "max_rel_diff_vs_cpu": worst_cpu,
           "max_rel_diff_between_methods": worst_same, "backend": s.backend}
    check(worst_cpu <= LOSS_RTOL, f"losses differ from the CPU run's by {worst_cpu:.2e} "
                                  f"relative (> {LOSS_RTOL})")
    check(worst_same <= SAME_RTOL, f"the collective methods' losses differ by {worst_same:.2e}")
    check(all(r["losses"][-1] < r["losses"][0] for r in runs.values()), "the loss did not fall")
    check(all(r["stream_idle_after_finish"] and r["params_finite"] for r in runs.values()),
          "finish() left the stream busy or a parameter non-finite")
    return out


# -- 2. stream ordering ----------------------------------------------------------------------------


def section_streams(s: Setting) -> dict[str, Any]:
    n = 4096 // s.divide
    gen = torch.Generator(device=s.device).manual_seed(0)
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=gen)
    mismatches = 0
    for i in range(20):
        # a large product writes the send buffer on the compute stream; the all-to-all on the
        # communicator's stream must not read it early, nor the reader below see `out` early
        send = (a @ b).add_(i).reshape(-1)
        out = torch.empty_like(send)
        work = dist.all_to_all_single(out, send, [send.numel()], [send.numel()], async_op=True)
        wait_for(work, "the stream-ordering all-to-all", None, 0)
        mismatches += int(not torch.equal(out.mul(2), send.mul(2)))
    shape = (1024 // s.divide, 256 // s.divide)
    x = torch.randn(shape, device=s.device, generator=gen)
    gram = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        plain = newton_schulz(x, MuonConfig().schedule, dtype=dtype).float()
        shared = shared_newton_schulz(x, dtype=dtype, gram_at_one=True,
                                      what="the stream check").float()
        gram[name] = ((shared - plain).norm() / plain.norm()).item()
    out = {"all_to_all_mismatches": mismatches, "gram_rel_diff": gram, "shape": list(shape)}
    check(mismatches == 0, f"{mismatches} of 20 all-to-alls read or delivered stale data")
    check(gram["fp32"] < 1e-4 and gram["bf16"] < BF16_RTOL,
          f"the shared kernel's result differs from the plain one: {gram}")
    return out


# -- 3. and 4. the kernels -------------------------------------------------------------------------


def matrix_shapes(s: Setting) -> list[tuple[str, tuple[int, int], int]]:
    """(model, shape, count in the model) of every Muon matrix shape, divided for ``--smoke``."""
    out = []
    for model in MODELS:
        spec = build_inventory(get_preset(model))
        counts = collections.Counter(tuple(p.shape) for p in spec.params
                                     if p.optimizer == "matrix" and len(p.shape) == 2)
        for (m, n), c in sorted(counts.items()):
            out.append((model, (m // s.divide, n // s.divide), c))
    return out


def _stack(s: Setting, shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator(device=s.device).manual_seed(seed)
    return torch.randn((s.stack, *shape), device=s.device, generator=gen)


def matmul_rate(s: Setting) -> float:
    n = 8192 // s.divide
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    return 2 * n**3 / s.timed(lambda: a @ b)["best_s"]


def section_newton_schulz(s: Setting) -> dict[str, Any]:
    peak = load_hardware(nearest_profile(s.device)).peak_flops["bf16"]
    plain = matmul_rate(s)
    cfg = MuonConfig(ns_dtype=torch.bfloat16)
    rows = []
    for model, (m, n), count in matrix_shapes(s):
        grads = _stack(s, (m, n), seed=m * 7 + n)
        flops = s.stack * formulas.muon_flops(m, n, ns_steps=cfg.ns_steps)
        ns = s.timed(lambda: newton_schulz(grads, cfg.schedule, eps=cfg.eps,
                                           dtype=torch.bfloat16))
        ours = Muon(cfg)
        states = [ours.init_state((m, n), torch.float32, s.device) for _ in range(s.stack)]
        mats = list(grads)
        direction = s.timed(lambda: ours.direction(mats, states))
        params = [nn.Parameter(torch.zeros(m, n, device=s.device)) for _ in range(s.stack)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        theirs = torch.optim.Muon(params, lr=1e-3)
        torch_step = s.timed(theirs.step)
        del theirs, params
        rows.append({
            "model": model, "shape": [m, n], "in_model": count, "stack": s.stack,
            "gflop": flops / 1e9, "ns_batched_ms": ns["best_s"] * 1e3,
            "canzona_direction_ms": direction["best_s"] * 1e3,
            "torch_muon_step_ms": torch_step["best_s"] * 1e3,
            "ns_tflops": flops / ns["best_s"] / 1e12,
            "ns_of_peak": flops / ns["best_s"] / peak,
            "ns_of_matmul": flops / ns["best_s"] / plain,
            "speedup_vs_torch_muon": torch_step["best_s"] / direction["best_s"]})
    return {"nominal_bf16_peak_tflops": peak / 1e12, "profile": nearest_profile(s.device),
            "matmul_8192_bf16_tflops": plain / 1e12, "rows": rows}


def section_shared_ns(s: Setting) -> dict[str, Any]:
    cfg = MuonConfig(ns_dtype=torch.bfloat16)
    rows = []
    for model, (m, n), _ in matrix_shapes(s):
        grads = _stack(s, (m, n), seed=m * 7 + n)
        # oriented along the long side, as the runtime hands the shared kernel its rows
        blocks = [g if m >= n else g.mT for g in grads]
        plain = s.timed(lambda: newton_schulz(grads, cfg.schedule, eps=cfg.eps,
                                              dtype=torch.bfloat16))
        shared = s.timed(lambda: shared_newton_schulz_many(
            blocks, coefficients=cfg.schedule, steps=cfg.ns_steps, eps=cfg.eps,
            dtype=torch.bfloat16, gram_at_one=True))
        a = newton_schulz(grads, cfg.schedule, eps=cfg.eps, dtype=torch.bfloat16).float()
        got = shared_newton_schulz_many(blocks, coefficients=cfg.schedule, steps=cfg.ns_steps,
                                        eps=cfg.eps, dtype=torch.bfloat16, gram_at_one=True)
        b = torch.stack([g if m >= n else g.mT for g in got]).float()
        rel = ((b - a).norm() / a.norm()).item()
        flops = s.stack * formulas.muon_flops(m, n, ns_steps=cfg.ns_steps)
        rows.append({"model": model, "shape": [m, n], "stack": s.stack,
                     "plain_ms": plain["best_s"] * 1e3, "shared_ms": shared["best_s"] * 1e3,
                     "shared_over_plain": shared["best_s"] / plain["best_s"],
                     "shared_tflops": flops / shared["best_s"] / 1e12, "rel_diff": rel})
    worst = max(r["rel_diff"] for r in rows)
    check(worst < BF16_RTOL, f"the shared kernel differs from the plain one by {worst:.2e} (bf16)")
    return {"rows": rows}


# -- 5. calibrate and simulate ---------------------------------------------------------------------


def section_calibrate(s: Setting) -> dict[str, Any]:
    from canzona.planner import ParallelSizes
    from canzona.planner.pipeline import plan as make_plan
    from canzona.planner.simulate import simulate_plan
    from canzona.runtime.calibrate import calibrate

    shipped = load_hardware(nearest_profile(s.device))
    measured = calibrate(quick=s.smoke, backend="gloo")
    # one GPU measures compute and memory, not the cluster's links: keep the shipped ones
    card = shipped.model_copy(update={
        "name": f"{shipped.name}-calibrated", "peak_flops": measured.peak_flops,
        "compute_efficiency": 1.0, "memory_bandwidth": measured.memory_bandwidth,
        "memory_bytes": measured.memory_bytes, "calibration": measured.calibration,
        "description": f"{measured.description}; links from '{shipped.name}'"})
    plan = make_plan(SIM_MODEL, ParallelSizes(dp=SIM_DP, tp=SIM_TP), "muon")
    steps = {}
    for label, hw in (("shipped", shipped), ("calibrated", card)):
        sim = simulate_plan(plan, hw)
        steps[label] = {"step_ms": sim.step_s * 1e3,
                        **{k: v * 1e3 for k, v in sim.breakdown().items()}}

    def effective(hw: Any) -> dict[str, float]:
        return {k: v * hw.compute_efficiency / 1e12 for k, v in hw.peak_flops.items()}

    return {"shipped": shipped.name, "measured_profile": json.loads(measured.model_dump_json()),
            "matrix_tflops": {"shipped": effective(shipped), "measured": effective(measured)},
            "memory_bandwidth_tbs": {"shipped": shipped.memory_bandwidth / 1e12,
                                     "measured": measured.memory_bandwidth / 1e12},
            "simulated": f"{SIM_MODEL} dp{SIM_DP} tp{SIM_TP} (Muon)", "steps": steps,
            "calibrated_over_shipped": steps["calibrated"]["step_ms"]
            / steps["shipped"]["step_ms"]}


# -- 6. torch.compile ------------------------------------------------------------------------------


def section_compile(s: Setting) -> dict[str, Any]:
    cfg = MuonConfig(ns_dtype=torch.bfloat16)
    model, (m, n), _ = max(matrix_shapes(s), key=lambda r: r[1][0] * r[1][1]
                           if r[0] == MODELS[0] else 0)
    grads = _stack(s, (m, n), seed=1)

    def eager() -> torch.Tensor:
        return newton_schulz(grads, cfg.schedule, eps=cfg.eps, dtype=torch.bfloat16)

    compiled = torch.compile(eager)
    t0 = time.perf_counter()
    got = compiled()
    s.sync()
    first = time.perf_counter() - t0
    rel = ((got.float() - eager().float()).norm() / eager().float().norm()).item()
    e, c = s.timed(eager), s.timed(compiled)
    check(rel < BF16_RTOL, f"the compiled kernel differs from the eager one by {rel:.2e}")
    return {"model": model, "shape": [m, n], "stack": s.stack, "compile_s": first,
            "eager_ms": e["best_s"] * 1e3, "compiled_ms": c["best_s"] * 1e3,
            "speedup": e["best_s"] / c["best_s"], "rel_diff": rel}


RUNNERS: dict[str, Callable[[Setting], dict[str, Any]]] = {
    "runtime": section_runtime, "streams": section_streams,
    "newton_schulz": section_newton_schulz, "shared_ns": section_shared_ns,
    "calibrate": section_calibrate, "compile": section_compile}
#: seconds a section needs at least (GPU run) to be started
NEEDS_S = {"runtime": 20, "streams": 5, "newton_schulz": 30, "shared_ns": 30, "calibrate": 60,
           "compile": 60}


# -- the run ---------------------------------------------------------------------------------------


def environment(s: Setting) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "host": socket.gethostname(),
        "python": platform.python_version(), "torch": torch.__version__,
        "smoke": s.smoke, "backend": s.backend}
    if s.device.type == "cuda":
        props = torch.cuda.get_device_properties(s.device)
        env.update(card=torch.cuda.get_device_name(s.device), cuda=torch.version.cuda,
                   nccl=".".join(map(str, torch.cuda.nccl.version())),
                   memory_gib=props.total_memory / 2**30,
                   multiprocessors=props.multi_processor_count)
    else:
        env.update(card=f"{platform.machine()} CPU", threads=torch.get_num_threads())
    return env


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a temporary file in the same folder, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def summary(name: str, res: dict[str, Any]) -> str:
    """One line of the table: the section's headline figures."""
    if res["status"] != "ok":
        return res.get("error", res["status"]).splitlines()[0][:110]
    if name == "runtime":
        steps = ", ".join(f"{k} {v['step_ms']:.1f}" for k, v in res["runs"].items())
        return (f"vs CPU {res['max_rel_diff_vs_cpu']:.1e} rel; methods agree to "
                f"{res['max_rel_diff_between_methods']:.0e}; ms/step: {steps}")
    if name == "streams":
        g = res["gram_rel_diff"]
        return (f"all-to-all stale reads {res['all_to_all_mismatches']}/20; Gram path vs plain "
                f"fp32 {g['fp32']:.1e}, bf16 {g['bf16']:.1e}")
    if name == "newton_schulz":
        best = max(res["rows"], key=lambda r: r["ns_tflops"])
        return (f"best {best['ns_tflops']:.0f} TFLOP/s ({best['ns_of_peak']:.0%} of nominal, "
                f"{best['ns_of_matmul']:.0%} of matmul {res['matmul_8192_bf16_tflops']:.0f}) at "
                f"{best['shape'][0]}x{best['shape'][1]}; vs torch Muon "
                + "/".join(f"{r['speedup_vs_torch_muon']:.1f}" for r in res["rows"]) + "x")
    if name == "shared_ns":
        return ("shared/plain time " + "/".join(f"{r['shared_over_plain']:.2f}"
                                                for r in res["rows"])
                + f"; max rel diff {max(r['rel_diff'] for r in res['rows']):.1e}")
    if name == "calibrate":
        st = res["steps"]
        return (f"{res['simulated']}: {st['shipped']['step_ms']:.1f} ms ({res['shipped']}) vs "
                f"{st['calibrated']['step_ms']:.1f} ms calibrated; bf16 "
                f"{res['matrix_tflops']['shipped']['bf16']:.0f} vs "
                f"{res['matrix_tflops']['measured']['bf16']:.0f} TFLOP/s")
    if name == "compile":
        return (f"compile {res['compile_s']:.1f} s; eager {res['eager_ms']:.1f} ms, compiled "
                f"{res['compiled_ms']:.1f} ms ({res['speedup']:.2f}x)")
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="every section on the CPU (CI)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"),
                    help="the JSON, rewritten after each section")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="start no section after this many seconds")
    ap.add_argument("--stack", type=int, default=4, help="matrices per shape (sections 3, 4, 6)")
    ap.add_argument("--no-compile", action="store_true", help="skip section 6")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    args = ap.parse_args(argv)
    if args.stack < 1:
        ap.error(f"--stack must be at least 1, got {args.stack}")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA GPU is visible; run with --smoke for the CPU version")
    s = Setting(args.smoke, args.stack, args.budget_s)
    if args.smoke:
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(s.device)
    wanted = [x for x in SECTIONS if (not args.only or x in args.only)
              and not (x == "compile" and (args.no_compile or args.smoke))]
    report: dict[str, Any] = {"environment": environment(s), "sections": {}}
    write_json(args.out, report)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(s.backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timedelta(seconds=120),
                            device_id=s.device if s.device.type == "cuda" else None)
    try:
        for name in wanted:
            need = 0 if s.smoke else NEEDS_S[name]
            if s.left() < need:
                res: dict[str, Any] = {"status": "skipped",
                                       "error": f"skipped: {s.left():.0f} s of the budget left"}
            else:
                print(f"[{time.monotonic() - s.start:6.1f} s] {name} …", flush=True)
                t0 = time.perf_counter()
                try:
                    res = {"status": "ok", **RUNNERS[name](s)}
                except CheckFailed as exc:
                    res = {"status": "failed", "error": f"check failed: {exc}"}
                except Exception as exc:  # a broken section must not stop the others
                    res = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()}
                res["seconds"] = time.perf_counter() - t0
                if s.device.type == "cuda":
                    torch.cuda.empty_cache()
            report["sections"][name] = res
            report["elapsed_s"] = time.monotonic() - s.start
            write_json(args.out, report)
    finally:
        dist.destroy_process_group()
    env = report["environment"]
    print(f"\n{env['card']}, torch {env['torch']}, {env['backend']}, {env['date']}; "
          f"{report.get('elapsed_s', 0):.0f} s; JSON in {args.out}")
    width = max(map(len, SECTIONS))
    print(f"{'section':<{width}}  {'status':<7}  {'s':>5}  figures")
    for name, res in report["sections"].items():
        print(f"{name:<{width}}  {res['status']:<7}  {res.get('seconds', 0):5.1f}  "
              f"{summary(name, res)}")
    bad = [n for n, r in report["sections"].items() if r["status"] in ("failed", "error")]
    for n in bad:
        print(f"\n{n}: {report['sections'][n]['error']}\n"
              f"{report['sections'][n].get('traceback', '')}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
