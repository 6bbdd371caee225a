"""CanzonaOptimizer under tensor parallelism (gloo): dp 2 × tp 2 and dp 1 × tp 2, against one
process updating the logical (single-device) matrices.

The parameters are Megatron's TP shards (fused QKV grouped per KV group, fc1 held as
[gate_r; up_r], vocabulary-parallel embedding and output layer with padding); the plans gather in
fp32 and Newton–Schulz runs in fp32 on both sides, so the only differences are summation order.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dp_helpers as H
import tp_helpers as T

pytestmark = pytest.mark.slow

CASES4 = {
    "muon": dict(optimizer="muon"),
    "muon_split": dict(optimizer="muon", split=True),
    "shampoo": dict(optimizer="shampoo"),
    "soap": dict(optimizer="soap"),
    "muon_accum_clip": dict(optimizer="muon", accum=2, clip=0.05),
    "muon_roundtrip": dict(optimizer="muon", roundtrip=True),
    # variants of one feature each: 5 steps
    "muon_no_overlap": dict(optimizer="muon", overlap_tp=False),  # bit-compared with "muon"
    "muon_sequence_parallel": dict(optimizer="muon", sequence_parallel=True, steps=5),
    "muon_bf16_main_fp32": dict(optimizer="muon", bf16=True, steps=5),
    # every matrix shared by its TP group (shared Newton–Schulz over the shards, no
    # gather), without and with the polynomial split; with a state_dict round trip; bf16. The
    # lockstep batches hold 2·C_max: with C_max 1 MiB an index's 4 matrices run as one batch,
    # with 0.05 MiB one by one.
    "muon_shared": dict(optimizer="muon", share="all", roundtrip=True, cmax_mib=1.0),
    "muon_shared_split": dict(optimizer="muon", share="all-split"),
    "muon_shared_bf16": dict(optimizer="muon", share="all-split", bf16=True, steps=5),
    # Shampoo with blocks of 16: every shard (fc1's 48-row gate/up segments, QKV's 32- and
    # 16-row groups, fc2's and proj's 48 and 32 columns) is whole blocks, so each TP rank
    # preconditions its own shard's blocks (no gather), with a state_dict round trip
    "shampoo_shard_blocks": dict(optimizer="shampoo", share="all", block=16, roundtrip=True),
    "shampoo_hosted_blocks": dict(optimizer="shampoo", block=16, steps=5),
    # named Newton–Schulz schedules and update scalings, on hosted and on shared matrices;
    # quintic from the plan alone (the runtime takes the schedule the plan records)
    "muon_quintic_unit_rms": dict(optimizer="muon", steps=5, ns="quintic",
                                  matrix_options=dict(adjust_lr_fn="unit_rms_norm")),
    "muon_polar_express_spectral": dict(optimizer="muon", share="all-split", steps=5,
                                        matrix_options=dict(ns_coefficients="polar_express",
                                                            adjust_lr_fn="spectral")),
    # NorMuon: hosted (whole matrices), shared by the TP group (fc1's and QKV's shards are
    # whole rows, their moments kept per shard; proj's and fc2's columns, every row's moments
    # summed), and by two TP groups (pieces of fc1's rows); with a state_dict round trip
    "normuon": dict(optimizer="normuon", steps=5),
    "normuon_shared": dict(optimizer="normuon", share="all-split", roundtrip=True, steps=5),
    "normuon_tp_pairs": dict(optimizer="normuon", share="pairs", steps=5),
    # k = 2·tp: fc1 shared by the TP groups of both DP indices (each holds half of every
    # shard's rows: the bucket cut inside the shards), the other matrices by their TP group;
    # with a state_dict round trip; bf16
    "muon_tp_pairs": dict(optimizer="muon", share="pairs", roundtrip=True),
    "muon_tp_pairs_bf16": dict(optimizer="muon", share="pairs", bf16=True, steps=5),
    # with C_max 0.15 MiB the partners' batches hold their halves and different own matrices
    # (index 0: its halves with two own ones, index 1: with one, then another batch)
    "muon_tp_pairs_mixed_batches": dict(optimizer="muon", share="pairs", cmax_mib=0.15,
                                        steps=5),
    # the QKV per head: each TP rank updates the heads of its own shard, batched, nothing
    # gathered (with a state_dict round trip); NorMuon's row moments per head; beside sharing;
    # Shampoo's and SOAP's preconditioners per head
    "muon_heads": dict(optimizer="muon", split="heads", roundtrip=True, steps=5),
    "normuon_heads": dict(optimizer="normuon", split="heads", steps=5),
    "muon_heads_shared": dict(optimizer="muon", split="heads", share="all-split", steps=5),
    "shampoo_heads": dict(optimizer="shampoo", split="heads", roundtrip=True, steps=5),
    "soap_heads": dict(optimizer="soap", split="heads", steps=5),
    # QK-clip after every step (each rank its heads' maxima, different on every DP rank):
    # fp32 weights, bf16 weights with fp32 main copies, the QKV shared by its TP group
    "muon_qk_clip": dict(optimizer="muon", qk_clip=True, steps=5),
    "muon_qk_clip_bf16": dict(optimizer="muon", qk_clip=True, bf16=True, steps=5),
    "muon_qk_clip_shared": dict(optimizer="muon", qk_clip=True, share="all", steps=5),
    # the defaults (roofline cost, share auto): whatever the planner keeps runs exactly
    **{f"{o}_default_share": dict(optimizer=o, share="auto", steps=5)
       for o in ("muon", "shampoo", "soap")},
}
#: dp 4 × tp 1 on the same 4 ranks: at tp 1 every head is contiguous rows of Megatron's fused
#: QKV (grouped per KV group), updated by the owner of the whole weight
CASES_DP4 = {"muon_heads_dp4": dict(optimizer="muon", split="heads", steps=5)}
#: keyword arguments of the runs that leave the math as without them (the reference omits them)
SAME_MATH = ("roundtrip", "overlap_tp", "sequence_parallel", "share", "cmax_mib")
FORWARD = ("muon", "shampoo")  # SOAP: its rank-deficient statistics make last bits chaotic
CASES2 = {
    "muon": dict(optimizer="muon"),
    "soap_split": dict(optimizer="soap", split=True),
    "muon_shared_split": dict(optimizer="muon", share="all-split"),
}


def _case(rank, world, *, dp, tp, **kw):
    return T.train_tp(rank, world, dp=dp, tp=tp, **kw)


def _forward(rank, world, *, dp, tp, optimizer):
    return T.train_forward(rank, world, dp=dp, tp=tp, optimizer=optimizer)


def _refusals(rank, world):
    """Each refusal, on every rank alike, before any gradient or parameter collective."""
    import canzona
    from canzona.runtime.errors import PlanMismatchError

    dp_group, tp_group = T.groups(1, 2)
    plan = T.plan_for(1, 2)
    start = T.initial_full()
    out = {}

    def attempt(key, pairs, **kw):
        try:
            canzona.CanzonaOptimizer(pairs, plan, **kw)
            out[key] = "no error"
        except PlanMismatchError as exc:
            out[key] = str(exc)

    ps = T.spec().params
    shards = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 2, rank), 2)) for p in ps]
    # the unsharded fused QKV on rank 1 only: both ranks refuse (rank 0 names the other rank)
    wrong = [(n, torch.nn.Parameter(start[n].clone())
              if rank == 1 and n.endswith("layers.0.self_attention.linear_qkv.weight") else w)
             for n, w in shards]
    attempt("layout", wrong, tp_group=tp_group)
    attempt("no_tp_group", shards)
    attempt("dp_plan_needs_dp_group", shards, tp_group=tp_group, dp_group=None)
    return out


def _oversized_tp_group(rank, world):
    """A dp 1 × tp 2 plan handed the whole 4-rank world as its TP group: refused before any
    collective, naming both sizes."""
    import torch.distributed as dist

    import canzona
    from canzona.runtime.errors import PlanMismatchError

    start = T.initial_full()
    shards = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 2, rank % 2), 2))
              for p in T.spec().params]
    try:
        canzona.CanzonaOptimizer(shards, T.plan_for(1, 2), tp_group=dist.group.WORLD)
        return "no error"
    except PlanMismatchError as exc:
        return str(exc)


def cases4(folder: str = "") -> list:
    """This module's dp 2 × tp 2 cases (run with the DTensor ones: conftest's ``tp_world4``;
    ``folder``: where the checkpoint case writes)."""
    cases = [(k, functools.partial(_case, dp=2, tp=2, **v)) for k, v in CASES4.items()]
    cases += [(k, functools.partial(_case, dp=4, tp=1, **v)) for k, v in CASES_DP4.items()]
    cases.append(("oversized_tp_group", _oversized_tp_group))
    if folder:
        cases.append(("pairs_checkpoint", functools.partial(_pairs_checkpoint, folder=folder)))
    return cases + [(f"forward_{o}", functools.partial(_forward, dp=2, tp=2, optimizer=o))
                    for o in FORWARD]


@pytest.fixture(scope="module")
def world4(tp_world4):
    return tp_world4


def _shared_checkpoint(rank, world, *, folder, optimizer="muon"):
    """Logical checkpoints across sharing: a momentum saved by a plan whose TP group shares
    every matrix (each rank its shard) loads into the plan that hosts them (the host's full
    matrix), and back; each side holds exactly the canonical momentum it was given. NorMuon's
    row moments too: a column-parallel shard's rows, a row-parallel one's every row."""
    import canzona

    _, tp_group = T.groups(1, 2)
    start = T.initial_full()
    ps = T.spec().params
    g = torch.Generator().manual_seed(11)
    keys = ("momentum_buffer",) + (("second_momentum_buffer",) if optimizer == "normuon"
                                   else ())
    canon = {key: {p.name: torch.rand(p.shape if key == "momentum_buffer" else (p.shape[0], 1),
                                      generator=g)
                   for p in ps if p.optimizer == "matrix"} for key in keys}
    shards = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 2, rank), 2)) for p in ps]
    by_name = {p.name: p for p in ps}

    def local(name, full):  # this rank's part of a canonical state tensor
        p = by_name[name]
        if full.shape[1] == p.shape[1]:
            return T.local_of(p, full, 2, rank)
        if p.tp_dim != 0:  # a row-parallel shard holds every row's moment
            return full
        return T.local_of(p, full.expand(p.shape).contiguous(), 2, rank)[:, :1]

    def build(share):
        return canzona.CanzonaOptimizer(shards, T.plan_for(1, 2, optimizer, share=share),
                                        lr=T.LR[optimizer], tp_group=tp_group)

    def shared_state(opt, key):  # this rank's shard of each shared matrix's state
        return {x.name: opt.state[opt._params[x.param]][key] for x in opt._micro.shared}

    def hosted_state(opt, key):  # the full state of each matrix hosted here
        return {t.name: opt.state[opt._params[t.param]][key]
                for t in opt._micro.hosted if t.part is None}

    out = {"to_hosted": {}, "to_shared": {}}
    opt = build("all")
    for key in keys:
        for name, m in shared_state(opt, key).items():
            m.copy_(local(name, canon[key][name]))
    canzona.save_checkpoint(f"{folder}/shared", None, opt)
    opt.close()
    opt = build("off")
    canzona.load_checkpoint(f"{folder}/shared", None, opt)
    for key in keys:
        out["to_hosted"].update({(key, n): bool(torch.equal(m, canon[key][n]))
                                 for n, m in hosted_state(opt, key).items()})
        for n, m in hosted_state(opt, key).items():  # and back, from other values
            m.copy_(canon[key][n] * 2)
    canzona.save_checkpoint(f"{folder}/hosted", None, opt)
    opt.close()
    opt = build("all")
    canzona.load_checkpoint(f"{folder}/hosted", None, opt)
    for key in keys:
        out["to_shared"].update({(key, n): bool(torch.equal(m, local(n, canon[key][n] * 2)))
                                 for n, m in shared_state(opt, key).items()})
    out["state_dict"] = "state" in opt.state_dict()
    opt.close()
    return out


def _heads_checkpoint(rank, world, *, folder, optimizer="muon"):
    """Logical checkpoints across the QKV split: the state saved by a plan that orthogonalises
    the QKV head by head (each TP rank its own heads' rows) loads into the plan that hosts the
    fused matrix (the host's full matrix), and back; each side holds exactly the canonical state
    it was given (NorMuon: its row moments too)."""
    import canzona
    from canzona.runtime.update import task_state

    _, tp_group = T.groups(1, 2)
    start = T.initial_full()
    p = next(x for x in T.spec().params if x.tp_layout == "qkv")
    g = torch.Generator().manual_seed(13)
    keys = ("momentum_buffer",) + (("second_momentum_buffer",) if optimizer == "normuon"
                                   else ())
    canon = {k: torch.rand(p.shape if k == "momentum_buffer" else (p.shape[0], 1), generator=g)
             for k in keys}
    shards = [(q.name, T.megatron_param(q, T.local_of(q, start[q.name], 2, rank), 2))
              for q in T.spec().params]

    def local(full):  # this rank's shard of a canonical state
        return T.local_of(p, full.expand(p.shape).contiguous(), 2, rank)[:, :full.shape[1]]

    def build(split):
        return canzona.CanzonaOptimizer(shards, T.plan_for(1, 2, optimizer, split=split),
                                        lr=T.LR[optimizer], tp_group=tp_group)

    def heads(opt):  # (task, its state) of this rank's heads
        return [(t, task_state(t, opt._params, opt.state)) for ts in opt._schedule.mine.matrix
                for t in ts if t.name.startswith(p.name + "#")]

    def hosted(opt):  # the fused QKV's full state, where this rank hosts it
        return [opt.state[opt._params[t.param]] for t in opt._micro.hosted if t.name == p.name]

    out = {"heads": 0, "to_fused": [], "to_heads": []}
    opt = build("heads")
    for t, st in heads(opt):
        for k in keys:
            st[k].copy_(local(canon[k])[t.row0:t.row0 + t.shape[0]])
        out["heads"] += 1
    canzona.save_checkpoint(f"{folder}/heads", None, opt)
    opt.close()
    opt = build(False)
    canzona.load_checkpoint(f"{folder}/heads", None, opt)
    for st in hosted(opt):
        out["to_fused"] += [bool(torch.equal(st[k], canon[k])) for k in keys]
        for k in keys:
            st[k].copy_(canon[k] * 2)
    canzona.save_checkpoint(f"{folder}/fused", None, opt)
    opt.close()
    opt = build("heads")
    canzona.load_checkpoint(f"{folder}/fused", None, opt)
    for t, st in heads(opt):
        rows = slice(t.row0, t.row0 + t.shape[0])
        out["to_heads"] += [bool(torch.equal(st[k], local(canon[k] * 2)[rows])) for k in keys]
    opt.close()
    return out


def _heads_batched(rank, world):
    """The shapes of the batched Newton–Schulz calls of one step with the QKV per head."""
    from canzona.runtime.optim import muon

    real, shapes = muon._newton_schulz_, []

    def spy(stack, *args, **kwargs):
        shapes.append(tuple(stack.shape))
        return real(stack, *args, **kwargs)

    muon._newton_schulz_ = spy
    try:
        T.train_tp(rank, world, dp=1, tp=2, steps=1, split="heads")
    finally:
        muon._newton_schulz_ = real
    return shapes


def _pairs_checkpoint(rank, world, *, folder):
    """Logical checkpoints across k = 2·tp: a momentum saved by the plan whose TP groups share
    fc1 with the partner index (each rank its rows of its shard) loads into the plan that hosts
    every matrix (the host's full matrix), and back; each holds exactly the canonical momentum
    it was given."""
    import canzona

    dp_group, tp_group = T.groups(2, 2)
    d, t = divmod(rank, 2)
    start = T.initial_full()
    ps = T.spec().params
    by_name = {p.name: p for p in ps}
    g = torch.Generator().manual_seed(12)
    moment = {p.name: torch.randn(p.shape, generator=g) for p in ps if p.optimizer == "matrix"}
    shards = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 2, t), 2)) for p in ps]

    def build(share):
        return canzona.CanzonaOptimizer(shards, T.plan_for(2, 2, share=share), tp_group=tp_group,
                                        dp_group=dp_group)

    def mine(opt, name, full):  # this rank's rows of its shard of a shared matrix
        x = next(x for x in opt._micro.shared if x.name == name)
        local = T.local_of(by_name[name], full, 2, t)
        return local[x.row0:x.row0 + x.local_shape[0]]

    out = {}
    opt = build("pairs")
    halves = [x.name for x in opt._micro.shared if x.pair is not None]
    for x in opt._micro.shared:
        opt.state[opt._params[x.param]]["momentum_buffer"].copy_(mine(opt, x.name, moment[x.name]))
    canzona.save_checkpoint(f"{folder}/pairs", None, opt)
    opt.close()
    opt = build("off")
    canzona.load_checkpoint(f"{folder}/pairs", None, opt)
    out["to_hosted"] = {t_.name: bool(torch.equal(opt.state[opt._params[t_.param]]
                                                  ["momentum_buffer"], moment[t_.name]))
                        for t_ in opt._micro.hosted if t_.part is None}
    for t_ in opt._micro.hosted:
        if t_.part is None:
            opt.state[opt._params[t_.param]]["momentum_buffer"].copy_(moment[t_.name] * 2)
    canzona.save_checkpoint(f"{folder}/hosted", None, opt)
    opt.close()
    opt = build("pairs")
    canzona.load_checkpoint(f"{folder}/hosted", None, opt)
    out["to_pairs"] = {x.name: bool(torch.equal(opt.state[opt._params[x.param]]
                                                ["momentum_buffer"],
                                                mine(opt, x.name, moment[x.name] * 2)))
                       for x in opt._micro.shared}
    out["halves"] = halves
    opt.close()
    return out


def _shampoo_run(rank, steps, opt_of, *, switch=None, folder=""):
    """Train the tiny model's TP shards with Shampoo (blocks of 16) for ``steps`` steps, from
    the start; with ``switch`` = (step, other plan's share): at that step save a logical
    checkpoint, load it into an optimizer of the other plan and go on with that one."""
    import canzona

    ps = T.spec().params
    start = T.initial_full()
    local = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 2, rank), 2)) for p in ps]
    opt = opt_of(local, "all" if switch is None or switch[1] == "off" else "off")
    _, tp_group = T.groups(1, 2)
    for step in range(steps):
        if switch is not None and step == switch[0]:
            canzona.save_checkpoint(folder, None, opt)
            opt.close()
            opt = opt_of(local, switch[1])
            canzona.load_checkpoint(folder, None, opt)
        full = {p.name: T.full_of(p, w, 2, tp_group).float().requires_grad_(True)
                for p, (_, w) in zip(ps, local)}
        grads = torch.autograd.grad(T.loss(full, step, 0), list(full.values()))
        torch.autograd.backward([w for _, w in local],
                                [T.local_of(p, g, 2, rank) for p, g in zip(ps, grads)])
        opt.step()
        opt.zero_grad()
    shared = len(opt._micro.shared)
    opt.close()
    return {p.name: T.full_of(p, w, 2, tp_group).float() for p, (_, w) in zip(ps, local)}, shared


def _shampoo_checkpoint(rank, world, *, folder):
    """Logical checkpoints across Shampoo's shard-by-shard blocks: 6 steps with every matrix's
    blocks preconditioned shard by shard, against 3 steps so, a save, a load into the plan that
    hosts them whole, and 3 steps more (statistics, roots, grafting moments and step carried
    over) — and the other way round."""
    import canzona

    _, tp_group = T.groups(1, 2)

    def opt_of(local, share):
        return canzona.CanzonaOptimizer(
            local, T.plan_for(1, 2, "shampoo", share=share, block=16), lr=T.LR["shampoo"],
            adamw_lr=T.ADAMW_LR, adamw_weight_decay=0.01, tp_group=tp_group,
            matrix_options=T.SHAMPOO_OPTIONS)

    straight, n_shared = _shampoo_run(rank, 6, opt_of)
    to_hosted, n_hosted = _shampoo_run(rank, 6, opt_of, switch=(3, "off"), folder=f"{folder}/a")
    to_shared, _ = _shampoo_run(rank, 6, opt_of, switch=(3, "all"), folder=f"{folder}/b")
    return {"straight": straight, "to_hosted": to_hosted, "to_shared": to_shared,
            "shared": (n_shared, n_hosted)}


def _wire_dtypes(rank, world, *, comm_dtype):
    """``train_tp`` under a plan with ``comm_dtype``, recording the dtype of every all-to-all
    the micro-groups send (the gathers and the scatters)."""
    import torch.distributed as dist

    sent, real = [], dist.all_to_all_single

    def spy(out, send, *args, **kwargs):
        sent.append(str(send.dtype))
        return real(out, send, *args, **kwargs)

    dist.all_to_all_single = spy
    try:
        res = T.train_tp(rank, world, dp=1, tp=2, steps=2,
                         plan=functools.partial(T.plan_for, 1, 2, comm_dtype=comm_dtype))
    finally:
        dist.all_to_all_single = real
    return {"params": res["params"], "sent": sent}


OVERFLOWING = "decoder.layers.0.mlp.linear_fc2.weight"  # one matrix, one host


def _fp16_overflow(rank, world, *, nonfinite="raise"):
    """One matrix's gradient finite in fp32 but beyond fp16's range: the fp16 gather hands its
    host an infinite matrix. Under ``nonfinite="raise"`` the kernel refuses it and the other TP
    rank, which hosts only finite matrices, raises with it; under ``"skip"`` every rank leaves
    that matrix as it was and updates the rest."""
    from canzona.runtime.optim import NonFiniteGradientError

    real = T.loss

    def huge(full, step, dp_rank):
        w = full[OVERFLOWING]
        x, y = T.data(step, dp_rank, OVERFLOWING, tuple(w.shape))
        return real(full, step, dp_rank) + 1e12 * torch.tanh(x @ w.T - y).pow(2).mean()

    T.loss = huge
    try:
        res = T.train_tp(rank, world, dp=1, tp=2, steps=1, matrix_options={"nonfinite": nonfinite},
                         plan=functools.partial(T.plan_for, 1, 2, comm_dtype="fp16"))
        return res["params"]
    except NonFiniteGradientError as exc:
        return str(exc)
    finally:
        T.loss = real


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cases = [(k, functools.partial(_case, dp=1, tp=2, **v)) for k, v in CASES2.items()]
    folder = str(tmp_path_factory.mktemp("tp2-ck"))
    cases += [(f"comm_{dt}", functools.partial(_wire_dtypes, comm_dtype=dt))
              for dt in ("bf16", "fp16")]
    cases += [("fp16_overflow", _fp16_overflow),
              ("fp16_overflow_skip", functools.partial(_fp16_overflow, nonfinite="skip")),
              ("untouched", functools.partial(_case, dp=1, tp=2, **UNTOUCHED))]
    cases += [("refusals", _refusals), ("heads_batched", _heads_batched),
              ("shared_checkpoint", functools.partial(_shared_checkpoint, folder=folder)),
              ("normuon_checkpoint", functools.partial(_shared_checkpoint,
                                                       folder=f"{folder}/normuon",
                                                       optimizer="normuon")),
              *[(f"{o}_heads_checkpoint", functools.partial(
                  _heads_checkpoint, folder=f"{folder}/{o}-heads", optimizer=o))
                for o in ("muon", "normuon")],
              ("shampoo_checkpoint", functools.partial(_shampoo_checkpoint,
                                                       folder=f"{folder}/shampoo"))]
    return H.run_world(2, cases, str(tmp_path_factory.mktemp("tp2")))


def test_logical_checkpoints_cross_tp_pairs(world4):
    got = H.results(world4, "pairs_checkpoint")
    hosted = set()
    for res in got:
        assert res["halves"], "the plan shares fc1 with the partner index"
        assert res["to_hosted"] and all(res["to_hosted"].values()), res["to_hosted"]
        assert res["to_pairs"] and all(res["to_pairs"].values()), res["to_pairs"]
        hosted |= set(res["to_hosted"])
    assert len(hosted) == 8  # the hosts of the four ranks hold every matrix between them


@pytest.mark.parametrize("case,keys", [("shared_checkpoint", 1), ("normuon_checkpoint", 2)])
def test_logical_checkpoints_cross_sharing(world2, case, keys):
    got = H.results(world2, case)
    hosted = set()
    for res in got:
        assert res["to_hosted"] and all(res["to_hosted"].values()), res["to_hosted"]
        assert res["to_shared"] and all(res["to_shared"].values()), res["to_shared"]
        assert len(res["to_shared"]) == 8 * keys and res["state_dict"]  # every matrix shared
        hosted |= set(res["to_hosted"])
    assert len(hosted) == 8 * keys  # the hosts of the two ranks hold every matrix between them


def test_a_tp_rank_orthogonalises_its_heads_in_one_batch(world2):
    """Each TP rank holds one KV group of each layer's QKV (two query heads, a key and a value
    head: 16 × 64 each): the 8 heads of its two layers are one batched Newton–Schulz."""
    for shapes in H.results(world2, "heads_batched"):
        assert (8, 16, 64) in shapes, shapes


@pytest.mark.parametrize("optimizer,keys", [("muon", 1), ("normuon", 2)])
def test_logical_checkpoints_cross_the_qkv_split_per_head(world2, optimizer, keys):
    """Every rank holds the state of its 4 heads of layer 0 (its KV group: two query heads, a
    key and a value head), which the fused plan's host receives whole, and back."""
    got = H.results(world2, f"{optimizer}_heads_checkpoint")
    assert [res["heads"] for res in got] == [4, 4]
    fused = [x for res in got for x in res["to_fused"]]
    assert fused and all(fused) and len(fused) == keys  # one host holds the fused QKV
    for res in got:
        assert len(res["to_heads"]) == 4 * keys and all(res["to_heads"])


def test_logical_checkpoints_cross_shampoos_shard_blocks(world2):
    """A Shampoo state saved with the blocks preconditioned shard by shard resumes with them
    hosted whole, and back: the same parameters as without the switch (the two plans compute
    the same blocks; the hosted plan's gather sums nothing, so within 1e-5)."""
    got = H.results(world2, "shampoo_checkpoint")
    for res in got:
        assert res["shared"] == (8, 0)  # every matrix shared, then every one hosted
        for name, want in res["straight"].items():
            for key in ("to_hosted", "to_shared"):
                err = ((res[key][name] - want).norm() / want.norm()).item()
                assert err <= 1e-5, f"{key} {name}: relative error {err:.3g}"


def _check(got, ref, tol=1e-5):
    start = T.initial_full()
    for res in got:
        for name, want in ref["params"].items():
            have = res["params"][name]
            err = ((have - want).norm() / want.norm()).item()
            assert err <= tol, f"{name}: relative error {err:.3g}"
    # every parameter moved (the optimizer did run on every matrix and vector)
    for name, want in ref["params"].items():
        assert not torch.equal(got[0]["params"][name], start[name]), name


@pytest.mark.parametrize("case", list(CASES4))
def test_dp2_tp2_equals_one_process(world4, case):
    kw = {k: v for k, v in CASES4[case].items() if k not in SAME_MATH}  # same math as without
    got = H.results(world4, case)
    ref = T.reference(2, **kw)
    # bf16 parameters: a shared Newton–Schulz sums in another order, and an update 1e-7 away
    # rounds some elements to the neighbouring bf16 value (4e-3 of that element): measured
    # 4.4e-5 over the tensor after 5 steps. Hosted matrices compute exactly as the reference.
    _check(got, ref, tol=2e-4 if case in ("muon_shared_bf16", "muon_tp_pairs_bf16") else 1e-5)
    if kw.get("clip"):
        for res in got:
            assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)
            assert max(res["norms"]) > kw["clip"]  # clipping did act


@pytest.mark.parametrize("case", list(CASES_DP4))
def test_dp4_tp1_equals_one_process(world4, case):
    _check(H.results(world4, case), T.reference(4, **CASES_DP4[case]))


@pytest.mark.parametrize("case", [c for c in CASES4 if "qk_clip" in c])
def test_qk_clip_leaves_the_replicas_bit_identical(world4, case):
    """After QK-clip the two DP replicas of each TP rank hold the same bits (the maxima reduced
    over DP), and the clipping acted: the DP ranks' maxima differ, so only their maximum gives
    the reference (above), and some KV groups clip at every step while others do not."""
    got = H.results(world4, case)
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(got[a]["params"][n], got[b]["params"][n])
                   for n in got[a]["params"])
    for step in range(CASES4[case]["steps"]):
        for layer in range(T.CFG.layers):
            per_rank = [T.qk_logits(step, d, layer) for d in range(2)]
            assert not torch.equal(*per_rank)
            m = torch.stack(per_rank).amax(0).view(T.CFG.kv_heads, -1).amax(1)
            assert (m > T.QK_TAU).any()
    if "shared" in case:
        assert any(x for res in got for x in [res["plan"].tp.indices[0].shared])


def test_the_tp_pairs_plan_shares_fc1_over_both_tp_groups():
    """The plan the ``muon_tp_pairs`` runs use: every fc1 shared by DP indices 0 and 1 (each
    half in its TP group's shared list, naming the other), the rest by their TP group."""
    p = T.plan_for(2, 2, share="pairs")
    assert p.dp_shared and all(tuple(x.owners) == (0, 1) for x in p.dp_shared)
    assert {p.tasks[x.id].param.split(".")[-2] for x in p.dp_shared} == {"linear_fc1"}
    for x in p.dp_shared:
        halves = [(ix.dp_index, s.partner) for ix in p.tp.indices for s in ix.shared
                  if s.id == x.id]
        assert halves == [(0, 1), (1, 0)]


@pytest.mark.parametrize("case", list(CASES2))
def test_dp1_tp2_equals_one_process(world2, case):
    got = H.results(world2, case)
    _check(got, T.reference(1, **{k: v for k, v in CASES2[case].items() if k not in SAME_MATH}))


def test_refusals_before_any_collective(world2):
    got = H.results(world2, "refusals")
    assert "TP shard 'decoder.layers.0.self_attention.linear_qkv.weight' should be [64, 64]" \
        in got[1]["layout"]
    assert "does not match the model on TP rank(s) [1]" in got[0]["layout"]
    for res in got:
        assert "pass tp_group=" in res["no_tp_group"]
        # dp = 1: no DP group needed, the plan runs with the TP group alone
        assert res["dp_plan_needs_dp_group"] == "no error"


def test_scratch_within_two_micro_groups_of_the_plan(world4):
    for res in H.results(world4, "muon"):
        plan = res["plan"]
        ix = plan.tp.indices[res["dp_rank"]]
        hosted = sorted((sum(t.gathered_bytes for t in g.tasks if t.host == res["tp_rank"])
                         for g in ix.groups), reverse=True)
        assert res["scratch"] == sum(hosted[:2])  # the two largest groups this rank hosts
        assert res["scratch"] <= 2 * plan.tp.metrics.peak_gathered_bytes
        assert max(g.peak_gathered_bytes for g in ix.groups) <= plan.tp.cmax_bytes


def test_overlap_off_gives_the_same_bits(world4):
    on, off = H.results(world4, "muon"), H.results(world4, "muon_no_overlap")
    for a, b in zip(on, off):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


@pytest.mark.parametrize("case", ["muon", "shampoo", "soap", "muon_split", "muon_bf16_main_fp32",
                                  "muon_shared", "muon_shared_bf16", "shampoo_shard_blocks",
                                  "muon_tp_pairs", "muon_tp_pairs_bf16", "normuon_shared",
                                  "normuon_tp_pairs", "muon_heads", "normuon_heads",
                                  "shampoo_heads"])
def test_state_bytes_equal_the_prediction(world4, case):
    got = H.results(world4, case)
    for res in got:
        st = res["state"]
        assert st["measured"] == st["predicted"] == st["from_plan"], (res["tp_rank"], st)
    # every split matrix's state is on exactly one TP rank: the TP ranks of an index differ;
    # a shared matrix's momentum is split by shard: the TP ranks of an index hold the same
    shared = "share" in CASES4[case]
    assert len({r["state"]["measured"] for r in got if r["dp_rank"] == 0}) == (1 if shared else 2)


@pytest.mark.parametrize("optimizer", FORWARD)
def test_megatron_forward_dp2_tp2_equals_one_process(world4, optimizer):
    """A real TP forward (vocabulary-parallel embedding and output, fused QKV per KV group, GQA,
    [gate_r; up_r]) and backward on the shards: the gradients differ from one device's only by
    the all-reduces' summation order, so the bound is 1e-5 after 5 steps."""
    got = H.results(world4, f"forward_{optimizer}")
    ref = T.reference_forward(2, optimizer)
    # each DP rank's losses, step by step, are one process's on that rank's batches
    for rank, res in enumerate(got):
        assert res["losses"] == pytest.approx(ref["losses"][rank // 2::2], rel=1e-5)
    _check(got, ref)


def test_shampoo_shards_are_preconditioned_where_they_lie(world4):
    """The Shampoo plan shares every matrix (its shards are whole blocks of 16): no micro-group,
    no gather; the hosted plan of the same blocks gathers them."""
    shard = H.results(world4, "shampoo_shard_blocks")[0]["plan"]
    hosted = H.results(world4, "shampoo_hosted_blocks")[0]["plan"]
    assert shard.inputs.optimizer.max_preconditioner_dim == 16
    for ix in shard.tp.indices:
        assert not ix.groups and all(not x.split_poly for x in ix.shared)
    assert sum(len(ix.shared) for ix in shard.tp.indices) == 8  # every matrix
    assert all(not ix.shared for ix in hosted.tp.indices)
    assert sum(len(g.tasks) for ix in hosted.tp.indices for g in ix.groups) == 8


def test_shared_runs_batch_by_cmax(world4):
    """The lockstep batches of the two shared runs: all of an index's matrices together under
    C_max 1 MiB, one at a time under 0.05 MiB (each matrix's scratch is over 2·C_max there)."""
    from canzona.planner.formulas import LOCKSTEP_CMAX, lockstep_batches, lockstep_bytes

    for case, together in (("muon_shared", True), ("muon_shared_split", False)):
        plan = H.results(world4, case)[0]["plan"]
        for ix in plan.tp.indices:
            assert ix.shared and not ix.groups  # every matrix shared, none hosted
            sizes = [lockstep_bytes(max(plan.tasks[x.id].shape) // 2, min(plan.tasks[x.id].shape),
                                    2, x.split_poly, 4) for x in ix.shared]
            batches = lockstep_batches(list(ix.shared), sizes, LOCKSTEP_CMAX * plan.tp.cmax_bytes)
            assert len(batches) == (1 if together else len(ix.shared)), (case, sizes)


def test_the_tp_gather_and_scatter_use_the_plans_comm_dtype(world2):
    """Every all-to-all of the micro-groups (gathers and scatters) carries the plan's
    communication dtype, and bf16 and fp16 runs differ (each rounds its own way)."""
    want = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
    runs = {dt: H.results(world2, f"comm_{dt}") for dt in want}
    for dt, ranks in runs.items():
        for res in ranks:
            assert res["sent"] and set(res["sent"]) == {want[dt]}, (dt, set(res["sent"]))
    a, b = runs["bf16"][0]["params"], runs["fp16"][0]["params"]
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_a_tp_group_larger_than_the_plans_is_refused(world4):
    for res in H.results(world4, "oversized_tp_group"):
        assert "the plan is for tp=2 but tp_group has 4 ranks" in res, res


def test_a_matrix_the_host_finds_non_finite_makes_every_tp_rank_raise(world2):
    got = H.results(world2, "fp16_overflow")
    assert all(isinstance(res, str) and "non-finite gradient" in res for res in got), got


def test_a_matrix_the_host_finds_non_finite_is_skipped_by_every_tp_rank(world2):
    """Under ``nonfinite="skip"`` the host's refusal reaches every TP rank: none changes its
    shard of the overflowing matrix (a rank applying the NaN its host sends would corrupt it),
    and every other matrix moves."""
    start = T.initial_full()
    for params in H.results(world2, "fp16_overflow_skip"):
        assert torch.equal(params[OVERFLOWING], start[OVERFLOWING])
        moved = [n for n, w in params.items() if n != OVERFLOWING and not torch.equal(w, start[n])]
        assert len(moved) == len(params) - 1, sorted(set(params) - set(moved))


#: a split matrix no rank produces a gradient for at step 1 of 3
UNTOUCHED = dict(optimizer="muon", steps=3, untouched=(OVERFLOWING, 1))


def test_a_tp_matrix_without_gradient_is_left_alone(world2):
    """A TP matrix whose gradient no rank produced this step is neither updated nor decayed on
    any shard, and its host leaves its momentum as it was, as the single-device optimizer does
    with ``grad=None``: the run equals the reference through the following step (a host that
    moves the momentum, or ranks that apply weight decay, drift from it)."""
    got = H.results(world2, "untouched")
    _check(got, T.reference(1, **UNTOUCHED))

