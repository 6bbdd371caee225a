"""Megatron-core GPTModels trained by canzona in spawned gloo worlds, and the one-process reference.

Every model starts from the same canonical (tp = 1) weights: each rank writes its TP shard of them
with the planner's shard maps (QKV grouped per KV group, fc1 as [gate_r; up_r], the vocabulary
rows split). Each DP rank takes its own token batch; the reference takes the DP ranks' batches
concatenated in one tp = 1 model, so its mean loss is the mean of theirs and its gradient their
average. The reference updates the matrices with the Muon kernel (float32 Newton–Schulz), whole
(fused QKV and gate/up as one matrix each, canzona's default rule), and the rest with
``torch.optim.AdamW``.

:func:`run_phases` spawns 4 processes once; each runs its part of every phase (several small
worlds side by side, each with its own rendezvous file) and saves what it returned. A rank that
fails saves its traceback and exits non-zero, which stops the spawn at once.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from canzona.planner.inventory import build_inventory
from canzona.planner.layout import padded_vocab
from canzona.planner.models import ModelConfig
from canzona.planner.shards import concat_shards, shard_map, split_full

#: Qwen3-style: QK layernorm (summed over TP), head_dim 32 ≠ hidden/heads 16, GQA 4:2, untied;
#: float32 throughout (exactness).
CFG = ModelConfig(name="qwen3-megatron-tiny", arch="qwen3", hidden=64, ffn=96, layers=2,
                  q_heads=4, kv_heads=2, head_dim=32, vocab=1000, tied_embeddings=False,
                  qk_norm=True, dtype="fp32")
STEPS = 10
SEQ = 16
BATCH = 2  # sequences per DP rank and step
LR, ADAMW_LR = 0.02, 3e-3
#: the model's vocabulary: Megatron's padding, the same at tp 1 and 2 for 1000 (1024)
PADDED = padded_vocab(CFG.vocab, 2)
assert PADDED == padded_vocab(CFG.vocab, 1)


def canonical(cfg: ModelConfig = CFG) -> dict[str, torch.Tensor]:
    """The model's logical weights (padded vocabulary rows included), from a fixed seed: the
    planner's full views (QKV as [Q; K; V], fc1 as [gate; up], every expert by its global
    index), which the shard maps place in Megatron's layout at any tp (at tp 1 too: Megatron's
    QKV rows are grouped per KV group)."""
    spec = build_inventory(cfg.model_copy(update={"vocab": PADDED}))
    g = torch.Generator().manual_seed(0)
    out = {}
    for p in spec.params:
        t = torch.randn(p.shape, generator=g)
        out[p.name] = 1.0 + 0.1 * t if len(p.shape) == 1 else 0.08 * t
    return out


def _maps(tp: int, cfg: ModelConfig = CFG, etp: int | None = None) -> dict:
    """Every parameter's shard map at ``tp`` (experts at ``etp``, default tp)."""
    spec = build_inventory(cfg.model_copy(update={"vocab": PADDED}))
    return {p.name: shard_map(p, etp if p.is_expert and etp is not None else tp,
                              kv_groups=cfg.kv_heads) for p in spec.params}


def load_canonical(gpt: torch.nn.Module, tp: int, tp_rank: int, cfg: ModelConfig = CFG,
                   rename: Callable[[str], str] = str, etp: int | None = None) -> None:
    """Write this TP rank's shard of :func:`canonical` into the Megatron model (``rename``: a
    live name to the canonical one, e.g. a local expert to its global index; ``etp``: expert TP
    1 keeps every expert whole)."""
    full, maps = canonical(cfg), _maps(tp, cfg, etp)
    with torch.no_grad():
        for live, p in gpt.named_parameters():
            name = rename(live)
            m = maps[name]
            if m.dim is None:
                p.copy_(full[name])
                continue
            for ls, piece in split_full(m, full[name], tp_rank if m.tp > 1 else 0):
                n = piece.shape[m.dim]
                (p[ls:ls + n] if m.dim == 0 else p[:, ls:ls + n]).copy_(piece)


