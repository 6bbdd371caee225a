"""Helpers of the DP runtime tests: a small transformer, a spawned gloo world, references.

The distributed side runs every case of a module inside one ``torch.multiprocessing`` spawn per
world size (each rank writes its results to a file); the references run in the test process.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, SEQ, LAYERS = 64, 32, 4, 8, 2
#: Sequences per step and micro-batch, split over the ranks. 256 tokens keep SOAP's statistics
#: (largest side 96) full rank: with degenerate eigenvalues its eigenbasis is not unique and the
#: last-bit differences of a distributed gradient sum pick another one.
GLOBAL_BATCH = 32
STEPS = 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.ln_2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM, bias=True)
        self.fc2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT with an unused parameter (``spare``): it never gets a gradient, so its bucket and
    every later one reduce only at ``step()``. ``spare=False`` leaves it out: then every bucket
    completes (and reduces) during backward."""

    def __init__(self, seed: int = 0, *, spare: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        if spare:
            self.spare = nn.Linear(DIM, DIM, bias=False)
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step and micro-batch (rank r takes ``rows(r, world)``)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def rows(rank: int, world: int) -> slice:
    n = GLOBAL_BATCH // world
    return slice(rank * n, (rank + 1) * n)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def lr_factor(step: int) -> float:
    return 1.0 - 0.04 * step


# --- the spawned world --------------------------------------------------------------------------


def rendezvous(folder: str) -> str:
    """A fresh ``file://`` rendezvous in ``folder`` for one spawned world: no TCP port to pick,
    which another process could take between the pick and the ranks' bind."""
    return "file://" + os.path.join(os.path.abspath(folder), f"rendezvous-{uuid.uuid4().hex}")


def init_gloo(rank: int, world: int, init_method: str, timeout_s: float = 30) -> None:
    """This spawned rank joins the ``world``-rank gloo group at ``init_method``
    (:func:`rendezvous`; one intra-op thread per rank); ``timeout_s``: the group's collective
    timeout."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _worker(rank: int, world: int, init_method: str, out: str,
            cases: list[tuple[str, Callable]]) -> None:
    init_gloo(rank, world, init_method)
    results = {}
    path = os.path.join(out, f"rank{rank}.pt")
    try:
        for name, fn in cases:
            try:
                results[name] = ("ok", fn(rank, world))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                results[name] = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
                torch.save(results, path)  # kept if the world fails before the end
            dist.barrier()
    finally:
        torch.save(results, path)
        dist.destroy_process_group()
    # The cases build optimizers without close() (the shutdown the README asks of trainers), and
    # torch 2.13 keeps the default group, so gloo's threads may outlive it into interpreter
    # shutdown and abort the rank. The results are saved: leave without that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(world: int, cases: list[tuple[str, Callable]], out: str) -> list[dict]:
    """Run every case on ``world`` gloo ranks (one start, from the fork server
    ``tests/conftest.py`` preloads); per rank, ``{case: result}``."""
    try:
        torch.multiprocessing.start_processes(
            _worker, args=(world, rendezvous(out), out, cases), nprocs=world, join=True,
            start_method="forkserver")
    except Exception as exc:
        # A case that raised on one rank leaves the others in its collectives until they time
        # out, and the spawn reports that timeout: name the case errors the ranks saved.
        raise RuntimeError(f"the {world}-rank world failed; case errors the ranks saved:\n"
                           + _saved_errors(world, out)) from exc
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _saved_errors(world: int, out: str) -> str:
    lines = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.pt")
        if not os.path.exists(path):
            lines.append(f"rank {r}: saved nothing")
            continue
        for case, (status, *rest) in torch.load(path, weights_only=False).items():
            if status != "ok":
                lines.append(f"rank {r}, case {case}: {rest[0]}\n{rest[1]}")
    return "\n".join(lines) or "none"


def results(ranks: list[dict], case: str) -> list:
    """Per rank, what ``case`` returned (failing with the rank's traceback if it raised)."""
    out = []
    for r, res in enumerate(ranks):
        status, *rest = res[case]
        assert status == "ok", f"rank {r}, case {case}: {rest[0]}\n{rest[1]}"
        out.append(rest[0])
    return out


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative error ‖a[k] − b[k]‖ / ‖b[k]‖ over the tensors of two dicts with the
    same keys (``b`` the reference); :func:`optim_helpers.rel_err` is the one-tensor form."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in a)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def is_close_rel(x: float) -> bool:
    return math.isfinite(x) and x <= 1e-5


# --- training loops ---------------------------------------------------------------------------

LR, ADAMW_LR = 0.02, 3e-3
#: Shampoo's ε regularises the inverse 4th roots of rank-deficient statistics (16 tokens per
#: rank); at the kernel default 1e-12 round-off in the null space is amplified ~(λ/ε)^¼ and the
#: last-bit differences of a distributed gradient sum change results at the 10% level.
SHAMPOO_OPTIONS = {"eps": 1e-4}
MATRIX_LR = {"muon": 0.02, "normuon": 0.02, "shampoo": 0.01, "soap": 3e-3}


def matrix_kernel(optimizer: str, lr: float):
    """The matrix kernel the references step (the test settings of each optimizer)."""
    from canzona.runtime.optim import (SOAP, Muon, MuonConfig, NorMuon, NorMuonConfig, Shampoo,
                                       ShampooConfig, SOAPConfig)

    if optimizer == "muon":
        return Muon(MuonConfig(lr=lr, ns_dtype=torch.float32))
    if optimizer == "normuon":
        return NorMuon(NorMuonConfig(lr=lr, ns_dtype=torch.float32))
    if optimizer == "shampoo":
        return Shampoo(ShampooConfig(lr=lr, precondition_frequency=3, **SHAMPOO_OPTIONS))
    return SOAP(SOAPConfig(lr=lr, precondition_frequency=3))


def plan_settings(optimizer: str) -> dict:
    """Plan-recorded settings used by both sides."""
    if optimizer == "shampoo":
        return {"shampoo_precondition_frequency": 3}
    if optimizer == "soap":
        return {"soap_precondition_frequency": 3}
    return {}


def train_dp(rank: int, world: int, *, optimizer: str = "muon", accum: int = 1,
             clip: float | None = None, grad_sync: str = "reduce_scatter",
             bucket_size: int = 3000, steps: int = STEPS, plan=None,
             overlap_param_gather: bool = False, spare: bool = True,
             collective: str | None = None):
    """Train TinyGPT with CanzonaOptimizer over DP on this rank's share of each batch (the
    counterpart of :func:`train_reference`)."""
    import canzona

    model = TinyGPT(spare=spare)
    if plan is None:
        plan = canzona.plan_model(model, dp=world, optimizer=optimizer, bucket_size=bucket_size,
                                  **plan_settings(optimizer))
    opt = canzona.CanzonaOptimizer(model, plan, lr=MATRIX_LR[optimizer],
                                   ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                                   adamw_weight_decay=0.01, grad_sync=grad_sync,
                                   overlap_param_gather=overlap_param_gather,
                                   collective=collective,
                                   matrix_options=(SHAMPOO_OPTIONS if optimizer == "shampoo"
                                                   else None))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    mine = rows(rank, world)
    norms = []
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(step, micro, world)
            last = micro == accum - 1
            sync = last or grad_sync == "external"
            with contextlib.nullcontext() if sync else opt.no_sync():
                (loss_fn(model, x[mine], y[mine]) / accum).backward()
        if grad_sync == "external":
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.wait_params()
    return {"params": params_of(model), "norms": norms, "state_bytes": opt.state_bytes(),
            "plan": plan, "opt_state_numel": _state_layout(opt),
            "methods": opt.collective_methods}


def _state_layout(opt) -> dict:
    out = {}
    for p, st in opt.state.items():
        out[tuple(p.shape)] = out.get(tuple(p.shape), 0) + 1
    return out


def train_reference(world: int, *, optimizer: str = "muon", accum: int = 1,
                    clip: float | None = None, steps: int = STEPS, sharded: bool = False,
                    spare: bool = True) -> dict:
    """One process, the concatenated batch: the matrix kernel per matrix, torch.optim.AdamW on the
    rest (routing from the same introspection).

    ``sharded``: take the batch's gradient as the sum of the per-rank halves' gradients, each
    scaled by 1/world (exact at world 2: a sum of two terms has one order). SOAP needs it: with
    one gradient its statistic L = G·Gᵀ of a non-square G is rank deficient, the eigenbasis of the
    null space is arbitrary, and last-bit differences pick another one (a few % after 2 steps).
    """
    from canzona.runtime.introspect import inventory

    model = TinyGPT(spare=spare)
    route = {p.name: p.optimizer for p in inventory(model).params}
    named = list(model.named_parameters())
    mats = [p for n, p in named if route[n] == "matrix"]
    others = [p for n, p in named if route[n] != "matrix"]
    kernel = matrix_kernel(optimizer, MATRIX_LR[optimizer])
    states = [kernel.init_state(p.shape) for p in mats]
    adamw = torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lr_factor)
    norms = []
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(step, micro, world)
            if sharded:
                for r in range(world):
                    (loss_fn(model, x[rows(r, world)], y[rows(r, world)])
                     / (accum * world)).backward()
            else:
                (loss_fn(model, x, y) / accum).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        lr = MATRIX_LR[optimizer] * lr_factor(step)
        with torch.no_grad():
            for p, s in zip(mats, states):
                if p.grad is not None:
                    kernel.step([p], [p.grad], [s], lr=lr)
        adamw.step()
        sched.step()
        model.zero_grad()
    return {"params": params_of(model), "norms": norms}
