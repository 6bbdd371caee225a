"""Train a small GPT with canzona's ZeRO-1 runtime (Muon/Shampoo/SOAP on whole matrices).

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py            # CPU, gloo
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --optimizer soap --accum 2
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --share all --dim 256  # DP pairs

No DDP wrapper: canzona reduces the gradients itself (bucketed, asynchronous reduce-scatters
started by backward hooks), updates the matrices this rank owns and all-gathers the parameters.
Every rank plans the model itself (plans are deterministic, and the optimizer checks that all ranks
hold the same one); ``--plan FILE`` loads a plan from ``canzona plan`` or ``--save-plan`` instead.
The data are synthetic arithmetic progressions, so the loss visibly falls within 100 steps.
``opt.close()`` before ``destroy_process_group()`` finishes the optimizer's collectives.

Checkpoints survive a change of plan: ``--checkpoint DIR`` saves (every ``--save-every`` steps and
at the end) with ``canzona.save_checkpoint``; ``--resume DIR`` continues from one, also under
another number of ranks (a folder outside the clone: the example writes only where told)::

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py \\
        --checkpoint /tmp/canzona-ck --stop-at 50
    torchrun --standalone --nproc-per-node 1 examples/train_gpt.py --resume /tmp/canzona-ck
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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
    """Arithmetic progressions mod vocab (random start, stride 1-4): the stride can be read from
    two tokens, so the loss falls from ln(vocab) towards 0."""
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
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and micro-batch")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--share", default="auto", choices=["off", "auto", "all", "all-split"],
                    help="split matrices over two DP ranks (Muon: shared Newton–Schulz; "
                         "Shampoo: block rows hosted apart); all: every eligible one")
    ap.add_argument("--plan", help="load this plan instead of planning the model")
    ap.add_argument("--save-plan", help="write the plan here (rank 0)")
    ap.add_argument("--checkpoint", help="save a checkpoint here (crash-safe, any plan resumes it)")
    ap.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    ap.add_argument("--resume", help="continue from this checkpoint (saved under any plan)")
    ap.add_argument("--stop-at", type=int, help="leave after this many steps, as if preempted "
                    "(saving first with --checkpoint): to try --resume")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    torch.manual_seed(0)  # the same initial weights on every rank
    vocab = 256
    model = GPT(vocab, args.dim, args.layers, heads=4, seq=args.seq).to(device)
    plan = canzona.load_plan(args.plan) if args.plan else canzona.plan_model(
        model, dp=world, optimizer=args.optimizer, bucket_size=1_000_000, share=args.share)
    if args.save_plan and rank == 0:
        canzona.save_plan(plan, args.save_plan)
    lr = args.lr if args.optimizer == "muon" else 3e-3
    opt = canzona.CanzonaOptimizer(model, plan, lr=lr, adamw_lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    if rank == 0:
        m = plan.metrics
        print(f"{plan.inputs.model}: {plan.total_params:,} params, dp={world}, "
              f"{plan.inputs.optimizer.name}; optimizer state per rank {list(m.dp_state_bytes)} B, "
              f"load max/mean {m.max_over_mean:.3f}; {len(plan.dp_shared)} matrices split over "
              f"two DP ranks", flush=True)

    progress = {"step": torch.tensor(0)}  # saved with the checkpoint (extra=)
    if args.resume:
        canzona.load_checkpoint(args.resume, model, opt, extra={"sched": sched,
                                                                "progress": progress})
        if rank == 0:
            print(f"resumed from {args.resume} at step {int(progress['step'])}", flush=True)
    first = int(progress["step"])
    t0 = time.perf_counter()
    for step in range(first, args.steps):
        total = 0.0
        gen = torch.Generator().manual_seed(1234 + 1000 * step + rank)  # each rank its own data
        for micro in range(args.accum):
            x, y = (t.to(device) for t in progressions(gen, args.batch, args.seq, vocab))
            # All but the last micro-batch accumulate locally; the last one reduces once.
            ctx = opt.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accum
                loss.backward()
            total += loss.item()
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {total:.4f}  grad norm {norm.item():.3f}  "
                  f"{(time.perf_counter() - t0) / (step + 1 - first) * 1e3:.0f} ms/step",
                  flush=True)
        last = step == args.steps - 1 or step + 1 == args.stop_at
        if args.checkpoint and (last or (args.save_every and (step + 1) % args.save_every == 0)):
            progress["step"] = torch.tensor(step + 1)
            canzona.save_checkpoint(args.checkpoint, model, opt,
                                    extra={"sched": sched, "progress": progress})
            if rank == 0:
                print(f"saved {args.checkpoint} at step {step + 1}", flush=True)
        if step + 1 == args.stop_at:
            break
    # Before tearing the group down: wait for the collectives still running (and give gloo's
    # threads a moment to free them), drop the optimizer's hooks and its hold on the group.
    # Without it the run could abort at exit ("terminate called without an active exception").
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
