"""Train a small GPT sharded by FSDP2 (``fully_shard``) with canzona's planned owners.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp2.py           # CPU, gloo
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp2.py --optimizer shampoo
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp2.py --tp 2    # dp 2 × tp 2

FSDP2 keeps every parameter as ``Shard(0)`` rows over the DP ranks, reduces the gradients into
those rows and all-gathers the parameters before each forward, as in torchtitan. canzona only
runs the optimizer step: ``canzona.plan_model`` of the sharded model plans each matrix's owner
and the all-to-all rounds that bring its rows there and its update rows back (an FSDP2 plan);
``CanzonaOptimizer`` executes it, round k + 1's gather running during round k's Newton–Schulz.
AdamW parameters are updated on every rank's own rows. ``--tp T`` first splits each block's MLP
over a TP dimension of the mesh (``parallelize_module``: fc1 column-, fc2 row-parallel), as
torchtitan composes TP and FSDP2; every GPU of the dp × tp mesh may then own matrices. The data
are synthetic arithmetic progressions, so the loss visibly falls within 100 steps.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import canzona


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads)
                   .permute(2, 0, 3, 1, 4))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def progressions(gen: torch.Generator, batch: int, seq: int,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic progressions mod vocab (random start, stride 1-4)."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 5, (batch, 1), generator=gen)
    data = (start + stride * torch.arange(seq + 1)) % vocab
    return data[:, :-1], data[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the MLPs)")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--save-plan", help="write the plan here (rank 0)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the {world} ranks")
    dp = world // args.tp
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    torch.manual_seed(0)  # the same initial weights on every rank
    vocab = 256
    model = GPT(vocab, args.dim, args.layers, heads=4, seq=args.seq).to(device)
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    if args.tp > 1:  # TP first, then FSDP2 over the dp dimension (torchtitan's order)
        for blk in model.blocks:
            parallelize_module(blk, mesh["tp"], {"fc1": ColwiseParallel(),
                                                 "fc2": RowwiseParallel()})
    for blk in model.blocks:  # torchtitan's wrapping: each block, then the whole model
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    # A fully_shard-ed model plans for FSDP2's storage: owners and all-to-all rounds (with TP,
    # over the whole dp × tp mesh).
    plan = canzona.plan_model(model, dp=dp, tp=args.tp, optimizer=args.optimizer)
    if args.save_plan and rank == 0:
        canzona.save_plan(plan, args.save_plan)
    lr = args.lr if args.optimizer == "muon" else 3e-3
    opt = canzona.CanzonaOptimizer(model, plan, lr=lr, adamw_lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    if rank == 0:
        sec = plan.fsdp2
        print(f"{plan.inputs.model}: {plan.total_params:,} params, dp={dp} tp={args.tp} "
              f"(FSDP2), "
              f"{plan.inputs.optimizer.name}; {len(sec.rounds)} all-to-all rounds, owners' "
              f"load max/mean {plan.metrics.max_over_mean:.3f}", flush=True)

    t0 = time.perf_counter()
    for step in range(args.steps):
        # each DP rank its own data, the same on the TP ranks of one DP index
        gen = torch.Generator().manual_seed(1234 + 1000 * step + rank // args.tp)
        x, y = (t.to(device) for t in progressions(gen, args.batch, args.seq, vocab))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()  # FSDP2 reduce-scatters the gradients into each rank's rows
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                print(f"step {step:4d}  loss {avg.item() / world:.4f}  grad norm "
                      f"{norm.item():.3f}  {time.perf_counter() - t0:.1f} s", flush=True)
    opt.close()  # every collective finished before the process group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
