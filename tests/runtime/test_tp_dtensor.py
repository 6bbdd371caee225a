"""DTensor TP: a model parallelised by ``parallelize_module`` on a (dp, tp)
DeviceMesh, planned by ``canzona.plan_model(model, dp=, tp=)`` and run by ``CanzonaOptimizer(...,
device_mesh=)``, against one process training the unsharded model (Muon per matrix, AdamW on the
rest). One spawn of 4 gloo ranks: dp 2 × tp 2, then dp 1 × tp 4.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dp_helpers as H

DIM, HEADS, FFN, VOCAB, SEQ, LAYERS = 32, 4, 64, 48, 8, 2
BATCH, STEPS, LR, ADAMW_LR, CLIP = 8, 4, 0.02, 3e-3, 0.5
WORLD = 4
GRIDS = {"dp2xtp2": (2, 2), "dp1xtp4": (1, 4)}
#: q, k and v orthogonalised head by head (``qkv_split="heads"``): 2 heads per TP rank at tp 2,
#: one at tp 4
HEAD_GRIDS = {"dp2xtp2_heads": (2, 2), "dp1xtp4_heads": (1, 4)}
HEAD_GLOBS = ("q_proj", "k_proj", "v_proj")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.ln_2 = nn.LayerNorm(DIM)
        self.gate_proj = nn.Linear(DIM, FFN, bias=False)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln_1(x)
        # local heads under TP: the column-parallel outputs hold this rank's heads
        q, k, v = (m(h).view(b, t, -1, DIM // HEADS).transpose(1, 2)
                   for m in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ln_2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)  # not parallelised: replicated

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _parallel_model(mesh) -> Model:
    """The model with its attention and MLP projections parallelised on the mesh's tp dim."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    model = Model()
    col, row = ColwiseParallel(), RowwiseParallel()
    for blk in model.blocks:
        parallelize_module(blk, mesh["tp"], {"q_proj": col, "k_proj": col, "v_proj": col,
                                             "o_proj": row, "gate_proj": col, "up_proj": col,
                                             "down_proj": row})
    return model


def _train(grid: str, rank: int, world: int) -> dict:
    import canzona
    from canzona.runtime.introspect import inventory
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dp, tp = {**GRIDS, **HEAD_GRIDS}[grid]
    heads = dict(qkv_split="heads", head_dim=DIM // HEADS) if grid in HEAD_GRIDS else {}
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _parallel_model(mesh)
    plan = canzona.plan_model(model, dp=dp, tp=tp, optimizer="muon", comm_dtype="fp32",
                              bucket_size=3000, **heads)
    opt = canzona.CanzonaOptimizer(model, plan, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                                   adamw_weight_decay=0.01, device_mesh=mesh)
    d = mesh.get_local_rank("dp")
    mine = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        loss_fn(model, x[mine], y[mine]).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
    opt.finish()
    full, local = {}, {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            full[n] = p.full_tensor().detach().clone()
        else:
            full[n] = local[n] = p.detach().clone()
    return {"full": full, "replicated": local, "norms": norms, "tp_rank": mesh.get_local_rank("tp"),
            "layouts": {p.name: p.tp_layout for p in inventory(model).params},
            "split": sum(len(g.tasks) for ix in plan.tp.indices for g in ix.groups),
            "heads": sum(t.part is not None and t.part.startswith("h") for t in plan.tasks)}


def _refusals(rank: int, world: int) -> list[str]:
    """What introspection and the constructor refuse, as error messages."""
    import canzona
    from canzona.runtime.introspect import inventory
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = []
    for placements in ((Shard(0), Replicate()), (Replicate(), Shard(1)), (Replicate(), Shard(2))):
        w = torch.zeros(4, 8, 2) if placements[1] == Shard(2) else torch.zeros(4, 8)
        p = nn.Parameter(distribute_tensor(w, mesh, placements))
        try:
            spec = inventory([("w", p)])
            out.append(f"{spec.params[0].tp_layout} {list(spec.params[0].shape)}")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.append(f"{type(exc).__name__}: {exc}")
    try:
        canzona.CanzonaOptimizer(Model(), canzona.plan_model(Model(), dp=4), device_mesh=mesh["tp"])
    except ValueError as exc:
        out.append(str(exc))
    return out


def _reference(dp: int, heads: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: the unsharded model, the gradient as the DP ranks' mean, Muon per matrix
    (``heads``: q, k and v per head, each head's rows a matrix of their own)."""
    from canzona.runtime.introspect import inventory
    from canzona.runtime.optim import Muon, MuonConfig

    torch.set_num_threads(1)
    model = Model()
    route = {p.name: p.optimizer for p in inventory(model).params}
    named = list(model.named_parameters())
    mats = []  # (parameter, its rows the kernel updates as one matrix)
    for n, p in named:
        if route[n] != "matrix":
            continue
        hd = DIM // HEADS if heads and any(x in n for x in HEAD_GLOBS) else p.shape[0]
        mats += [(p, slice(r, r + hd)) for r in range(0, p.shape[0], hd)]
    kernel = Muon(MuonConfig(lr=LR, ns_dtype=torch.float32))
    states = [kernel.init_state(p[rows].shape) for p, rows in mats]
    adamw = torch.optim.AdamW([p for n, p in named if route[n] != "matrix"], lr=ADAMW_LR,
                              weight_decay=0.01)
    n = BATCH // dp
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        for d in range(dp):
            (loss_fn(model, x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]) / dp).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        with torch.no_grad():
            for (p, rows), s in zip(mats, states):
                kernel.step([p[rows]], [p.grad[rows]], [s], lr=LR)
        adamw.step()
        model.zero_grad()
    return H.params_of(model), norms


def _checkpoint(rank: int, world: int) -> float:
    """dp 2 × tp 2 DTensor model saved after 2 steps, loaded into the plain model at dp 4 (tp 1),
    2 more steps: the largest relative difference from the DTensor run's 4 steps."""
    import os

    import canzona
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"canzona-dtensor-ck-{os.getppid()}")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _parallel_model(mesh)
    plan = canzona.plan_model(model, dp=2, tp=2, optimizer="muon", comm_dtype="fp32",
                              bucket_size=3000)
    opt = canzona.CanzonaOptimizer(model, plan, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                                   adamw_weight_decay=0.01, device_mesh=mesh)

    def train(m, o, steps, d, dp):
        mine = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
        for step in steps:
            x, y = batch(step)
            loss_fn(m, x[mine], y[mine]).backward()
            o.step()
            o.zero_grad()
        o.finish()

    d = mesh.get_local_rank("dp")
    train(model, opt, range(2), d, 2)
    canzona.save_checkpoint(path, model, opt)
    train(model, opt, range(2, STEPS), d, 2)
    want = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}
    opt.close()
    plain = Model()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)  # the load must replace every weight
    plain_opt = canzona.CanzonaOptimizer(plain, canzona.plan_model(plain, dp=4, bucket_size=3000),
                                         lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                                         adamw_weight_decay=0.01)
    canzona.load_checkpoint(path, plain, plain_opt)
    train(plain, plain_opt, range(2, STEPS), dist.get_rank(), 4)
    plain_opt.close()
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(path)
    got = H.params_of(plain)
    return max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)


