"""Megatron-core GPTModels trained by canzona in place of Megatron's DDP and distributed optimizer:
at dp 2, tp 2 and dp 2 × tp 2 (also with every matrix shared by its TP group, and with the QKV
orthogonalised per head against a single process doing the same), 10 steps of a
Qwen3-style model (QK layernorm,
GQA, fused QKV and gate/up, vocabulary-parallel embedding and output layer) equal the tp = 1
single-process run (Muon kernel with float32 Newton–Schulz, torch AdamW) within 1e-5, losses and
weights. The tp 2 run uses the plan made offline from the config (Megatron names, no renaming);
the others ``canzona.plan_model`` of the live model, which must give the same fingerprint.

One spawn of 4 gloo processes: first a tp 2 world (ranks 0-1) beside a dp 2 world (ranks 2-3),
then one dp 2 × tp 2 world, then the two references (dp 1 and dp 2 batches) side by side.
"""

from __future__ import annotations

import functools

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")]

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import megatron_train as M

    tmp = tmp_path_factory.mktemp("megatron-train")

    def init(name: str) -> str:
        return f"file://{tmp / name}"

    train, ref = M.train_megatron, M.reference
    phases = [
        ("side", {0: functools.partial(train, 0, dp=1, tp=2, init=init("tp2"), plan_from="config"),
                  1: functools.partial(train, 1, dp=1, tp=2, init=init("tp2"), plan_from="config"),
                  2: functools.partial(train, 0, dp=2, tp=1, init=init("dp2")),
                  3: functools.partial(train, 1, dp=2, tp=1, init=init("dp2"))}),
        ("grid", {r: functools.partial(train, r, dp=2, tp=2, init=init("grid")) for r in range(4)}),
        ("shared", {r: functools.partial(train, r, dp=2, tp=2, init=init("shared"),
                                         share="all-split") for r in range(4)}),
        ("heads", {r: functools.partial(train, r, dp=2, tp=2, init=init("heads"),
                                        qkv_split="heads") for r in range(4)}),
        ("ref", {0: functools.partial(ref, 0, dp=1, init=init("ref1")),
                 1: functools.partial(ref, 0, dp=2, init=init("ref2")),
                 2: functools.partial(ref, 0, dp=2, init=init("ref2h"), heads=True)}),
    ]
    ranks = M.run_phases(4, phases, str(tmp))
    return {"tp2": ranks[0]["side"], "tp2-peer": ranks[1]["side"], "dp2": ranks[2]["side"],
            "dp2-peer": ranks[3]["side"], "grid": ranks[0]["grid"],
            "grid-all": [r["grid"] for r in ranks], "shared": ranks[0]["shared"],
            "heads": ranks[0]["heads"], "ref1": ranks[0]["ref"], "ref2": ranks[1]["ref"],
            "ref2-heads": ranks[2]["ref"]}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check(run: dict, ref: dict) -> None:
    import torch

    assert len(run["losses"]) == len(ref["losses"]) == 10
    losses = torch.tensor(run["losses"])
    want = torch.tensor(ref["losses"])
    assert torch.allclose(losses, want, rtol=TOL, atol=0), (losses - want).abs().max()
    assert want[-1] < want[0]  # it trains
    weights, expected = run["weights"], ref["weights"]
    assert set(weights) == set(expected)
    worst = max(((_rel(weights[n], expected[n]), n) for n in expected))
    assert worst[0] < TOL, worst
    # the weights moved: a run that updated nothing would not match after 10 steps
    import megatron_train as M

    start = M.canonical()
    assert all(not torch.equal(expected[n], start[n]) for n in expected)


@pytest.mark.parametrize("case,ref", [("tp2", "ref1"), ("dp2", "ref2"), ("grid", "ref2"),
                                      ("shared", "ref2"), ("heads", "ref2-heads")])
def test_megatron_gpt_equals_single_process(runs, case, ref):
    _check(runs[case], runs[ref])


def test_every_rank_sees_the_same_losses(runs):
    assert runs["tp2"]["losses"] == runs["tp2-peer"]["losses"]
    grid = runs["grid-all"]
    for r in grid:  # the two TP ranks of a DP index see the same loss (same tokens)
        peer = next(x for x in grid if x["dp_rank"] == r["dp_rank"] and x is not r)
        assert r["losses"] == peer["losses"]
    assert {(r["dp_rank"], r["tp_rank"]) for r in grid} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_offline_plan_and_plan_model_agree(runs):
    """plan_model of the live tp 2 model (the dp 2 × tp 2 run) fingerprints as the plan made
    offline from the config at tp 2: the same parameters, layouts and logical vocabulary."""
    assert runs["grid"]["fingerprint"] == runs["tp2"]["fingerprint"]
    assert runs["tp2"]["tp_groups"] == 1 and runs["grid"]["tp_groups"] == 2


def test_shared_run_shared_every_matrix(runs):
    """The dp 2 × tp 2 run with ``share="all-split"``: every Muon matrix (QKV, proj, fc1, fc2 of
    both layers) shared by its TP group, and it still equals the single process (above)."""
    assert runs["shared"]["shared"] == 8 and runs["grid"]["shared"] == 0


def test_the_heads_run_orthogonalised_each_head_where_it_lies(runs):
    """The dp 2 × tp 2 run with ``qkv_split="heads"``: every query, key and value head of both
    layers a task of its own (and it equals the single process per head, above, not the fused
    one)."""
    import megatron_train as M

    cfg = M.CFG
    assert runs["heads"]["heads"] == cfg.layers * (cfg.q_heads + 2 * cfg.kv_heads)
    assert _rel(runs["ref2-heads"]["weights"][QKV], runs["ref2"]["weights"][QKV]) > 1e-3


QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
