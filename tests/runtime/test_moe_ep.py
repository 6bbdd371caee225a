"""A plain PyTorch MoE under expert parallelism: 4 gloo ranks, ep 2 (expert-DP 2), each rank
holding its EP rank's experts as per-expert 2-D weights numbered from 0, tokens sent to the
experts' ranks with ``all_to_all_single``. Planned with ``plan_model(model, dp=4, ep=2)`` and
run with a 2-D ``("edp", "ep")`` DeviceMesh, 10 steps with clipping equal the one-process run
with every expert on one rank (float32 Newton–Schulz) within 1e-5, for Muon and Shampoo;
the expert gradients are reduced over the expert-DP group: reduced over the EP group (the
right size, other experts) the run does not match. A checkpoint saved at ep 2 resumes at ep 1
and at ep 4 (one expert per rank) within 1e-5 of the uninterrupted run."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dp_helpers import (ADAMW_LR, MATRIX_LR, SHAMPOO_OPTIONS, VOCAB, batch, matrix_kernel,
                        max_rel_err, plan_settings, results, rows, run_world)

E, DIM, FF, EP, WORLD, STEPS = 4, 32, 32, 2, 4, 10
CLIP = 0.5
SAVE_AT, RESUMED = 3, 6
#: SOAP is left out: on this toy its first eigenbases already turn the last-bit differences of
#: a distributed gradient sum into 1e-5-level differences, dense matrices too (it is exact in
#: the DP tests' model, ``test_dp_runtime``).
OPTIMIZERS = ("muon", "shampoo")


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FF, bias=False)
        self.w2 = nn.Linear(FF, DIM, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)))


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """[ep, n, d] → [ep, n, d]: block i goes to EP peer i (autograd through the all-to-all)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = torch.empty_like(x)
    return all_to_all_single(out, x.contiguous(), group=group)


class MoE(nn.Module):
    """A dense mixture (every expert weighs every token, so every expert gets a gradient) of the
    experts ``first … first + len(experts)``; with an EP group each rank computes its experts
    for every token of its EP peers and the partial outputs are summed back."""

    def __init__(self, first: int, count: int, group=None) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, E, bias=False)  # the router: AdamW
        self.experts = nn.ModuleList(Expert() for _ in range(count))
        self.first, self.group = first, group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.gate(h), dim=-1)
        if self.group is None:
            return sum(w[..., self.first + j, None] * ex(h) for j, ex in enumerate(self.experts))
        ep = dist.get_world_size(self.group)
        hs = _exchange(h.unsqueeze(0).expand(ep, *h.shape), self.group)  # every peer's tokens
        ws = _exchange(w.unsqueeze(0).expand(ep, *w.shape), self.group)
        part = sum(ws[..., self.first + j, None] * ex(hs) for j, ex in enumerate(self.experts))
        return _exchange(part, self.group).sum(0)  # each peer's partial output for my tokens


