"""Optimizer step and iteration time of canzona's DP runtime against two baselines, side by side.

DP = 2 gloo ranks on this machine, one thread each, the same transformer, the same Muon kernel
(``canzona.runtime.optim.Muon``, Newton–Schulz in float32 on the CPU) and the same AdamW kernel:

* ``sync``: DDP all-reduces the gradients in backward; every rank updates every matrix (the
  synchronous baseline, how DDP + Muon runs);
* ``layerwise``: DDP all-reduces the gradients; each rank updates whole parameters dealt by LPT on
  Megatron's cost max(m,n)·min(m,n)² (AdamW parameters by numel; the simulator's
  ``layerwise-lpt``), then one all-gather (padded to the largest rank) returns them — Megatron's
  ``LayerWiseDistributedOptimizer`` with that dealing;
* ``canzona``: no DDP; ``CanzonaOptimizer`` reduce-scatters buckets during backward, updates the
  matrices of its plan and all-gathers (``canzona.plan_model``, default solver).

The strategies alternate round by round so machine noise hits them alike; medians are reported.
Bytes are those each rank sends per step (ring all-reduce 2(R−1)/R·S, all-gather and
reduce-scatter (R−1)/R·S, padding included).

Usage::

    python benchmarks/bench_dp_step.py [--dim 384] [--layers 2] [--rounds 4] [--write-readme]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB, HEADS = 512, 8


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                          .transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class Model(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _kernels(lr: float):
    from canzona.runtime.optim import AdamW, AdamWConfig, Muon, MuonConfig

    return Muon(MuonConfig(lr=lr, ns_dtype=torch.float32)), AdamW(AdamWConfig(lr=3e-3))


class LocalOptimizer:
    """Updates the parameters in ``mine`` (all of them for ``sync``) from all-reduced grads; with
    ``gather`` the owners' parameters are then all-gathered (padded flat buffers)."""

    def __init__(self, model: nn.Module, route: dict[str, str], owner: dict[str, int], rank: int,
                 world: int, gather: bool) -> None:
        self.muon, self.adamw = _kernels(0.02)
        self.named = list(model.named_parameters())
        self.rank, self.world, self.gather = rank, world, gather
        self.mats = [(n, p) for n, p in self.named if route[n] == "matrix" and owner[n] == rank]
        self.vecs = [(n, p) for n, p in self.named if route[n] != "matrix" and owner[n] == rank]
        self.mstates = [self.muon.init_state(p.shape) for _, p in self.mats]
        self.vstates = [self.adamw.init_state(p.shape) for _, p in self.vecs]
        self.by_rank = [[p for n, p in self.named if owner[n] == r] for r in range(world)]
        self.max_numel = max(sum(p.numel() for p in ps) for ps in self.by_rank)

    @torch.no_grad()
    def step(self) -> None:
        if self.mats:
            ps = [p for _, p in self.mats]
            ups = self.muon.direction([p.grad for p in ps], self.mstates)
            for p, u in zip(ps, ups):
                self.muon.apply(p, u)
        if self.vecs:
            ps = [p for _, p in self.vecs]
            self.adamw.step(ps, [p.grad for p in ps], self.vstates)
        if self.gather:
            send = torch.zeros(self.max_numel)
            flat = torch.cat([p.reshape(-1) for p in self.by_rank[self.rank]])
            send[:flat.numel()].copy_(flat)
            out = torch.empty(self.world * self.max_numel)
            dist.all_gather_into_tensor(out, send)
            for r, ps in enumerate(self.by_rank):
                if r == self.rank:
                    continue
                off = r * self.max_numel
                for p in ps:
                    p.copy_(out[off:off + p.numel()].view_as(p))
                    off += p.numel()

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def sent_bytes(self, total_numel: int) -> dict[str, int]:
        r = self.world
        ar = 2 * (r - 1) * total_numel * 4 // r
        ag = (r - 1) * self.max_numel * 4 if self.gather else 0
        return {"all_reduce": ar, "all_gather": ag}


