"""A small MoE trained by canzona on 4 gloo ranks at ep 2 (expert-DP 2) against the same model at
ep 1 (every rank holds every expert), side by side: optimizer step, iteration, optimizer state
and bytes sent per rank, and the losses (which must agree).

The model: token embedding, ``--layers`` blocks of a dense projection and a top-1 routed MoE of
``--experts`` SwiGLU experts (per-expert 2-D weights, ``experts.{j}``), an output layer. Under
ep > 1 each rank holds E/ep experts and sends each token to its expert's EP rank with
``all_to_all_single`` (uneven splits, autograd through both directions). Both runs plan with
``canzona.plan_model(model, dp=4, ep=...)`` and run ``CanzonaOptimizer`` (Muon, Newton–Schulz in
float32) with a ``("edp", "ep")`` mesh. The two runs alternate round by round; medians over the
rounds of the slowest rank per iteration.

Usage::

    python benchmarks/bench_moe_ep.py [--dim 256] [--experts 8] [--layers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
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

VOCAB, WORLD = 512, 4


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class RoutedMoE(nn.Module):
    """Top-1 routing; this rank's experts are global ``first`` … ``first + count - 1``."""

    def __init__(self, dim: int, ffn: int, experts: int, first: int, count: int, group) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, ffn) for _ in range(count))
        self.first, self.count, self.group = first, count, group

    def _run_local(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for j, ex in enumerate(self.experts):
            rows = torch.nonzero(ids == self.first + j).flatten()
            if rows.numel():
                out = out.index_add(0, rows, ex(x[rows]))
        return out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        shape = h.shape
        x = h.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x), dim=-1)
        weight, expert = probs.max(dim=-1)
        if self.group is None:
            return (self._run_local(x, expert) * weight[:, None]).reshape(shape)
        order = torch.argsort(expert, stable=True)
        dest = expert[order] // self.count
        ep = dist.get_world_size(self.group)
        send = torch.bincount(dest, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        ids = torch.empty(sum(recv_sizes), dtype=expert.dtype)
        dist.all_to_all_single(ids, expert[order].contiguous(), recv_sizes, send_sizes,
                               group=self.group)
        tokens = all_to_all_single(torch.empty(sum(recv_sizes), shape[-1]), x[order].contiguous(),
                                   recv_sizes, send_sizes, group=self.group)
        done = all_to_all_single(torch.empty(x.shape), self._run_local(tokens, ids),
                                 send_sizes, recv_sizes, group=self.group)
        back = torch.empty_like(done).index_copy(0, order, done)
        return (back * weight[:, None]).reshape(shape)


class Block(nn.Module):
    def __init__(self, dim, ffn, experts, first, count, group) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = RoutedMoE(dim, ffn, experts, first, count, group)

    def forward(self, x):
        x = x + self.proj(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class TinyMoE(nn.Module):
    """Every weight from one seed, the experts by global index: ep 1 and ep 2 start alike."""

    def __init__(self, args, ep: int, ep_rank: int, group) -> None:
        super().__init__()
        count = args.experts // ep
        self.embed = nn.Embedding(VOCAB, args.dim)
        self.blocks = nn.ModuleList(
            Block(args.dim, args.ffn, args.experts, ep_rank * count, count, group)
            for _ in range(args.layers))
        self.head = nn.Linear(args.dim, VOCAB, bias=False)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if ".experts." not in n:
                    p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
                            if p.dim() > 1 else torch.ones(p.shape))
            for blk in self.blocks:
                full = [[torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
                         for p in blk.mlp.experts[0].parameters()] for _ in range(args.experts)]
                for j, ex in enumerate(blk.mlp.experts):
                    for p, w in zip(ex.parameters(), full[ep_rank * count + j]):
                        p.copy_(w)

    def forward(self, idx):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _worker(rank: int, port: int, args, out: str) -> None:
    import canzona
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    runs = {}
    for ep in (1, 2):
        mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("edp", "ep"))
        ep_rank = mesh.get_local_rank("ep")
        model = TinyMoE(args, ep, ep_rank, mesh.get_group("ep") if ep > 1 else None)
        plan = canzona.plan_model(model, dp=WORLD, ep=ep, hardware="cpu")
        opt = canzona.CanzonaOptimizer(model, plan, device_mesh=mesh, ns_dtype=torch.float32,
                                       lr=0.02, adamw_lr=3e-3)
        runs[ep] = {"model": model, "opt": opt, "step": [], "iter": [], "loss": [],
                    "state": opt.state_bytes(), "comm": sum(opt.comm_bytes().values()),
                    "params": plan.total_params, "local": sum(p.numel() for p in
                                                              model.parameters())}
    g = torch.Generator().manual_seed(1 + rank)
    data = [torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
            for _ in range(args.rounds + 1)]
    for r in range(args.rounds + 1):  # round 0 warms up
        for ep, run in runs.items():
            model, opt = run["model"], run["opt"]
            x, y = data[r][:, :-1], data[r][:, 1:]
            dist.barrier()
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            times = torch.tensor([t2 - t1, t2 - t0])
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if r:
                run["step"].append(float(times[0]))
                run["iter"].append(float(times[1]))
                run["loss"].append(float(mean) / WORLD)
    if rank == 0:
        torch.save({ep: {k: v for k, v in run.items() if k not in ("model", "opt")}
                    for ep, run in runs.items()}, os.path.join(out, "result.pt"))
    for run in runs.values():
        run["opt"].close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(_worker, args=(port, args, out), nprocs=WORLD, join=True)
        res = torch.load(os.path.join(out, "result.pt"), weights_only=False)
    one, two = res[1], res[2]
    print(f"4 gloo ranks, one thread each; {one['params']:,} parameters, {args.experts} experts of "
          f"{args.dim}×{args.ffn}, {args.layers} layers, {args.batch}×{args.seq} tokens per rank; "
          f"median of {args.rounds} rounds, slowest rank")
    print("| run | parameters per rank | optimizer step s | iteration s | optimizer state MB per "
          "rank | MB sent per rank per step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in (("ep 1 (every expert on every rank)", one), ("ep 2 (expert-DP 2)", two)):
        print(f"| {name} | {r['local']:,} | {statistics.median(r['step']):.3f} | "
              f"{statistics.median(r['iter']):.3f} | {r['state'] / 1e6:.2f} | "
              f"{r['comm'] / 1e6:.2f} |")
    ratio = lambda k: statistics.median(one[k]) / statistics.median(two[k])  # noqa: E731
    print(f"ep 2 against ep 1: optimizer step {ratio('step'):.2f}× faster, iteration "
          f"{ratio('iter'):.2f}×, state {one['state'] / two['state']:.2f}× smaller, bytes "
          f"{one['comm'] / two['comm']:.2f}× fewer")
    worst = max(abs(a - b) / abs(b) for a, b in zip(two["loss"], one["loss"]))
    print(f"losses: ep 1 {[round(x, 4) for x in one['loss']]}, ep 2 "
          f"{[round(x, 4) for x in two['loss']]} (largest relative difference {worst:.1e})")


if __name__ == "__main__":
    main()
