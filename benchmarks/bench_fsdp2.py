"""FSDP2 storage: canzona's plan beside torchtitan DistMuon's method and the synchronous
baseline, measured on CPU/gloo, and modelled at scale.

    python benchmarks/bench_fsdp2.py                  # both tables
    python benchmarks/bench_fsdp2.py --write-readme   # and their section of benchmarks/README.md

**Measured.** One ``fully_shard``-ed model (a stack of transformer-like blocks whose row counts
do not divide by 4, an embedding and norms on AdamW) trains at dp 2 and dp 4 under three
optimizers, side by side in one run, each from the same weights on the same batches, their
iterations interleaved:

* ``dist-muon`` — torchtitan DistMuon's method, written here in float32: owners by longest-first
  on the Newton–Schulz FLOPs, one matrix per rank per all-to-all round, every shard zero-padded
  to ``ceil(rows / dp)`` rows so each all-to-all is uniform, momentum on the local rows;
* ``canzona`` — ``CanzonaOptimizer`` on ``canzona.plan_model(model, dp=…)``'s FSDP2 plan (the
  planner's owners and rounds, uneven all-to-alls, round k + 1's gather during round k's
  compute);
* ``sync`` — every rank all-gathers every matrix's update input (``full_tensor``) and computes
  every Newton–Schulz itself.

Printed per strategy: the median iteration (forward, backward, optimizer step) over the timed
iterations, its ratio to ``dist-muon``'s, the largest relative difference of a parameter from
``dist-muon``'s after ``STEPS`` steps (float32 Newton–Schulz everywhere) and, to show that they
trained, the relative change of all parameters together from the start.

**Modelled.** qwen3-8b, Muon, on the H800 profile at 64 and 256 ranks: the matrices' step of
canzona's plan, of DistMuon's owners and rounds and of the synchronous baseline, beside the
bound for whole-matrix owners (:mod:`canzona.planner.fsdp2`).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
SECTION = "## FSDP2 storage"
STEPS = 10
WARMUP = 2
TIMED = 8
LR, MOMENTUM, WD = 0.02, 0.95, 0.1
ADAMW_LR = 1e-3
SCALE = ("qwen3-8b", (64, 256), "h800")
DIM, FFN, LAYERS = 258, 774, 6  # rows that 4 does not divide


# -- the model ------------------------------------------------------------------------------------


def build_model(seed: int = 0):  # noqa: ANN201
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, f: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.fc1 = nn.Linear(d, f, bias=False)
            self.fc2 = nn.Linear(f, d, bias=False)

        def forward(self, x):  # noqa: ANN001, ANN202
            q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
            x = x + self.proj(v * torch.sigmoid(q * k))
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(250, DIM)
            self.layers = nn.ModuleList(Block(DIM, FFN) for _ in range(LAYERS))
            self.final_norm = nn.LayerNorm(DIM)

        def forward(self, tokens):  # noqa: ANN001, ANN202
            x = self.embedding(tokens)
            for b in self.layers:
                x = b(x)
            return self.final_norm(x).pow(2).mean()

    torch.manual_seed(seed)
    return Net()


def shard(model, mesh):  # noqa: ANN001, ANN201
    from torch.distributed.fsdp import fully_shard

    for b in model.layers:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches(rank: int, n: int):  # noqa: ANN201
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, 250, (4, 32), generator=g) for _ in range(n)]


# -- the peers ------------------------------------------------------------------------------------


class _Peer:
    """What the two peers share: AdamW on the local rows of the non-matrix parameters (the
    plan's routing), Muon's momentum on the local rows of the matrices, the update applied to
    the local rows."""

    def __init__(self, model, plan, group) -> None:  # noqa: ANN001
        import torch

        from canzona.runtime.optim.muon import MuonConfig

        self.group = group
        self.world = torch.distributed.get_world_size(group)
        self.rank = torch.distributed.get_rank(group)
        named = dict(model.named_parameters())
        routes = {t.param: t.optimizer for t in plan.tasks}
        self.matrices = [(n, named[n]) for n in named if routes[n] == "matrix"]
        adamw = [named[n] for n in named if routes[n] == "adamw"]
        self.adamw = torch.optim.AdamW(adamw, lr=ADAMW_LR, betas=(0.9, 0.999), eps=1e-8,
                                       weight_decay=1e-2, foreach=False)
        self.config = MuonConfig(lr=LR, momentum=MOMENTUM, weight_decay=WD,
                                 ns_dtype=torch.float32)
        self.buf = {n: torch.zeros_like(p.to_local()) for n, p in self.matrices}

    def _inputs(self) -> dict:
        """Per matrix, the Nesterov update input on the local rows (momentum updated)."""
        import torch

        out = {}
        for n, p in self.matrices:
            g = p.grad.to_local()
            self.buf[n].lerp_(g, 1 - MOMENTUM)
            out[n] = torch.lerp(g, self.buf[n], MOMENTUM)
        return out

    def _apply(self, p, rows) -> None:  # noqa: ANN001
        from canzona.runtime.optim.muon import adjust_lr

        local = p.to_local()
        local.mul_(1 - LR * WD)
        local.add_(rows, alpha=-adjust_lr(LR, self.config.adjust_lr_fn, p.shape))

    def _ns(self, x):  # noqa: ANN001, ANN202
        from canzona.runtime.optim.muon import newton_schulz

        c = self.config
        return newton_schulz(x, c.schedule, eps=c.eps, dtype=c.ns_dtype)

    def zero_grad(self) -> None:
        for _, p in self.matrices:
            p.grad = None
        self.adamw.zero_grad(set_to_none=True)


class DistMuon(_Peer):
    """torchtitan DistMuon's method in float32: longest-first owners on the Newton–Schulz
    FLOPs, round k the k-th matrix of each rank, shards zero-padded to ``ceil(rows / dp)`` rows
    so every all-to-all moves equal chunks."""

    def __init__(self, model, plan, group) -> None:  # noqa: ANN001
        super().__init__(model, plan, group)
        from canzona.planner.formulas import muon_flops

        loads = [0] * self.world
        owned: list[list[int]] = [[] for _ in range(self.world)]
        flops = [muon_flops(*p.shape) for _, p in self.matrices]
        for i in sorted(range(len(self.matrices)), key=lambda i: (-flops[i], i)):
            r = min(range(self.world), key=lambda r: (loads[r], r))
            owned[r].append(i)
            loads[r] += flops[i]
        depth = max(len(o) for o in owned)
        self.rounds = [[o[k] if k < len(o) else None for o in owned] for k in range(depth)]

    def step(self) -> None:
        import torch
        import torch.distributed as dist

        self.adamw.step()
        inputs = self._inputs()
        W = self.world
        for owners in self.rounds:  # owners[r]: the matrix rank r computes (None: none)
            chunk = max(-(-self.matrices[i][1].shape[0] // W) * self.matrices[i][1].shape[1]
                        for i in owners if i is not None)
            send = torch.zeros(W, chunk)
            for r, i in enumerate(owners):
                if i is not None:
                    x = inputs[self.matrices[i][0]].reshape(-1)
                    send[r, : x.numel()] = x
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            back = torch.zeros(W, chunk)
            mine = owners[self.rank]
            if mine is not None:
                rows, cols = self.matrices[mine][1].shape
                each = -(-rows // W)
                full = recv[:, : each * cols].reshape(W * each, cols)[:rows]
                out = torch.zeros(W * each, cols)
                out[:rows] = self._ns(full)
                back[:, : each * cols] = out.reshape(W, each * cols)
            got = torch.empty_like(back)
            dist.all_to_all_single(got, back, group=self.group)
            for r, i in enumerate(owners):
                if i is not None:
                    name, p = self.matrices[i]
                    n = inputs[name].numel()
                    self._apply(p, got[r, :n].reshape(inputs[name].shape))


class Sync(_Peer):
    """Every rank all-gathers every matrix's update input and computes all of them."""

    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        self.adamw.step()
        inputs = self._inputs()
        for name, p in self.matrices:
            x = DTensor.from_local(inputs[name], p.device_mesh, p.placements,
                                   shape=p.shape, stride=p.stride()).full_tensor()
            start = p.to_local().shape[0]
            first = self._first_row(p)
            self._apply(p, self._ns(x)[first: first + start])

    def _first_row(self, p) -> int:  # noqa: ANN001
        from canzona.planner.formulas import fsdp2_rows

        return fsdp2_rows(p.shape[0], self.world)[self.rank][0]


# -- one rank's run -------------------------------------------------------------------------------


STRATEGIES = ("dist-muon", "canzona", "sync")


def _run(mesh, plan) -> dict[str, tuple[list[float], dict]]:  # noqa: ANN001
    """Every strategy from the same weights on the same batches, their iterations
    interleaved (step k of each, in turn), so a change of the machine's load falls on all of
    them alike. Per strategy: its iteration times and its parameters at the end."""
    import torch
    import torch.distributed as dist

    import canzona

    group = mesh.get_group()
    runs = {}
    for strategy in STRATEGIES:
        model = shard(build_model(), mesh)
        if strategy == "canzona":
            opt = canzona.CanzonaOptimizer(model, plan, lr=LR, momentum=MOMENTUM,
                                           weight_decay=WD, ns_dtype=torch.float32,
                                           adamw_lr=ADAMW_LR)
        else:
            opt = (DistMuon if strategy == "dist-muon" else Sync)(model, plan, group)
        runs[strategy] = (model, opt, [])
    data = batches(dist.get_rank(group), STEPS)
    for k in range(STEPS):
        for model, opt, times in runs.values():
            dist.barrier(group)
            t = time.perf_counter()
            model(data[k]).backward()
            with torch.no_grad():
                opt.step()
            opt.zero_grad()
            dist.barrier(group)
            times.append(time.perf_counter() - t)
    out = {}
    for strategy, (model, opt, times) in runs.items():
        out[strategy] = (times, {n: p.full_tensor().detach().clone()
                                 for n, p in model.named_parameters()})
        if strategy == "canzona":
            opt.close()
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import canzona

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        plan = canzona.plan_model(shard(build_model(), mesh), dp=world, hardware="cpu")
        out = _run(mesh, plan)
        start = {n: p.full_tensor().detach()
                 for n, p in shard(build_model(), mesh).named_parameters()}
        if rank == 0:
            ref = out["dist-muon"][1]
            rows = {}
            for strategy, (times, params) in out.items():
                diff = max(_relative(params[n], ref[n]) for n in ref)
                moved = (sum(float((params[n] - start[n]).norm()) ** 2 for n in ref)
                         / sum(float(start[n].norm()) ** 2 for n in ref)) ** 0.5
                rows[strategy] = (statistics.median(times[WARMUP:WARMUP + TIMED]), diff, moved)
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def _relative(a, b) -> float:  # noqa: ANN001
    """|a − b| / max(|a|, |b|): 0 for equal tensors, zeros included."""
    scale = max(float(a.norm()), float(b.norm()))
    return float((a - b).norm()) / scale if scale else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(world, _free_port(), queue), nprocs=world,
                       start_method="spawn")
    return queue.get(timeout=60)


