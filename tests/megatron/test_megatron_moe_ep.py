"""Megatron-core MoE under expert parallelism, trained by canzona on 4 gloo ranks, equals the
one-process run with every expert on one rank (Muon with float32 Newton–Schulz, and Shampoo;
clipping active) at dp 4 × ep 2 and at dp 2 × tp 2 × ep 2 (expert TP 2, and expert TP 1), and
the expert gradients are reduced over the expert-DP group: the same run with the EP group in
its place (the right size, other experts) does not match."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from megatron_moe import STEPS, reference, train_ep
from megatron_train import run_phases

TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe-ep"))

    def init(name: str) -> str:
        return f"file://{os.path.join(out, name)}"

    phases = [
        ("dp4-ep2", {r: partial(train_ep, r, dp=4, tp=1, ep=2, init=init("a"))
                     for r in range(4)}),
        ("wrong", {r: partial(train_ep, r, dp=4, tp=1, ep=2, init=init("b"), wrong_group=True,
                              steps=2) for r in range(4)}),
        ("dp2-tp2-ep2", {r: partial(train_ep, r, dp=2, tp=2, ep=2, init=init("t"))
                         for r in range(4)}),
        ("dp2-tp2-ep2-etp1", {r: partial(train_ep, r, dp=2, tp=2, ep=2, etp=1,
                                         init=init("e")) for r in range(4)}),
        # a checkpoint saved at expert TP 1 resumes at expert TP 2 (half the steps each)
        ("etp1-save", {r: partial(train_ep, r, dp=2, tp=2, ep=2, etp=1, init=init("s"),
                                  steps=STEPS // 2, save=os.path.join(out, "ck-etp1"))
                       for r in range(4)}),
        ("etp2-resume", {r: partial(train_ep, r, dp=2, tp=2, ep=2, init=init("u"),
                                    steps=STEPS - STEPS // 2, resume=os.path.join(out, "ck-etp1"))
                         for r in range(4)}),
        ("reference-dp2", {0: partial(reference, 0, dp=2, init=init("t-r"))}),
        ("reference", {0: partial(reference, 0, dp=4, init=init("c"))}),
        *((f"dp4-ep2-{o}", {r: partial(train_ep, r, dp=4, tp=1, ep=2, init=init(f"{o}-a"),
                                       optimizer=o) for r in range(4)}) for o in ("shampoo",)),
        *((f"reference-{o}", {0: partial(reference, 0, dp=4, init=init(f"{o}-r"), optimizer=o)})
          for o in ("shampoo",)),
        ("reference-2", {0: partial(reference, 0, dp=4, init=init("d"), steps=2)}),
    ]
    return run_phases(4, phases, out)


def _check(runs, name: str, ref: str) -> float:
    want = runs[0][ref]
    worst = 0.0
    for r, res in enumerate(runs):
        got = res[name]
        assert got["ep"] == 2 and got["expert_buffers"] == 2
        for n, w in got["weights"].items():
            worst = max(worst, _rel(w, want["weights"][n]))
    return worst


def test_dp4_ep2_equals_one_process(runs):
    got, want = runs[0]["dp4-ep2"], runs[0]["reference"]
    assert len(got["losses"]) == STEPS
    assert got["losses"][-1] < got["losses"][0]
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= TOL * abs(b)
    assert _check(runs, "dp4-ep2", "reference") <= TOL


def test_reducing_experts_over_the_ep_group_does_not_match(runs):
    assert all("hold different weights" in r["wrong"]["refused"] for r in runs)
    assert _check(runs, "wrong", "reference-2") > 1e-3



def test_shampoo_at_dp4_ep2_equals_one_process(runs):
    assert _check(runs, "dp4-ep2-shampoo", "reference-shampoo") <= TOL



def test_dp2_tp2_ep2_equals_one_process(runs):
    """Expert TP = TP = 2 (expert-DP 1), sequence parallel as Megatron requires for MoE under
    TP (``megatron_stubs.torch_norms_under_sequence_parallelism``), the plan's defaults
    (matrices shared by their TP group)."""
    got, want = runs[0]["dp2-tp2-ep2"], runs[0]["reference-dp2"]
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= TOL * abs(b)
    assert _check(runs, "dp2-tp2-ep2", "reference-dp2") <= TOL


def test_a_checkpoint_at_expert_tp_1_resumes_at_expert_tp_2(runs):
    """Each TP rank writes its own whole experts (no TP rank shares them), by global index; the
    run resumed under expert TP 2 (each expert split over the TP group) ends as the
    uninterrupted one."""
    got, want = runs[0]["etp2-resume"], runs[0]["reference-dp2"]
    for a, b in zip(got["losses"], want["losses"][STEPS // 2:]):
        assert abs(a - b) <= TOL * abs(b)
    assert _check(runs, "etp2-resume", "reference-dp2") <= TOL


def test_dp2_tp2_ep2_with_expert_tp_1_equals_one_process(runs):
    """Expert TP 1 under TP 2 (expert-DP 2): the two TP ranks of a DP index hold different
    experts, each whole, and their expert buckets are reduced over the global ranks of their EP
    rank; clipping counts every expert once."""
    got, want = runs[0]["dp2-tp2-ep2-etp1"], runs[0]["reference-dp2"]
    assert got["etp"] == 1
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= TOL * abs(b)
    assert _check(runs, "dp2-tp2-ep2-etp1", "reference-dp2") <= TOL