class Layer(nn.Module):
    def __init__(self, first: int, count: int, group=None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp = MoE(first, count, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.norm(x))
        return x + self.mlp(self.norm(x))


class ToyEP(nn.Module):
    """Every weight from one seed (the experts by global index); a rank keeps its EP rank's
    experts."""

    def __init__(self, ep_rank: int = 0, ep: int = 1, group=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        per = E // ep
        self.layers = nn.ModuleList(Layer(ep_rank * per, per, group) for _ in range(2))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in self.named_parameters():  # the same on every rank, whatever it holds
                if ".experts." not in n:
                    t = torch.randn(p.shape, generator=g)
                    p.copy_(1.0 + 0.1 * t if p.dim() == 1 else t * p.shape[-1] ** -0.5)
            for layer in self.layers:
                full = [(torch.randn(FF, DIM, generator=g) * DIM ** -0.5,
                         torch.randn(DIM, FF, generator=g) * FF ** -0.5) for _ in range(E)]
                for j, ex in enumerate(layer.mlp.experts):
                    ex.w1.weight.copy_(full[ep_rank * per + j][0])
                    ex.w2.weight.copy_(full[ep_rank * per + j][1])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def global_params(model: ToyEP, ep_rank: int, ep: int) -> dict[str, torch.Tensor]:
    per = E // ep
    out = {}
    for n, p in model.named_parameters():
        if ".experts." in n:
            head, j, tail = n.split(".experts.")[0], *n.split(".experts.")[1].split(".", 1)
            n = f"{head}.experts.{ep_rank * per + int(j)}.{tail}"
        out[n] = p.detach().clone()
    return out


def train_ep(rank: int, world: int, *, optimizer: str, wrong_group: bool = False,
             steps: int = STEPS) -> dict:
    import canzona
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("edp", "ep"))
    ep_rank = mesh.get_local_rank("ep")
    model = ToyEP(ep_rank, EP, mesh.get_group("ep"))
    plan = canzona.plan_model(model, dp=world, ep=EP, optimizer=optimizer, bucket_size=3000,
                              **plan_settings(optimizer))
    kwargs = dict(lr=MATRIX_LR[optimizer], ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                  adamw_weight_decay=0.01, collective_timeout=30,
                  matrix_options=SHAMPOO_OPTIONS if optimizer == "shampoo" else None)
    if wrong_group:  # the EP group in the expert-DP group's place, weights forced alike
        opt = canzona.CanzonaOptimizer(model, plan, expert_dp_group=mesh.get_group("ep"),
                                       sync_init=True, **kwargs)
    else:
        opt = canzona.CanzonaOptimizer(model, plan, device_mesh=mesh, **kwargs)
    mine = rows(rank, world)
    for step in range(steps):
        x, y = batch(step, 0, world)
        loss(model, x[mine], y[mine]).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
    opt.close()
    return {"params": global_params(model, ep_rank, EP),
            "expert_buffers": sum(b.expert for b in plan.buffers), "ep": plan.inputs.ep}


def _ep_model_and_optimizer(world: int, ep: int):
    import canzona
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    ep_rank = mesh.get_local_rank("ep")
    model = ToyEP(ep_rank, ep, mesh.get_group("ep"))
    plan = canzona.plan_model(model, dp=world, ep=ep, bucket_size=3000)
    opt = canzona.CanzonaOptimizer(model, plan, device_mesh=mesh, lr=MATRIX_LR["muon"],
                                   ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                                   adamw_weight_decay=0.01, collective_timeout=30)
    return model, opt, ep_rank


def _steps(model, opt, rank: int, world: int, steps) -> None:
    for step in steps:
        x, y = batch(step, 0, world)
        loss(model, x[rows(rank, world)], y[rows(rank, world)]).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()


def resume(rank: int, world: int, *, ep: int, folder: str) -> dict:
    """SAVE_AT steps at ep 2 and a checkpoint; then a model and optimizer at ``ep`` (4: one
    expert per rank, expert-DP 1; 1: every expert everywhere) load it and train to RESUMED."""
    import canzona

    model, opt, _ = _ep_model_and_optimizer(world, EP)
    _steps(model, opt, rank, world, range(SAVE_AT))
    bytes_ok = opt.state_bytes() == opt.predicted_state_bytes()
    canzona.save_checkpoint(folder, model, opt)
    opt.close()
    model, opt, ep_rank = _ep_model_and_optimizer(world, ep)
    canzona.load_checkpoint(folder, model, opt)
    _steps(model, opt, rank, world, range(SAVE_AT, RESUMED))
    opt.close()
    return {"params": global_params(model, ep_rank, ep), "bytes_ok": bytes_ok}


def train_reference(*, optimizer: str, steps: int = STEPS) -> dict:
    """One process, every expert: the ranks' rows as one batch; the matrix kernel on every 2-D
    matrix (each expert's too) but the embedding, output layer and router; AdamW on the rest."""
    model = ToyEP()
    named = list(model.named_parameters())
    is_matrix = [p.dim() == 2 and not any(k in n for k in ("embed", "lm_head", "mlp.gate"))
                 for n, p in named]
    kernel = matrix_kernel(optimizer, MATRIX_LR[optimizer])
    mats = [p for (_, p), m in zip(named, is_matrix) if m]
    states = [kernel.init_state(tuple(p.shape)) for p in mats]
    adamw = torch.optim.AdamW([p for (_, p), m in zip(named, is_matrix) if not m], lr=ADAMW_LR,
                              weight_decay=0.01)
    for step in range(steps):
        x, y = batch(step, 0, WORLD)
        for r in range(WORLD):  # the ranks' means, averaged: the global batch's mean
            (loss(model, x[rows(r, WORLD)], y[rows(r, WORLD)]) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with torch.no_grad():
            for p, s in zip(mats, states):
                kernel.step([p], [p.grad], [s], lr=MATRIX_LR[optimizer])
        adamw.step()
        model.zero_grad()
    return {"params": global_params(model, 0, 1)}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    cases = [(o, partial(train_ep, optimizer=o)) for o in OPTIMIZERS]
    cases.append(("wrong", partial(train_ep, optimizer="muon", wrong_group=True, steps=2)))
    for ep in (1, 4):
        folder = str(tmp_path_factory.mktemp(f"ckpt-ep{ep}"))
        cases.append((f"resume-ep{ep}", partial(resume, ep=ep, folder=folder)))
    return run_world(WORLD, cases, str(tmp_path_factory.mktemp("moe-ep")))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_ep2_equals_one_process(world4, optimizer):
    got = results(world4, optimizer)
    want = train_reference(optimizer=optimizer)
    for res in got:
        assert res["ep"] == EP and res["expert_buffers"] == EP
        mine = res["params"]
        assert max_rel_err(mine, {k: want["params"][k] for k in mine}) <= 1e-5
    moved = max_rel_err(want["params"], train_reference(optimizer=optimizer, steps=0)["params"])
    assert moved > 1e-2


def test_experts_reduced_over_the_ep_group_do_not_match(world4):
    want = train_reference(optimizer="muon", steps=2)
    errs = [max_rel_err(r["params"], {k: want["params"][k] for k in r["params"]})
            for r in results(world4, "wrong")]
    assert max(errs) > 1e-3


@pytest.mark.parametrize("ep", [1, 4])
def test_a_checkpoint_at_ep2_resumes_at_another_ep(world4, ep):
    want = train_reference(optimizer="muon", steps=RESUMED)["params"]
    for res in results(world4, f"resume-ep{ep}"):
        assert res["bytes_ok"]
        assert max_rel_err(res["params"], {k: want[k] for k in res["params"]}) <= 1e-5


def test_wrong_expert_layouts_fail_before_any_collective():
    """One process, no process group: each refusal comes from the checks before the first
    collective, in one line."""
    import canzona
    from canzona.planner.errors import ModelError, SizeError
    from canzona.runtime.errors import PlanMismatchError

    torch.set_num_threads(1)
    at_ep2 = canzona.plan_model(ToyEP(0, 2), dp=4, ep=2, bucket_size=3000)
    with pytest.raises(PlanMismatchError, match=r"holds 4 experts on this rank but the plan, "
                                                r"for 4 experts at ep=2, gives each rank 2; "
                                                r".*\(ep=1\)"):
        canzona.CanzonaOptimizer(ToyEP(), at_ep2)  # every expert: a model built at ep 1
    with pytest.raises(PlanMismatchError, match=r"holds 2 experts .* at ep=4, gives each rank 1"):
        canzona.CanzonaOptimizer(ToyEP(0, 2), canzona.plan_model(ToyEP(0, 4), dp=4, ep=4))
    from dp_helpers import TinyGPT

    dense = canzona.plan_model(TinyGPT(), dp=4)
    with pytest.raises(PlanMismatchError, match=r"the plan has no experts \(a dense model's\)"):
        canzona.CanzonaOptimizer(ToyEP(0, 2), dense)
    with pytest.raises(SizeError, match=r"ep=3 must divide .* the world size dp·tp=4; nearest "
                                        r"valid ep: 2"):
        canzona.plan_model(ToyEP(0, 2), dp=4, ep=3)
    with pytest.raises(ModelError, match=r"ep=2 needs per-expert 2-D weights"):
        canzona.plan_model(TinyGPT(), dp=4, ep=2)