def measured_lines() -> list[str]:
    lines = [f"**Measured** on this machine's CPUs (gloo; {LAYERS} blocks of {DIM}×{FFN}, "
             f"{STEPS} steps, the median of iterations {WARMUP + 1}–{WARMUP + TIMED}):", "",
             "| dp | strategy | iteration | × dist-muon | parameters vs dist-muon | moved from "
             "the start |", "|---:|---|---:|---:|---:|---:|"]
    for world in (2, 4):
        rows = measure(world)
        base = rows["dist-muon"][0]
        for name in STRATEGIES:
            t, diff, moved = rows[name]
            lines.append(f"| {world} | {name} | {t * 1e3:.1f} ms | {t / base:.2f} | "
                         f"{diff:.1e} | {moved:.1e} |")
    return lines


def modelled() -> dict[int, dict]:
    """Per rank count of :data:`SCALE`, each strategy's solution (``canzona.planner.fsdp2``)."""
    from canzona.planner.fsdp2 import make_fsdp2_problem, solve_fsdp2
    from canzona.planner.hardware import load_hardware
    from canzona.planner.inventory import build_inventory
    from canzona.planner.models import get_preset
    from canzona.planner.settings import OptimizerSettings

    model, sizes, hw = SCALE
    spec = build_inventory(get_preset(model))
    out = {}
    for dp in sizes:
        problem = make_fsdp2_problem(spec, dp, OptimizerSettings(), hardware=load_hardware(hw))
        out[dp] = {name: solve_fsdp2(problem, name) for name in ("canzona", "dist-muon", "sync")}
    return out