def gather_canonical(gpt: torch.nn.Module, tp: int, group, cfg: ModelConfig = CFG,
                     rename: Callable[[str], str] = str,
                     etp: int | None = None) -> dict[str, torch.Tensor]:
    """The canonical weights from every TP rank's shards (all-gather over the TP group), by
    canonical name (``rename`` and ``etp``, as :func:`load_canonical`)."""
    maps, out = _maps(tp, cfg, etp), {}
    for live, p in gpt.named_parameters():
        name = rename(live)
        m = maps[name]
        if m.dim is None:
            out[name] = p.detach().clone()
            continue
        shards = [p.detach().clone()]
        if m.tp > 1:
            shards = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(shards, p.detach().contiguous(), group=group)
        out[name] = concat_shards(m, shards, lambda xs, d: torch.cat(xs, d))
    return out


def tokens(dp_rank: int, tag: str = "megatron") -> torch.Tensor:
    """DP rank ``dp_rank``'s batch: the same every step, so that 10 steps visibly lower the loss."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{dp_rank}".encode()))
    return torch.randint(0, CFG.vocab, (BATCH, SEQ + 1), generator=g)


def forward_loss(model, ids: torch.Tensor) -> torch.Tensor:
    from megatron_stubs import causal_attention_mask

    x, y = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return model(x, pos, causal_attention_mask(x.shape[1]), labels=y).mean()


def train_megatron(rank: int, *, dp: int, tp: int, init: str, plan_from: str = "model",
                   steps: int = STEPS, share: str = "off", qkv_split: str = "fused") -> dict:
    """Rank ``rank`` of a dp × tp Megatron world: a GPTModel trained by CanzonaOptimizer.

    ``plan_from``: ``model`` (``canzona.plan_model`` of the live model, the tokenizer's
    vocabulary given) or ``config`` (the plan made offline from :data:`CFG`, Megatron names);
    ``share``: ``TPOptions.share`` of ``plan_model``; ``qkv_split``: its QKV split.
    Returns the losses and, on the first rank, the canonical weights after ``steps``.
    """
    import canzona
    from canzona.planner import ParallelSizes, TPOptions
    from canzona.planner.pipeline import plan as make_plan
    from megatron.core import parallel_state as ps
    from megatron_stubs import gpt_model, megatron_world

    with megatron_world(dp, tp, backend="gloo", rank=rank, init_method=init, timeout_s=60):
        _, gpt = gpt_model(CFG, tp)
        tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
        load_canonical(gpt, tp, tp_rank)
        if plan_from == "model":
            plan = canzona.plan_model(gpt, dp=dp, vocab=CFG.vocab, comm_dtype="fp32", share=share,
                                      qkv_split=qkv_split)
        else:
            plan = make_plan(CFG, ParallelSizes(dp=dp, tp=tp),
                             tp_options=TPOptions(comm_dtype="fp32", cmax_mib=0.05))
        losses = []
        with canzona.CanzonaOptimizer(gpt, plan, tp_group=tp_group, dp_group=dp_group,
                                      ns_dtype=torch.float32, lr=LR, adamw_lr=ADAMW_LR,
                                      adamw_weight_decay=0.01, collective_timeout=60) as opt:
            for step in range(steps):
                loss = forward_loss(gpt, tokens(dp_rank))
                loss.backward()
                opt.step()
                opt.zero_grad()
                mean = loss.detach().clone()  # the global batch's mean loss, as the reference's
                dist.all_reduce(mean, group=dp_group)
                losses.append(float(mean) / dp)
            opt.finish()
        weights = gather_canonical(gpt, tp, tp_group)
        out = {"losses": losses, "dp_rank": dp_rank, "tp_rank": tp_rank,
               "fingerprint": plan.fingerprint, "tp_groups": len(plan.tp.indices) if plan.tp else 0,
               "shared": sum(len(ix.shared) for ix in plan.tp.indices) if plan.tp else 0,
               "heads": sum(t.part is not None and t.part[0] in "qkv" and t.part[1:].isdigit()
                            for t in plan.tasks)}
        if rank == 0:
            out["weights"] = weights
        return out


def reference(rank: int, *, dp: int, init: str, steps: int = STEPS, heads: bool = False) -> dict:
    """One process, tp = 1: the DP ranks' batches concatenated; the Muon kernel per matrix
    (float32 Newton–Schulz; ``heads``: the fused QKV per head, each ``head_dim`` rows of it a
    matrix), ``torch.optim.AdamW`` on the rest (Megatron's routing)."""
    from canzona.runtime.optim import Muon, MuonConfig
    from megatron_stubs import gpt_model, megatron_world

    with megatron_world(1, 1, backend="gloo", rank=0, init_method=init, timeout_s=60):
        _, gpt = gpt_model(CFG, 1)
        load_canonical(gpt, 1, 0)
        kernel = Muon(MuonConfig(lr=LR, ns_dtype=torch.float32))
        losses = reference_steps(gpt, kernel, LR, lambda: torch.cat([tokens(d) for d in range(dp)]),
                                 steps, head_rows=CFG.head_dim if heads else 0)
        return {"losses": losses, "weights": gather_canonical(gpt, 1, None)}


def reference_steps(gpt, kernel, lr: float, batch: Callable[[], torch.Tensor], steps: int,
                    clip: float | None = None, head_rows: int = 0) -> list[float]:
    """``steps`` one-process steps of ``gpt`` on ``batch()``: ``kernel`` on every matrix
    (Megatron's routing: ``inventory``; with ``head_rows``, on each head of the fused QKV: its
    rows, grouped per KV group at tp 1, are heads of that many rows), ``torch.optim.AdamW`` on
    the rest, the global norm clipped to ``clip`` first when given. Returns the losses."""
    from canzona.runtime.introspect import inventory

    route = {p.name: p.optimizer for p in inventory(gpt).params}
    named = list(gpt.named_parameters())
    mats = []  # (parameter, the rows the kernel updates as one matrix)
    for n, p in named:
        if route[n] == "matrix":
            hd = head_rows if head_rows and n.endswith("linear_qkv.weight") else p.shape[0]
            mats += [(p, slice(r, r + hd)) for r in range(0, p.shape[0], hd)]
    states = [kernel.init_state(tuple(p[rows].shape)) for p, rows in mats]
    adamw = torch.optim.AdamW([p for n, p in named if route[n] != "matrix"], lr=ADAMW_LR,
                              weight_decay=0.01)
    losses = []
    for _ in range(steps):
        loss = forward_loss(gpt, batch())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
        with torch.no_grad():
            for (p, rows), st in zip(mats, states):
                kernel.step([p[rows]], [p.grad[rows]], [st], lr=lr)
        adamw.step()
        adamw.zero_grad()
        for p, _ in mats:
            p.grad = None
        losses.append(float(loss))
    return losses


Phase = dict[int, Callable[[int], dict]]  # world rank → its job (given its rank in its world)


def _worker(rank: int, phases: list[tuple[str, Phase]], out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="megatron")
    sys.path.insert(0, str(Path(__file__).parent))
    results: dict = {}
    try:
        for name, jobs in phases:
            if rank in jobs:
                results[name] = jobs[rank]()
    except BaseException:  # noqa: BLE001 - saved for the test, then the spawn stops
        results["error"] = traceback.format_exc()
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        sys.stderr.write(results["error"])
        os._exit(1)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may outlive the destroyed groups into interpreter shutdown


def run_phases(world: int, phases: list[tuple[str, Phase]], out: str) -> list[dict]:
    """Run the phases in one spawn of ``world`` processes; per process, ``{phase: result}``.

    Raises:
        AssertionError: a rank failed (its traceback in the message).
    """
    try:
        torch.multiprocessing.start_processes(_worker, args=(phases, out), nprocs=world,
                                              join=True, start_method="forkserver")
    except Exception as exc:  # noqa: BLE001 - report the rank's own traceback
        errors = []
        for r in range(world):
            f = os.path.join(out, f"rank{r}.pt")
            if os.path.exists(f):
                res = torch.load(f, weights_only=False)
                if "error" in res:
                    errors.append(f"rank {r}:\n{res['error']}")
        raise AssertionError("\n".join(errors) or str(exc)) from None
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
            for r in range(world)]
