"""What a logical checkpoint costs against the per-rank state dict, side by side in one run.

    python benchmarks/bench_checkpoint.py [--dim 1024] [--layers 8] [--json]

One process (dp 1, no process group), a GPT of ``--layers`` blocks of width ``--dim`` trained one
step with Muon (so every state tensor exists). Per round, interleaved: ``canzona.save_checkpoint``
(DCP, logical keys, crash-safe publishing) and ``load_checkpoint`` into a fresh model and
optimizer, against ``torch.save`` / ``torch.load`` of ``model.state_dict()`` and
``opt.state_dict()`` (what loads only under the same plan and rank). Medians of the rounds; the
ratio is logical / per-rank.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import canzona


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.fc2(torch.relu(self.fc1(self.ln(x))))
                + self.proj(self.qkv(x)[..., :x.shape[-1]]))


class Model(nn.Module):
    def __init__(self, dim: int, layers: int, vocab: int = 4096) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(dim: int, layers: int):
    model = Model(dim, layers)
    plan = canzona.plan_model(model, dp=1)
    return model, canzona.CanzonaOptimizer(model, plan, lr=0.02, ns_dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model, opt = build(args.dim, args.layers)
    idx = torch.randint(0, 4096, (2, 16))
    model(idx).float().mean().backward()
    opt.step()
    opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    fresh, fresh_opt = build(args.dim, args.layers)
    tmp = Path(tempfile.mkdtemp(prefix="canzona-bench-ck-"))
    times: dict[str, list[float]] = {k: [] for k in ("dcp_save", "dcp_load", "torch_save",
                                                       "torch_load")}
    try:
        for _ in range(args.rounds):
            t = time.perf_counter()
            canzona.save_checkpoint(tmp / "logical", model, opt)
            times["dcp_save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            canzona.load_checkpoint(tmp / "logical", fresh, fresh_opt)
            times["dcp_load"].append(time.perf_counter() - t)
            t = time.perf_counter()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp / "rank.pt")
            times["torch_save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            sd = torch.load(tmp / "rank.pt", weights_only=True)
            fresh.load_state_dict(sd["model"])
            fresh_opt.load_state_dict(sd["opt"])
            times["torch_load"].append(time.perf_counter() - t)
        size = {"logical": sum(f.stat().st_size for f in (tmp / "logical").iterdir()),
                "per_rank": (tmp / "rank.pt").stat().st_size}
    finally:
        shutil.rmtree(tmp)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"params": params, "median_s": med, "bytes": size,
           "save_ratio": med["dcp_save"] / med["torch_save"],
           "load_ratio": med["dcp_load"] / med["torch_load"]}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{params / 1e6:.1f}M parameters, Muon state, {args.rounds} rounds (medians)")
    print(f"  save: logical {med['dcp_save']:.3f} s   per-rank torch.save {med['torch_save']:.3f} s"
          f"   ratio {out['save_ratio']:.2f}")
    print(f"  load: logical {med['dcp_load']:.3f} s   per-rank torch.load {med['torch_load']:.3f} s"
          f"   ratio {out['load_ratio']:.2f}")
    print(f"  size: logical {size['logical'] / 2**20:.1f} MiB"
          f"   per-rank {size['per_rank'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