def figures() -> dict[str, float]:
    """The modelled figures the README quotes (``benchmarks/check_docs.py``): canzona's
    matrices' step over DistMuon's, and over the bound, per rank count."""
    out = {}
    for dp, sols in modelled().items():
        mine = sols["canzona"]
        out[f"vs_dist_muon_{dp}"] = mine.step_s / sols["dist-muon"].step_s
        out[f"over_bound_{dp}"] = mine.step_s / mine.bound_s
    return out


def modelled_lines() -> list[str]:
    model, _, hw = SCALE
    lines = [f"**Modelled**: {model}, Muon, {hw}, the Newton–Schulz inputs and updates in bf16 "
             "(`canzona compare --storage fsdp2`):", "",
             "| ranks | strategy | matrices' step | × bound | × dist-muon | rounds | "
             "shared by pairs |", "|---:|---|---:|---:|---:|---:|---:|"]
    for dp, sols in modelled().items():
        base = sols["dist-muon"].step_s
        for name, sol in sols.items():
            lines.append(f"| {dp} | {name} | {sol.step_s * 1e3:.2f} ms | "
                         f"{sol.step_s / sol.bound_s:.3f} | {sol.step_s / base:.3f} | "
                         f"{len(sol.rounds)} | {len(sol.shared)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-readme", action="store_true",
                    help="also replace the section of benchmarks/README.md")
    ap.add_argument("--modelled-only", action="store_true", help="skip the measured runs")
    args = ap.parse_args(argv)
    lines = [SECTION, "", "`python benchmarks/bench_fsdp2.py --write-readme`", ""]
    if not args.modelled_only:
        lines += measured_lines() + [""]
    lines += modelled_lines()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_readme:
        old = README.read_text(encoding="utf-8")
        pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
        new = pattern.sub(text + "\n", old) if pattern.search(old) else \
            old.rstrip("\n") + "\n\n" + text
        README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
