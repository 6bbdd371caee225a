"""Checkpoints with logical keys (``canzona.save_checkpoint`` / ``load_checkpoint``):
resuming under the same plan continues bit-identically; under another plan (dp 2 → dp 4, reorder
on → off, dp 2 × tp 2 → dp 4 × tp 1 and back) it equals the uninterrupted run within 1e-5
(float32 Newton–Schulz); what a plan cannot take over is refused on every rank before anything
changes. One spawn of 4 gloo ranks runs every case."""

from __future__ import annotations

import functools
import os

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import dp_helpers as H  # noqa: E402
import tp_helpers as T  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 4
STEPS, SAVE_AT = 6, 3


# --- DP: TinyGPT -------------------------------------------------------------------------------


def _dp_opt(model, plan, dp_group, optimizer="muon"):
    import canzona

    return canzona.CanzonaOptimizer(
        model, plan, lr=H.MATRIX_LR[optimizer], ns_dtype=torch.float32, adamw_lr=H.ADAMW_LR,
        adamw_weight_decay=0.01, dp_group=dp_group,
        matrix_options=H.SHAMPOO_OPTIONS if optimizer == "shampoo" else None)


def _dp_plan(dp, optimizer="muon", reorder=True):
    import canzona

    return canzona.plan_model(H.TinyGPT(spare=False), dp=dp, optimizer=optimizer,
                              bucket_size=3000, reorder=reorder, **H.plan_settings(optimizer))


