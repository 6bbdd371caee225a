"""``state_bytes()`` (measured tensors) equals ``predicted_state_bytes()`` exactly.

The plan's ``dp_state_bytes`` shares the one-element step counter of an AdamW tensor among the
pieces ZeRO-1 cuts it into, by element count, while each rank holding a piece keeps a whole fp32
counter: the prediction (method and function) counts ``4·(2k + 1)`` bytes per AdamW fragment of
k elements. ``OddNet`` has odd sizes and an embedding large enough that the plans cut it across
the DP ranks for every optimizer (checked below, so the tests keep covering that case).

dp = 1 runs here; dp = 2 inside ONE gloo spawn (module fixture ``world2``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import canzona
import dp_helpers as H
from canzona.runtime.accounting import predicted_state_bytes
from canzona.runtime.optimizer import CanzonaOptimizer

pytestmark = pytest.mark.slow

VOCAB, DIM, HIDDEN, SEQ = 1013, 11, 19, 6


class OddNet(nn.Module):
    """Odd shapes: a 1013 × 11 embedding (tied output), 19 × 11 and 11 × 19 matrices, a bias, a
    LayerNorm and a 3-D parameter (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.cube = nn.Parameter(torch.randn(3, 5, 7) * 0.1)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.fc1(x))) + self.cube.mean()
        return self.norm(x) @ self.emb.weight.T


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    data = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _cut_adamw(plan) -> list[str]:
    """AdamW tensors whose elements lie on more than one DP rank."""
    matrix = {t.param for t in plan.tasks if t.optimizer == "matrix"}
    out = []
    for buf in plan.buffers:
        for b in buf.buckets:
            for s in b.slots:
                holders = [r for r in range(len(b.cuts) - 1)
                           if max(s.start, b.cuts[r]) < min(s.end, b.cuts[r + 1])]
                if s.name not in matrix and len(holders) > 1:
                    out.append(s.name)
    return out


#: (optimizer, model dtype, main_params, matrix_options)
CONFIGS = [
    ("muon", torch.float32, None, None),
    ("muon", torch.bfloat16, "fp32", None),
    ("muon", torch.bfloat16, None, None),
    ("shampoo", torch.float32, None, None),
    ("shampoo", torch.bfloat16, "fp32", None),
    ("shampoo", torch.float32, None, {"momentum": 0.5}),  # adds an m×n buffer per matrix
    ("shampoo", torch.float32, None, {"betas": (0.0, 1.0)}),  # drops exp_avg
    ("soap", torch.float32, None, None),
    ("soap", torch.float32, "fp32", None),  # fp32 model: no main copies
    ("soap", torch.bfloat16, "fp32", None),
]
IDS = [f"{o}-{str(d).split('.')[-1]}-{m}-{'opts' if x else 'plain'}{i}"
       for i, (o, d, m, x) in enumerate(CONFIGS)]


def _measure(rank: int, world: int, optimizer: str, dtype: torch.dtype, main_params: str | None,
             options: dict | None) -> dict:
    model = OddNet().to(dtype)
    plan = canzona.plan_model(model, dp=world, optimizer=optimizer)
    opt = CanzonaOptimizer(model, plan, lr=1e-3, main_params=main_params,
                           matrix_options=options)
    before = opt.state_bytes()
    for step in range(2):  # the state does not grow while training
        x, y = _batch(step, rank)
        F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return {"before": before, "after": opt.state_bytes(), "method": opt.predicted_state_bytes(),
            "function": predicted_state_bytes(plan, rank, main_params=main_params),
            "planned": plan.metrics.dp_state_bytes[rank], "cut": _cut_adamw(plan)}


def _all_configs(rank: int, world: int) -> dict:
    return {i: _measure(rank, world, *cfg) for i, cfg in enumerate(CONFIGS)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    ranks = H.run_world(2, [("configs", _all_configs)], str(tmp_path_factory.mktemp("bytes")))
    out = []
    for r, res in enumerate(ranks):
        status, *rest = res["configs"]
        assert status == "ok", f"rank {r}: {rest[0]}\n{rest[1]}"
        out.append(rest[0])
    return out


def _check(res: dict, options: dict | None) -> None:
    assert res["before"] == res["after"] == res["method"], res
    if options is None:  # the plan records the kernel's default state layout
        assert res["function"] == res["method"], res


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=IDS)
def test_state_bytes_equal_prediction_dp2(world2, index):
    options = CONFIGS[index][3]
    for res in world2:
        _check(res[index], options)
    # the configuration really cuts an AdamW tensor across the two ranks
    assert world2[0][index]["cut"], "the plan cut no AdamW tensor; pick other sizes"


def test_plan_metric_is_short_by_the_cut_step_counters(world2):
    """What the planner's dp_state_bytes misses (see predicted_state_bytes's docstring): up to
    4 bytes per cut AdamW tensor on each rank holding a piece, never more, never less."""
    for r, ranks in enumerate(world2):
        for index, (_, _, main_params, options) in enumerate(CONFIGS):
            res = ranks[index]
            if options is not None or main_params is not None:
                continue
            missing = res["function"] - res["planned"]
            assert 0 <= missing <= 4 * len(res["cut"]), (r, index, res)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=IDS)
def test_state_bytes_equal_prediction_dp1(index):
    torch.set_num_threads(1)
    res = _measure(0, 1, *CONFIGS[index])
    _check(res, CONFIGS[index][3])
    assert not res["cut"]  # one rank: nothing is cut, the plan's metric is exact too
    if CONFIGS[index][3] is None and CONFIGS[index][2] is None:
        assert res["method"] == res["planned"]


def test_predicted_state_bytes_bad_input():
    plan = canzona.plan_model(OddNet(), dp=2)
    for bad in (-1, 2, 1.0, True, "0"):
        with pytest.raises(ValueError, match=r"dp_rank = .* is not allowed; choose 0 … 1"):
            predicted_state_bytes(plan, bad)
    for bad in (-1, 1, 0.0, False):
        with pytest.raises(ValueError, match=r"tp_rank = .* is not allowed; choose 0 … 0"):
            predicted_state_bytes(plan, 0, tp_rank=bad)