def layerwise_owners(named, route, world) -> dict[str, int]:
    """The layer-wise dealing by LPT on max(m,n)·min(m,n)² (AdamW tensors by numel)."""
    load = [0] * world
    owner = {}
    def cost(n, p):
        if route[n] == "matrix":
            m, k = p.shape
            return max(m, k) * min(m, k) ** 2
        return p.numel()
    for n, p in sorted(named, key=lambda np_: -cost(*np_)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[n] = r
        load[r] += cost(n, p)
    return owner


def strategies(rank: int, world: int, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Per strategy (sync, layerwise, canzona): its model, its optimizer, and the module the
    forward runs (DDP for the first two)."""
    import canzona
    from canzona.runtime.introspect import inventory

    route = {p.name: p.optimizer for p in inventory(Model(args.dim, args.layers)).params}
    models, opts, fwd = {}, {}, {}
    for name in ("sync", "layerwise", "canzona"):
        model = Model(args.dim, args.layers)
        named = list(model.named_parameters())
        models[name] = model
        if name == "canzona":
            plan = canzona.plan_model(model, dp=world, bucket_size=args.bucket_size)
            opts[name] = canzona.CanzonaOptimizer(model, plan, lr=0.02, ns_dtype=torch.float32,
                                                  adamw_lr=3e-3)
            fwd[name] = model
        else:
            owner = ({n: rank for n, _ in named} if name == "sync"
                     else layerwise_owners(named, route, world))
            fwd[name] = nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=args.bucket_size * 4 / 2**20)
            opts[name] = LocalOptimizer(model, route, owner, rank, world,
                                        gather=name == "layerwise")
    return models, opts, fwd


def timed_iteration(fwd: nn.Module, opt, x: torch.Tensor) -> tuple[float, float]:
    """One iteration after a barrier: (forward + backward seconds, ``opt.step()`` seconds);
    ``opt`` None times forward + backward alone."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = F.cross_entropy(fwd(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    loss.backward()
    t1 = time.perf_counter()
    if opt is not None:
        opt.step()
    t2 = time.perf_counter()
    if opt is not None:
        opt.zero_grad()
    else:
        fwd.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    models, opts, ddp = strategies(rank, world, args)
    total = sum(p.numel() for p in models["sync"].parameters())
    gen = torch.Generator().manual_seed(rank)
    times = {n: {"step": [], "iter": []} for n in opts}

    def iteration(name: str, record: bool) -> None:
        x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen)
        fb, step = timed_iteration(ddp[name], opts[name], x)
        if record:
            times[name]["step"].append(step)
            times[name]["iter"].append(fb + step)

    for name in opts:  # warm-up
        iteration(name, False)
    for _ in range(args.rounds):
        for name in opts:
            for _ in range(args.iters):
                iteration(name, True)
    # the slowest rank defines a step: max over ranks of the per-iteration times
    result = {}
    for name, tt in times.items():
        rec = {}
        for key, vals in tt.items():
            t = torch.tensor(vals, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rec[key] = statistics.median(t.tolist())
        result[name] = rec
    cz = opts["canzona"]
    result["bytes"] = {"sync": opts["sync"].sent_bytes(total),
                       "layerwise": opts["layerwise"].sent_bytes(total),
                       "canzona": cz.comm_bytes()}
    result["plan"] = {"max_over_mean": cz.plan.metrics.max_over_mean,
                      "buckets": sum(len(b.buckets) for b in cz.plan.buffers),
                      "methods": sorted(set(cz.collective_methods))}
    result["params"] = total
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    cz.close()  # wait for its collectives and release them before the group goes (README)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render(res: dict, args: argparse.Namespace) -> str:
    sync = res["sync"]
    lines = [
        f"`python benchmarks/bench_dp_step.py --dim {args.dim} --layers {args.layers}` "
        f"({platform.machine()}, {os.cpu_count()} CPUs, gloo, DP = 2, one thread per rank, "
        f"torch {torch.__version__}). Model: {res['params'] / 1e6:.1f}M parameters "
        f"({args.layers} blocks of width {args.dim}, {args.batch}×{args.seq} tokens per rank), "
        f"Muon (Newton–Schulz in fp32) on the matrices, AdamW on the rest; canzona plan: "
        f"{res['plan']['buckets']} buckets, load max/mean {res['plan']['max_over_mean']:.3f}, "
        f"collectives {', '.join(res['plan']['methods'])}. Median over "
        f"{args.rounds}×{args.iters} iterations, slowest rank per iteration.",
        "",
        "| strategy | optimizer step s | iteration s | step speed-up vs sync | "
        "iteration speed-up vs sync | MB sent per rank per step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("sync", "layerwise", "canzona"):
        r = res[name]
        mb = sum(res["bytes"][name].values()) / 1e6
        lines.append(f"| {name} | {r['step']:.3f} | {r['iter']:.3f} | "
                     f"{sync['step'] / r['step']:.2f}× | {sync['iter'] / r['iter']:.2f}× | "
                     f"{mb:.1f} |")
    b = res["bytes"]
    lines += ["", "Bytes: sync all-reduces the fp32 gradients in backward "
              f"({b['sync']['all_reduce'] / 1e6:.1f} MB); layerwise adds a padded all-gather of "
              f"the parameters ({b['layerwise']['all_gather'] / 1e6:.1f} MB); canzona "
              f"reduce-scatters ({b['canzona']['reduce_scatter'] / 1e6:.1f} MB) and all-gathers "
              f"({b['canzona']['all_gather'] / 1e6:.1f} MB). canzona's step includes waiting for "
              "its reduce-scatters (started in backward), the baselines' all-reduce is inside "
              "their backward, so the iteration column is the like-for-like comparison."]
    return "\n".join(lines) + "\n"


def model_arguments(ap: argparse.ArgumentParser, *, rounds: int) -> None:
    """The model's and the timing's flags (shared with ``bench_model_check.py``)."""
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-size", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--write-readme", action="store_true")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(ap, rounds=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        torch.multiprocessing.spawn(worker, args=(2, free_port(), args, out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    text = render(res, args)
    print(text)
    if args.write_readme:
        readme = Path(__file__).with_name("README.md")
        body = readme.read_text()
        section = "## DP runtime\n\n" + text
        if "## DP runtime" in body:
            body = re.sub(r"## DP runtime\n.*?(?=\n## |\Z)", lambda _m: section, body, flags=re.S)
        else:
            body = body.rstrip("\n") + "\n\n" + section
        readme.write_text(body)


if __name__ == "__main__":
    main()