def _dp_steps(model, opt, sched, steps, dp_rank, dp):
    mine = H.rows(dp_rank, dp)
    for step in steps:
        x, y = H.batch(step, 0, dp)
        H.loss_fn(model, x[mine], y[mine]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.wait_params()


def _dp_run(rank, *, first, second, ckpt, optimizer="muon", load=True):
    """Train ``first = (dp, reorder)`` for SAVE_AT steps and save; then a fresh model (another
    seed) and optimizer under ``second`` load it and train to STEPS. Ranks beyond a dp idle."""
    import canzona

    groups = {dp: dist.new_group(list(range(dp))) for dp in (2, 4)}
    dp1, reorder1 = first
    if rank < dp1:
        model = H.TinyGPT(spare=False)
        opt = _dp_opt(model, _dp_plan(dp1, optimizer, reorder1), groups[dp1], optimizer)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
        _dp_steps(model, opt, sched, range(SAVE_AT), rank, dp1)
        canzona.save_checkpoint(ckpt, model, opt, extra={"sched": sched},
                                process_group=groups[dp1])
        opt.close()
    dist.barrier()
    dp2, reorder2 = second
    if rank >= dp2 or not load:
        return None
    model = H.TinyGPT(seed=7, spare=False)
    opt = _dp_opt(model, _dp_plan(dp2, optimizer, reorder2), groups[dp2], optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    canzona.load_checkpoint(ckpt, model, opt, extra={"sched": sched}, process_group=groups[dp2])
    _dp_steps(model, opt, sched, range(SAVE_AT, STEPS), rank, dp2)
    opt.close()
    return H.params_of(model)


def _dp_uninterrupted(rank, *, dp, optimizer="muon", reorder=True):
    group = dist.new_group(list(range(dp)))
    if rank >= dp:
        return None
    model = H.TinyGPT(spare=False)
    opt = _dp_opt(model, _dp_plan(dp, optimizer, reorder), group, optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    _dp_steps(model, opt, sched, range(STEPS), rank, dp)
    opt.close()
    return H.params_of(model)


# --- TP: Megatron-style shards (tp_helpers) ---------------------------------------------------


def _local(p, full, tp, rank):
    """TP rank ``rank``'s shard (Megatron's layout)."""
    return T.local_of(p, full, tp, rank)


def _full(p, local, tp, group):
    return T.full_of(p, local, tp, group)


def _tp_world(dp, tp, optimizer="muon", split=False, seed_shift=0.0):
    """This rank's shards (a fresh start, shifted by ``seed_shift`` so that a load must replace
    them), its optimizer and groups."""
    import canzona

    rank = dist.get_rank()
    dp_group, tp_group = T.groups(dp, tp)
    dp_rank, tp_rank = rank // tp, rank % tp
    ps = T.spec().params
    start = T.initial_full()
    local = [(p.name, T.megatron_param(p, _local(p, start[p.name] + seed_shift, tp, tp_rank),
                                       tp)) for p in ps]
    plan = T.plan_for(dp, tp, optimizer, split=split)
    opt = canzona.CanzonaOptimizer(
        local, plan, lr=T.LR[optimizer], ns_dtype=torch.float32, adamw_lr=T.ADAMW_LR,
        adamw_weight_decay=0.01, dp_group=dp_group if dp > 1 else None, tp_group=tp_group,
        matrix_options=T.SHAMPOO_OPTIONS if optimizer == "shampoo" else None)
    return {"ps": ps, "local": local, "opt": opt, "tp_group": tp_group, "dp": dp, "tp": tp,
            "dp_rank": dp_rank, "tp_rank": tp_rank}


class _Params(torch.nn.Module):
    """The shards as a module (what save_checkpoint/load_checkpoint take as the model)."""

    def __init__(self, local):
        super().__init__()
        self._names = [n for n, _ in local]
        for i, (_, w) in enumerate(local):
            self.register_parameter(f"p{i}", w)

    def named_parameters(self, *args, **kwargs):  # the plan's names
        return iter([(n, getattr(self, f"p{i}")) for i, n in enumerate(self._names)])


def _loss(full, step, dp_rank, dp):
    """This DP rank's share of a global batch that no dp changes: 4 sub-batches, each DP rank
    the mean of its 4/dp of them (tp_helpers' loss takes one sub-batch per DP rank)."""
    share = WORLD // dp
    return sum(T.loss(full, step, j) for j in range(dp_rank * share, (dp_rank + 1) * share)) / share


def _tp_steps(w, steps):
    ps, local, opt, tp, tp_group = w["ps"], w["local"], w["opt"], w["tp"], w["tp_group"]
    for step in steps:
        full = {p.name: _full(p, x, tp, tp_group).float().requires_grad_(True)
                for p, (_, x) in zip(ps, local)}
        grads = torch.autograd.grad(_loss(full, step, w["dp_rank"], w["dp"]),
                                    list(full.values()))
        shards = [_local(p, g, tp, w["tp_rank"]) for p, g in zip(ps, grads)]
        torch.autograd.backward([x for _, x in local], shards)
        opt.step()
        opt.zero_grad()
    opt.wait_params()


def _tp_logical(w):
    return {p.name: _full(p, x, w["tp"], w["tp_group"]).float()
            for p, (_, x) in zip(w["ps"], w["local"])}


def _tp_run(rank, *, first, second, ckpt, optimizer="muon", split=(False, False)):
    import canzona

    a = _tp_world(*first, optimizer=optimizer, split=split[0])
    _tp_steps(a, range(SAVE_AT))
    canzona.save_checkpoint(ckpt, _Params(a["local"]), a["opt"])
    a["opt"].close()
    b = _tp_world(*second, optimizer=optimizer, split=split[1], seed_shift=0.5)
    canzona.load_checkpoint(ckpt, _Params(b["local"]), b["opt"])
    _tp_steps(b, range(SAVE_AT, STEPS))
    out = _tp_logical(b)
    b["opt"].close()
    return out


def _tp_uninterrupted(rank, *, dp, tp, optimizer="muon"):
    w = _tp_world(dp, tp, optimizer=optimizer)
    _tp_steps(w, range(STEPS))
    out = _tp_logical(w)
    w["opt"].close()
    return out


def _tp_refused(rank, *, ckpt):
    """Shampoo saved with split Q/K/V and gate/up, loaded into a fused plan: every rank raises
    CheckpointError naming the reason, and the shards are untouched."""
    import canzona
    from canzona.runtime.errors import CheckpointError

    a = _tp_world(2, 2, optimizer="shampoo", split=True)
    _tp_steps(a, range(2))
    canzona.save_checkpoint(ckpt, _Params(a["local"]), a["opt"])
    a["opt"].close()
    b = _tp_world(2, 2, optimizer="shampoo", split=False, seed_shift=0.5)
    before = [x.detach().clone() for _, x in b["local"]]
    try:
        canzona.load_checkpoint(ckpt, _Params(b["local"]), b["opt"])
    except CheckpointError as exc:
        message = str(exc)
    else:
        message = None
    same = all(torch.equal(x, y) for x, (_, y) in zip(before, b["local"]))
    b["opt"].close()
    return {"message": message, "unchanged": same}


def _roundtrip(rank, *, src, dst):
    """Muon split → fused at dp 2 × tp 2 → dp 4 × tp 1: load, save again at once; the logical
    tensors of both checkpoints are compared in the test (momentum remapped row for row)."""
    import canzona

    a = _tp_world(2, 2, split=True)
    _tp_steps(a, range(SAVE_AT))
    canzona.save_checkpoint(src, _Params(a["local"]), a["opt"])
    a["opt"].close()
    b = _tp_world(4, 1, split=False, seed_shift=0.5)
    canzona.load_checkpoint(src, _Params(b["local"]), b["opt"])
    canzona.save_checkpoint(dst, _Params(b["local"]), b["opt"])
    b["opt"].close()
    return True


_CASES = {
    "dp2": lambda r, ck: _dp_uninterrupted(r, dp=2),
    "dp2_same": lambda r, ck: _dp_run(r, first=(2, True), second=(2, True), ckpt=ck("a")),
    "dp2_to_dp4": lambda r, ck: _dp_run(r, first=(2, True), second=(4, True), ckpt=ck("b")),
    "dp4_reorder_off": lambda r, ck: _dp_run(r, first=(4, True), second=(4, False), ckpt=ck("c")),
    "shampoo_dp2": lambda r, ck: _dp_uninterrupted(r, dp=2, optimizer="shampoo"),
    "shampoo_dp2_to_dp4": lambda r, ck: _dp_run(r, first=(2, True), second=(4, False),
                                                ckpt=ck("d"), optimizer="shampoo"),
    "tp_dp2xtp2": lambda r, ck: _tp_uninterrupted(r, dp=2, tp=2),
    "tp_to_dp4": lambda r, ck: _tp_run(r, first=(2, 2), second=(4, 1), ckpt=ck("e")),
    "tp_from_dp4": lambda r, ck: _tp_run(r, first=(4, 1), second=(2, 2), ckpt=ck("f")),
    "tp_same": lambda r, ck: _tp_run(r, first=(2, 2), second=(2, 2), ckpt=ck("g")),
    "soap_dp2xtp2": lambda r, ck: _tp_uninterrupted(r, dp=2, tp=2, optimizer="soap"),
    "soap_to_dp4": lambda r, ck: _tp_run(r, first=(2, 2), second=(4, 1), ckpt=ck("h"),
                                         optimizer="soap"),
    "refused": lambda r, ck: _tp_refused(r, ckpt=ck("i")),
    "roundtrip": lambda r, ck: _roundtrip(r, src=ck("j"), dst=ck("k")),
}


def _case(name, tmp, rank, world):
    # In the spawned ranks only: a vocabulary of 128, which tp 1 holds unpadded (Megatron pads
    # to a multiple of 128·tp) and tp 2 pads to 256 (TP rank 1 holds padding only).
    T.CFG = T.CFG.model_copy(update={"vocab": 128})
    return _CASES[name](rank, lambda k: os.path.join(tmp, k))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    cases = [(name, functools.partial(_case, name, tmp)) for name in _CASES]
    return tmp, H.run_world(WORLD, cases, tmp)


def _max_rel(a, b):
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def test_same_plan_bit_identical(world):
    _, ranks = world
    want, got = H.results(ranks, "dp2")[0], H.results(ranks, "dp2_same")[0]
    assert all(torch.equal(got[k], want[k]) for k in want)
    want, got = H.results(ranks, "tp_dp2xtp2")[0], H.results(ranks, "tp_same")[0]
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("case,reference", [("dp2_to_dp4", "dp2"), ("dp4_reorder_off", "dp2"),
                                            ("shampoo_dp2_to_dp4", "shampoo_dp2"),
                                            ("tp_to_dp4", "tp_dp2xtp2"),
                                            ("tp_from_dp4", "tp_dp2xtp2"),
                                            ("soap_to_dp4", "soap_dp2xtp2")])
def test_other_plan_equals_uninterrupted(world, case, reference):
    _, ranks = world
    want = H.results(ranks, reference)[0]
    for got in H.results(ranks, case):
        if got is not None:
            assert _max_rel(got, want) < 1e-5


def test_shampoo_split_to_fused_refused_everywhere(world):
    _, ranks = world
    for res in H.results(ranks, "refused"):
        assert res["unchanged"]
        assert res["message"] is not None
    messages = [r["message"] for r in H.results(ranks, "refused")]
    assert any("split" in m and "split_qkv" in m for m in messages)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_muon_momentum_remapped_split_to_fused(world):
    import torch.distributed.checkpoint as dcp

    tmp, ranks = world
    H.results(ranks, "roundtrip")
    src, dst = (os.path.join(tmp, k) for k in ("j", "k"))
    md_src = dcp.FileSystemReader(src).read_metadata().state_dict_metadata
    md_dst = dcp.FileSystemReader(dst).read_metadata().state_dict_metadata
    assert set(md_src) == set(md_dst)
    keys = [k for k, v in md_src.items() if hasattr(v, "size")]
    assert any(k.endswith("linear_qkv.weight.momentum_buffer") for k in keys)
    a = {k: torch.empty(tuple(md_src[k].size), dtype=md_src[k].properties.dtype) for k in keys}
    b = {k: torch.empty_like(v) for k, v in a.items()}
    dcp.load(a, checkpoint_id=src, no_dist=True)
    dcp.load(b, checkpoint_id=dst, no_dist=True)
    for k in keys:
        assert torch.equal(a[k], b[k]), k
