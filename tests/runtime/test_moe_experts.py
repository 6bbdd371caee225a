"""MoE experts stored as one 3-D tensor ([E, m, n], as ``transformers`` keeps a layer's experts)
are E matrices for the matrix optimizer — each its own task, never an AdamW tensor — and a dp = 2
run equals the single-process run that applies Muon to every expert matrix (float32
Newton–Schulz), within 1e-5. The router stays on AdamW."""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dp_helpers import (ADAMW_LR, LR, SEQ, VOCAB, batch, is_close_rel, lr_factor, params_of,
                        max_rel_err, results, rows, run_world)

E, DIM, FF, STEPS = 4, 32, 16, 6
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * FF, DIM) * DIM ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, DIM, FF) * FF ** -0.5)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, E, bias=False)  # the router: AdamW
        self.experts = Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.gate(h), dim=-1)  # dense mixture: every expert gets a gradient
        g, u = torch.einsum("btd,efd->btef", h, self.experts.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("btef,edf->bted", F.silu(g) * u, self.experts.down_proj)
        return (w.unsqueeze(-1) * out).sum(-2)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ToyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def hf_qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64,
                         moe_intermediate_size=FF, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=2,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                         max_position_embeddings=SEQ, attn_implementation="eager")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).float()


MODELS = {"toy": ToyMoE, "qwen3-moe": hf_qwen3_moe}


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if isinstance(model, ToyMoE) else model(input_ids=x).logits
    return out.reshape(-1, VOCAB)


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits(model, x), y.reshape(-1))


def offline_plan(rank: int, world: int, folder: str):
    """The plan ``canzona plan --config config.json --names hf`` makes for the tiny Qwen3-MoE.
    Every rank writes the file whole and in one step (a rename): one rank rewriting the file
    another was reading made that rank's plan fail on a half-written JSON (and the world time
    out in the next collective)."""
    import json
    import os
    from pathlib import Path

    from canzona.planner import ParallelSizes
    from canzona.planner.options import DPOptions
    from canzona.planner.pipeline import plan

    d = hf_qwen3_moe().config.to_dict()
    d["dtype"] = "float32"
    path = Path(folder) / "config.json"  # the plan names it: one path on every rank
    mine = path.with_name(f"config.rank{rank}.json")
    mine.write_text(json.dumps(d))
    os.replace(mine, path)
    return plan(path, ParallelSizes(dp=world, tp=1), "muon",
                dp_options=DPOptions(bucket_size=2000), names="hf")


def train_experts(rank: int, world: int, *, which: str, folder: str = "") -> dict:
    """Train the MoE model ``which`` (``-offline``: with the plan made offline from its files)
    with CanzonaOptimizer over DP."""
    import canzona

    offline = which.endswith("-offline")
    which = which.removesuffix("-offline")
    model = MODELS[which]()
    plan = (offline_plan(rank, world, folder) if offline
            else canzona.plan_model(model, dp=world, bucket_size=2000))
    opt = canzona.CanzonaOptimizer(model, plan, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                                   adamw_weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    mine = rows(rank, world)
    for step in range(STEPS):
        x, y = batch(step, 0, world)
        loss(model, x[mine], y[mine]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.wait_params()
    tasks = [(t.param, t.part, tuple(t.shape), t.optimizer, t.owner) for t in plan.tasks]
    opt.close()
    return {"params": params_of(model), "tasks": tasks}


def train_reference(world: int, *, which: str) -> dict:
    """One process; the batch's gradient as the sum of the ranks' halves (their order); Muon on
    every expert matrix p[e] (its own state), on every 2-D matrix, AdamW on the rest (the router,
    embeddings, output layer, norms) — the routing written out here, not canzona's."""
    from canzona.runtime.optim import Muon, MuonConfig

    model = MODELS[which]()
    named = list(model.named_parameters())

    def is_matrix(n: str, p: torch.Tensor) -> bool:
        if any(k in n for k in ("embed_tokens", "lm_head", "mlp.gate.")):
            return False
        return p.dim() == 2 or (p.dim() == 3 and "experts" in n)

    kernel = Muon(MuonConfig(lr=LR, ns_dtype=torch.float32))
    mats = [(n, p) for n, p in named if is_matrix(n, p)]
    others = [p for n, p in named if not is_matrix(n, p)]
    views = [(p, e) for _, p in mats for e in (range(p.shape[0]) if p.dim() == 3 else [None])]
    states = [kernel.init_state(p.shape[1:] if e is not None else p.shape) for p, e in views]
    adamw = torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lr_factor)
    for step in range(STEPS):
        x, y = batch(step, 0, world)
        for r in range(world):
            (loss(model, x[rows(r, world)], y[rows(r, world)]) / world).backward()
        with torch.no_grad():
            for (p, e), s in zip(views, states):
                if p.grad is None:
                    continue
                w, g = (p, p.grad) if e is None else (p[e], p.grad[e])
                kernel.step([w], [g], [s], lr=LR * lr_factor(step))
        adamw.step()
        sched.step()
        model.zero_grad()
    return {"params": params_of(model)}


CASES = ["toy"] + (["qwen3-moe", "qwen3-moe-offline"] if HAS_TRANSFORMERS else [])
NEEDS_HF = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip "
                                                           "install 'canzona[dev]' pins it)")


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("moe"))
    cases = []
    for w in CASES:
        sub = tmp_path_factory.mktemp(w)
        cases.append((w, partial(train_experts, which=w, folder=str(sub))))
    return run_world(2, cases, folder)


@pytest.mark.parametrize("which", [
    "toy", pytest.param("qwen3-moe", marks=NEEDS_HF),
    # a plan made offline from the config.json (names="hf") runs the live model the same
    pytest.param("qwen3-moe-offline", marks=NEEDS_HF)])
def test_stacked_experts_are_matrices_and_dp2_equals_one_process(world2, which):
    got = results(world2, which)
    tasks = got[0]["tasks"]
    experts = [t for t in tasks if "experts" in t[0]]
    # every expert matrix its own matrix-optimizer task, [m, n] each; none on AdamW
    assert experts and all(t[3] == "matrix" for t in experts)
    for name in {t[0] for t in experts}:
        parts = [t for t in experts if t[0] == name]
        assert [t[1] for t in parts] == [f"expert{e}" for e in range(E)]
        assert len({t[2] for t in parts}) == 1 and len(parts[0][2]) == 2
    assert all(t[3] == "adamw" for t in tasks if "mlp.gate." in t[0])  # the router
    ref = train_reference(2, which=which.removesuffix("-offline"))
    for r in range(2):
        err = max_rel_err(got[r]["params"], ref["params"])
        assert is_close_rel(err), (which, r, err)


def test_a_stacked_expert_tensor_split_by_tp_is_refused():
    from canzona.planner import ParallelSizes, SizeError
    from canzona.planner.cost import build_tasks
    from canzona.planner.inventory import ModelSpec, ParamSpec, route
    from canzona.planner.settings import OptimizerSettings

    p = ParamSpec(name="layers.0.mlp.experts.down_proj", shape=(4, 32, 16), dtype="fp32",
                  kind="expert", layer=0, expert=None, tp_layout="row")
    spec = ModelSpec(config=None, params=tuple(route([p])))
    assert spec.params[0].optimizer == "matrix" and spec.params[0].stacked_experts == 4
    assert len(build_tasks(spec, OptimizerSettings(), ParallelSizes(dp=2, tp=1))) == 4
    with pytest.raises(SizeError, match="tp = 1 only"):
        build_tasks(spec, OptimizerSettings(), ParallelSizes(dp=2, tp=2))
