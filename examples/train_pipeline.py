"""Train a small GPT split into pipeline stages with ``torch.distributed.pipelining``
(``PipelineStage``, ``Schedule1F1B``) and canzona's optimizer on each stage.

    torchrun --standalone --nproc-per-node 4 examples/train_pipeline.py           # pp 2 × dp 2
    torchrun --standalone --nproc-per-node 4 examples/train_pipeline.py --pp 4    # pp 4 × dp 1
    torchrun --standalone --nproc-per-node 2 examples/train_pipeline.py --untied --optimizer shampoo

Ranks are pipeline-major (rank = stage · dp + d): each stage's ranks form its DP group and the
ranks of one DP index across the stages its pipeline group. Every rank plans the whole model
with ``canzona.plan_model(model, dp=, pp=)``, a plan per stage in one ``PipelinePlan``, and
builds ``CanzonaOptimizer(stage_module, plan, dp_group=, pp_group=)`` on its stage's module: it
runs that stage's plan, renumbers the stage's layers to the whole model's, sums the gradient norm
over the stages and, with tied embeddings, the two copies' gradients (the first stage's
embedding, the last stage's head), which stay bit-identical.

The whole schedule step runs under ``opt.no_sync()``: every microbatch's gradients accumulate
in canzona's buckets, and ``step()`` reduces them once. Each microbatch's loss is divided by the
number of microbatches (``scale_grads=False``: canzona takes the gradients from backward hooks,
before a schedule could scale them), so the step sees the batch's mean. The data are synthetic
arithmetic progressions, so the loss falls within 100 steps.
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import canzona

VOCAB = 256


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
    """The whole model, its decoder layers named ``layers.{i}`` (what canzona splits by)."""

    def __init__(self, dim: int, layers: int, *, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # as GPT-2: a tied head starts near uniform
        self.layers = nn.ModuleDict({str(i): Block(dim, heads=4) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


class Stage(nn.Module):
    """Stage ``s`` of ``pp`` of ``whole`` (torchtitan's way: the other layers deleted, the keys
    kept): the embedding on the first stage, the norm and the head on the last (tied: its own
    copy of the embedding's weight)."""

    def __init__(self, whole: GPT, s: int, pp: int, counts: list[int]) -> None:
        super().__init__()
        first = sum(counts[:s])
        keep = {str(i) for i in range(first, first + counts[s])}
        self.embed = whole.embed if s == 0 else None
        self.layers = nn.ModuleDict({k: v for k, v in whole.layers.items() if k in keep})
        self.norm = whole.norm if s == pp - 1 else None
        self.lm_head = None
        if s == pp - 1:
            self.lm_head = nn.Linear(whole.norm.normalized_shape[0], VOCAB, bias=False)
            self.lm_head.weight = nn.Parameter(whole.lm_head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def progressions(gen: torch.Generator, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic progressions mod VOCAB (random start, stride 1-4)."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, 5, (batch, 1), generator=gen)
    data = (start + stride * torch.arange(seq + 1)) % VOCAB
    return data[:, :-1], data[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (divides the world)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="sequences per DP rank and step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--untied", action="store_true", help="a head of its own")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} must divide the {world} ranks")
    pp, dp = args.pp, world // args.pp
    dp_groups = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(pp)]
    pp_groups = [dist.new_group([s * dp + d for s in range(pp)]) for d in range(dp)]
    s, d = divmod(rank, dp)

    torch.manual_seed(0)  # the same initial weights on every rank
    whole = GPT(args.dim, args.layers, tied=not args.untied)
    plan = canzona.plan_model(whole, dp=dp, pp=pp, optimizer=args.optimizer,
                              bucket_size=1_000_000)
    counts = [p.inputs.stage.layers for p in plan.stages]
    module = Stage(whole, s, pp, counts)
    lr = args.lr if args.optimizer == "muon" else 3e-3
    opt = canzona.CanzonaOptimizer(module, plan, dp_group=dp_groups[s], pp_group=pp_groups[d],
                                   lr=lr, adamw_lr=3e-3)
    micro = args.microbatches

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()) / micro

    schedule = Schedule1F1B(PipelineStage(module, s, pp, torch.device("cpu"),
                                          group=pp_groups[d]),
                            micro, loss_fn=loss_fn, scale_grads=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 20) * 0.5 * (1 + math.cos(math.pi * i / args.steps)))
    if rank == 0:
        print(f"{plan.stages[0].inputs.model}: pp={pp} × dp={dp}, layers per stage {counts}, "
              f"{args.optimizer}" + ("" if args.untied else ", tied embeddings"), flush=True)
    t0 = time.perf_counter()
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1234 + 1000 * step + d)  # each DP index its data
        x, y = progressions(gen, args.batch, args.seq)
        losses: list[torch.Tensor] = []
        with opt.no_sync():  # every microbatch accumulates; step() reduces once
            if s == 0:
                schedule.step(x)
            elif s == pp - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        if s == pp - 1 and d == 0 and (step % 10 == 0 or step == args.steps - 1):
            loss = sum(float(v.detach()) for v in losses)
            print(f"step {step:4d}  loss {loss:.4f}  grad norm {float(norm):.3f}  "
                  f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.0f} ms/step", flush=True)
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