def cases() -> list:
    """This module's 4-rank cases (run with test_tp_runtime's: conftest's ``tp_world4``)."""
    return ([(f"dtensor_{g}", functools.partial(_train, g)) for g in {**GRIDS, **HEAD_GRIDS}]
            + [("dtensor_refusals", _refusals), ("dtensor_checkpoint", _checkpoint)])


@pytest.fixture(scope="module")
def world(tp_world4):
    return tp_world4


@pytest.mark.parametrize("grid", [*GRIDS, *HEAD_GRIDS])
def test_dtensor_tp_matches_unsharded_reference(world, grid):
    dp, tp = {**GRIDS, **HEAD_GRIDS}[grid]
    heads = grid in HEAD_GRIDS
    res = H.results(world, f"dtensor_{grid}")
    layouts = res[0]["layouts"]
    assert layouts["blocks.0.q_proj.weight"] == "column"
    assert layouts["blocks.0.o_proj.weight"] == "row"
    assert layouts["blocks.1.down_proj.weight"] == "row"
    assert layouts["lm_head.weight"] == layouts["norm.weight"] == "replicated"
    # every TP-split matrix runs in a micro-group; per head, q, k and v run where their heads lie
    assert res[0]["split"] == (4 if heads else 7) * LAYERS
    assert res[0]["heads"] == (3 * HEADS * LAYERS if heads else 0)
    ref, norms = _reference(dp, heads)
    for r in range(WORLD):
        full = res[r]["full"]
        errs = {n: ((full[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref}
        bad = {n: e for n, e in errs.items() if not e <= 1e-5}
        assert not bad, f"rank {r}: {bad}"
        # the global gradient norm counts every element once (replicated ones 1/tp per TP rank)
        assert res[r]["norms"] == pytest.approx(norms, rel=1e-5)
        assert min(norms) > CLIP  # clipping acted at every step
        # replicated parameters: identical on every TP rank of the DP index
        first = res[r - r % tp]["replicated"]
        for n, t in res[r]["replicated"].items():
            assert torch.equal(t, first[n]), (r, n)
    moved = {n for n in ref if not torch.equal(ref[n], Model().state_dict()[n])}
    assert moved == set(ref)  # the comparison is not vacuous: every parameter trained


def test_dtensor_placements_read_or_refused(world):
    for got in H.results(world, "dtensor_refusals"):
        shard_dp, row, shard2, mesh = got
        assert shard_dp.startswith("ModelError") and "'w'" in shard_dp and "Replicate" in shard_dp
        assert row == "row [4, 8]"  # the global shape
        assert shard2.startswith("ModelError") and "Shard(dim=2)" in shard2
        assert "2-D DeviceMesh with dims named 'dp' and 'tp'" in mesh


def test_dtensor_checkpoint_resumes_in_a_plain_model_at_dp4(world):
    """A checkpoint of DTensor shards (dp 2 × tp 2) holds the logical tensors: the unsharded
    model at dp 4 continues from it as the DTensor run did, within 1e-5."""
    for err in H.results(world, "dtensor_checkpoint"):
        assert err < 1e-5
