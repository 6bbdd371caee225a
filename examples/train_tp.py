"""Train a small GPT under data × tensor parallelism with canzona (DTensor TP, torch-native).

    torchrun --standalone --nproc-per-node 4 examples/train_tp.py --tp 2     # dp 2 × tp 2, gloo
    torchrun --standalone --nproc-per-node 2 examples/train_tp.py --tp 2     # dp 1 × tp 2
    torchrun --standalone --nproc-per-node 4 examples/train_tp.py --tp 2 --share all-split
    torchrun --standalone --nproc-per-node 4 examples/train_tp.py --tp 4 --share sub-groups
    torchrun --standalone --nproc-per-node 4 examples/train_tp.py --tp 2 --qkv-split heads
    torchrun --standalone --nproc-per-node 4 examples/train_tp.py --tp 2 --qk-clip 1

The model keeps q/k/v and gate/up as separate projections; ``parallelize_module`` splits them
column-wise and o/down row-wise over the ``tp`` dim of a 2-D DeviceMesh (dims ``dp``, ``tp``).
``canzona.plan_model(model, dp=, tp=)`` reads the placements; ``CanzonaOptimizer(model, plan,
device_mesh=mesh)`` reduce-scatters the gradients over DP, and for each TP-split matrix gathers
its shards to one host TP rank, updates the whole matrix there (Muon/Shampoo/SOAP) and scatters
the update back, micro-group by micro-group. The embedding, norms and the output layer are not
parallelised: replicated, updated identically on every TP rank. ``--share`` (Muon): the TP group
shares matrices instead (shared Newton–Schulz over the shards, nothing gathered; ``all-split``
every one, with the polynomial split; ``sub-groups`` at tp ≥ 4: alike matrices in rounds, each
shared by k < tp strided TP ranks that gather its rows first). ``--qkv-split heads``: q, k
and v orthogonalised head by head, each TP rank the heads of its own shard in one batch.
``--qk-clip TAU`` (MuonClip): each block records its heads' largest logit
(``canzona.runtime.qk_clip.max_logits``) and after every step ``opt.qk_clip_`` scales the query
and key rows of the heads above TAU. Data: arithmetic progressions (each DP rank its own), so
the loss falls within 100 steps.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import canzona
from canzona.planner.heads import is_head
from canzona.runtime.qk_clip import LogitRecorder, max_logits


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = (nn.Linear(dim, 4 * dim, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)
        self.record = None  # QK-clip: called with this rank's heads' largest logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln_1(x)
        # Under TP the column-parallel projections hold this rank's heads (-1: their number).
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q_proj, self.k_proj, self.v_proj))
        if self.record is not None:
            self.record(max_logits(q, k, causal=True))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ln_2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def progressions(gen: torch.Generator, batch: int, seq: int, vocab: int):
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 5, (batch, 1), generator=gen)
    data = (start + stride * torch.arange(seq + 1)) % vocab
    return data[:, :-1], data[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the world)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "normuon", "shampoo", "soap"])
    ap.add_argument("--ns", default="simple", choices=["simple", "quintic", "polar_express"],
                    help="(Nor)Muon's Newton–Schulz schedule, recorded in the plan")
    ap.add_argument("--qkv-split", default="fused", choices=["fused", "heads"],
                    help="heads: orthogonalise q, k and v head by head (each TP rank the heads "
                         "of its own shard, batched, nothing gathered); fused: each projection "
                         "whole (the model keeps q, k and v apart, so qkv is the same)")
    ap.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                    help="QK-clip after every step: heads whose largest attention logit exceeds "
                         "TAU have their query and key rows scaled down")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="sequences per DP rank")
    ap.add_argument("--share", default="auto",
                    choices=["off", "auto", "all", "all-split", "pairs", "sub-groups"],
                    help="Muon matrices shared by their TP group instead of gathered to a host; "
                         "pairs: the column-parallel ones by the TP groups of both DP indices "
                         "(k = 2·tp); sub-groups (tp ≥ 4): alike matrices in rounds, each "
                         "shared by k < tp strided TP ranks (Shampoo: blocks preconditioned "
                         "shard by shard where the TP shards are whole blocks, see --block)")
    ap.add_argument("--block", type=int, default=None,
                    help="Shampoo's max_preconditioner_dim (default 1024; 16 makes every TP "
                         "shard of the default model whole blocks)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the world size {world}")
    dp = world // args.tp
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same initial weights on every rank
    vocab = 256
    model = GPT(vocab, args.dim, args.layers, heads=4).to(device)
    plan_tp = {}
    for i in range(args.layers):
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            plan_tp[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("o_proj", "down_proj"):
            plan_tp[f"blocks.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan_tp)

    extra = {} if args.block is None else {"max_preconditioner_dim": args.block}
    if args.ns != "simple":
        extra["ns_coefficients"] = args.ns
    if args.qkv_split == "heads":
        extra.update(qkv_split="heads", head_dim=model.blocks[0].head_dim)
    plan = canzona.plan_model(model, dp=dp, tp=args.tp, optimizer=args.optimizer,
                              bucket_size=1_000_000, share=args.share, **extra)
    lr = 0.02 if args.optimizer in ("muon", "normuon") else 3e-3
    opt = canzona.CanzonaOptimizer(model, plan, lr=lr, adamw_lr=3e-3, device_mesh=mesh)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    if rank == 0:
        groups = [len(ix.groups) for ix in plan.tp.indices]
        shared = [len(ix.shared) for ix in plan.tp.indices]
        paired = (f" ({len(plan.dp_shared)} of them with the partner DP index's TP group, "
                  f"k = 2·tp)" if plan.dp_shared else "")
        subs = sum(x.sub is not None for ix in plan.tp.indices for x in ix.shared)
        if subs:
            paired += f" ({subs} of them in rounds of TP sub-groups)"
        heads = sum(is_head(t.part) for t in plan.tasks)
        per_head = f", {heads} attention heads where they lie" if heads else ""
        print(f"dp={dp} tp={args.tp}, {plan.total_params:,} params, {plan.inputs.optimizer.name}; "
              f"micro-groups per DP index {groups}, matrices shared by the TP group {shared}"
              f"{paired}{per_head}; "
              f"TP scratch per rank (gathered matrices or a lockstep batch) "
              f"{opt.tp_scratch_bytes() / 2**10:.0f} KiB", flush=True)

    logits = LogitRecorder()  # QK-clip: each block's largest logits, this rank's heads
    if args.qk_clip:
        for i, blk in enumerate(model.blocks):
            blk.record = functools.partial(logits.add, f"blocks.{i}")
    gen = torch.Generator().manual_seed(1234 + mesh.get_local_rank("dp"))  # data per DP rank
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in progressions(gen, args.batch, args.seq, vocab))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        top = ""
        if args.qk_clip:  # the maxima reduced over DP, then the heads above TAU scaled
            top = f"  max logit {opt.qk_clip_(logits.pop(), threshold=args.qk_clip):.2f}"
        sched.step()
        opt.zero_grad()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}{top}  "
                  f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.0f} ms/step", flush=True)
    opt.close()  # wait for the optimizer's collectives before tearing the groups down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
