"""FSDP2 plans in the runtime: ``CanzonaOptimizer(model, plan)`` on a ``fully_shard``-ed model
(``runtime.fsdp2``, ``runtime.storage.fsdp2``) trains as one process does (Muon and Shampoo,
clipping active, at dp 2 and dp 4, both ``reshard_after_forward`` settings, the planner's
owners and random owners over 3 rounds; matrices shared by adjacent pairs, Muon and NorMuon);
Muon's momentum lives on each rank's rows, and under bfloat16 Newton–Schulz its rows travel in
bfloat16 with the same result as fp32 rows; round k + 1's gather is launched before round k is
computed; bad input is refused in one line; the optimizer's surface (state dict, close, groups,
non-finite gradients, a kernel raising on an owner or on a rank making its rows) works.

ONE 4-rank spawn with the checkpoint module (``conftest.fsdp2_world4``): a 2-D mesh ("rep", "dp") of
shape (2, 2) runs two dp-2 cases side by side (one per "rep" half), the whole world the dp-4 ones.
The model's row counts do not divide by 4 (10, 5 and 18 rows), so some ranks hold fewer rows and one
holds none. With TP (torchtitan's order: ``parallelize_module`` over ``mesh["tp"]``, then
``fully_shard`` over ``mesh["dp"]``) the world is one 2 × 2 ("dp", "tp") mesh and trains as one
process too (Muon, Shampoo, matrices shared by pairs; sizes TP splits unevenly)."""

from __future__ import annotations

import functools
import random
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dp_helpers as H

pytestmark = pytest.mark.slow

WORLD = 4
VOCAB, DIM, SEQ, BATCH = 18, 8, 6, 8
STEPS = 10
CLIP = 0.2  # below the gradients' norm at every step: clipping is active
LR = {k: H.MATRIX_LR[k] for k in ("muon", "normuon", "shampoo")}


class Block(nn.Module):
    """A residual MLP pair: matrices of 10, 8, 5 and 8 rows, a norm and a bias (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 10, bias=False)
        self.fc2 = nn.Linear(10, DIM, bias=False)
        self.gate = nn.Linear(DIM, 5, bias=False)
        self.up = nn.Linear(5, DIM, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return x + self.up(torch.tanh(self.gate(x)))


class Model(nn.Module):
    """Embedding (18 rows), two blocks, a norm and the output head (AdamW)."""

    def __init__(self, seed: int = 0, *, wide: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        if wide:  # another model (the fingerprint differs)
            self.blocks[1].fc1 = nn.Linear(DIM, 12, bias=False)
            self.blocks[1].fc2 = nn.Linear(12, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def rows(d: int, dp: int) -> slice:
    n = BATCH // dp
    return slice(d * n, (d + 1) * n)


# --- the spawned side -----------------------------------------------------------------------------

_MESHES: dict[int, object] = {}


def dp_mesh(dp: int):
    """The DP mesh of this rank at ``dp`` (made once per process, in the cases' order on every
    rank): the world at dp 4, this rank's "rep" half of the (2, 2) mesh at dp 2."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp not in _MESHES:
        if dp == WORLD:
            _MESHES[dp] = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        else:
            _MESHES[dp] = init_device_mesh("cpu", (WORLD // dp, dp),
                                           mesh_dim_names=("rep", "dp"))["dp"]
    return _MESHES[dp]


def shard(model: nn.Module, mesh, *, raf: bool = True, rab: bool = True, mp=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    kw = {} if mp is None else {"mp_policy": mp}
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=raf, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, **kw)
    if not rab:
        model.set_reshard_after_backward(False)
    return model


def planned(model: nn.Module, dp: int, optimizer: str = "muon"):
    """The planner's FSDP2 plan of the (unsharded) model, rows travelling in fp32."""
    import canzona

    return canzona.plan_model(model, dp=dp, storage="fsdp2", comm_dtype="fp32",
                              optimizer=optimizer, **H.plan_settings(optimizer))


def scrambled(plan, rounds: int = 3, seed: int = 0):
    """``plan`` with random owners and its matrices dealt at random into ``rounds`` rounds (the
    rounds' byte counts zero: the runtime reads tasks, owners and order only)."""
    from canzona.planner.plan import RoundPlan

    rng = random.Random(seed)
    dp = plan.inputs.dp
    tasks = tuple(t.model_copy(update={"owner": rng.randrange(dp)}) if t.optimizer == "matrix"
                  else t for t in plan.tasks)
    ids = [t.id for t in tasks if t.optimizer == "matrix"]
    rng.shuffle(ids)
    zero = (0,) * dp
    made = tuple(RoundPlan(index=k, tasks=tuple(ids[k::rounds]), gathered_bytes=zero,
                           sent_bytes=zero, received_bytes=zero, compute_s=(0.0,) * dp)
                 for k in range(rounds))
    return plan.model_copy(update={"tasks": tasks,
                                   "fsdp2": plan.fsdp2.model_copy(update={"rounds": made})})


def paired(plan, shares: dict[str, tuple[int, int]]):
    """``plan`` with each matrix named in ``shares`` computed by the pair given (its owner the
    first member, its blocks ``block_bounds`` of its shape, in the round it is in; the rounds'
    byte counts left as they are: the runtime reads tasks, owners, rounds and shares)."""
    from canzona.planner.fsdp2 import block_bounds
    from canzona.planner.plan import FSDP2SharedPlan

    ids = {t.param: t.id for t in plan.tasks}
    tasks = tuple(t.model_copy(update={"owner": shares[t.param][0]}) if t.param in shares
                  else t for t in plan.tasks)
    shared = tuple(FSDP2SharedPlan(id=ids[n], owners=pair, piece_s=0.0,
                                   blocks=block_bounds(tasks[ids[n]].shape, 2))
                   for n, pair in sorted(shares.items(), key=lambda kv: ids[kv[0]]))
    return plan.model_copy(update={"tasks": tasks, "fsdp2": plan.fsdp2.model_copy(
        update={"shared": shared})})


#: Shared at dp 4: a tall matrix whose rows straddle the blocks' boundary (fc1: 10 rows, 3/3/3/1
#: per rank, blocks [0, 5, 10]), a wide one (fc2), a wide one a rank holds no rows of (gate: 5
#: rows, 2/2/1/0) and a tall one (up), over both pairs.
SHARES4 = {"blocks.0.fc1.weight": (0, 1), "blocks.0.fc2.weight": (2, 3),
           "blocks.1.gate.weight": (2, 3), "blocks.1.up.weight": (0, 1),
           "blocks.1.fc1.weight": (2, 3)}
#: Shared on the 2 × 2 ("dp", "tp") mesh: a wide column-parallel matrix by mesh ranks 0 and 1
#: (one TP group), a tall row-parallel one and a wide one TP replicates by ranks 2 and 3.
SHARES_TP = {"blocks.0.fc1.weight": (0, 1), "blocks.1.fc2.weight": (2, 3),
             "blocks.1.gate.weight": (2, 3)}
#: Shared at dp 2, by the whole group: tall, wide, and wide with an odd row count.
SHARES2 = {"blocks.0.fc1.weight": (0, 1), "blocks.0.fc2.weight": (0, 1),
           "blocks.1.gate.weight": (0, 1)}


def accounted(plan, rank: int) -> list[int]:
    """Per round, the elements rank ``rank`` (d·tp + t of the mesh) sends to other ranks in its
    gather by the planner's accounting (``fsdp2.gather_bytes``: a shared task's rows to the
    member whose block they fall in, a wide one's columns; with TP each rank's rectangle, a
    replicated matrix only from the owner's TP rank), status elements left out."""
    from canzona.planner.fsdp2 import gather_bytes

    tasks = {t.id: t for t in plan.tasks}
    dims = dict(zip((t.id for t in plan.tasks), plan.fsdp2.split_dims))
    shared = {x.id: x for x in plan.fsdp2.shared}

    def dests(i: int) -> tuple:
        x = shared.get(i)
        if x is None:
            return ((tasks[i].owner, 0, max(tasks[i].shape)),)
        return tuple((o, x.blocks[j], x.blocks[j + 1]) for j, o in enumerate(x.owners))

    return [sum(gather_bytes(tuple(tasks[i].shape), split_dim=dims.get(i), dp=plan.inputs.dp,
                             tp=plan.inputs.tp, elem_bytes=1, dests=dests(i))[0][rank]
                for i in r.tasks) for r in plan.fsdp2.rounds]


def build(model: nn.Module, plan, optimizer: str, **kw):
    import canzona

    kw.setdefault("matrix_options", H.SHAMPOO_OPTIONS if optimizer == "shampoo" else None)
    kw.setdefault("ns_dtype", torch.float32)
    return canzona.CanzonaOptimizer(
        model, plan, lr=LR[optimizer], adamw_lr=H.ADAMW_LR, adamw_weight_decay=0.01,
        collective_timeout=30, **kw)


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (an all-gather per DTensor, the same order on every rank)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}



def _train_steps(model, opt, d: int, dp: int, traces: list | None = None) -> list[float]:
    """STEPS steps of DP index ``d``'s rows of every batch, clipped, under the schedule: the
    gradient norms (and, with ``traces``, each step's FSDP2 launch trace appended)."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        loss_fn(model, x[rows(d, dp)], y[rows(d, dp)]).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        if traces is not None:
            traces.append(list(opt._fsdp2_trace))
    return norms

def train(rank: int, world: int, *, dp: int, configs: tuple[dict, ...]) -> dict:
    """Train the model ``fully_shard``-ed over this rank's DP mesh; the "rep" half h of the
    world runs ``configs[h]`` (optimizer, raf, rab, scrambled)."""
    mesh = dp_mesh(dp)
    half, d = divmod(rank, dp)
    cfg = configs[half]
    optimizer = cfg["optimizer"]
    model = Model()
    if cfg.get("plan_sharded"):  # the sharded model read whole: the unsharded one's plan
        shard(model, mesh, raf=cfg["raf"], rab=cfg.get("rab", True))
        plan = planned(model, dp, optimizer)
        assert plan == planned(Model(), dp, optimizer)
    else:
        plan = planned(model, dp, optimizer)
        shard(model, mesh, raf=cfg["raf"], rab=cfg.get("rab", True))
    if cfg.get("scrambled"):
        plan = scrambled(plan)
    if cfg.get("shares"):
        plan = paired(plan, cfg["shares"])
    if cfg.get("peer"):  # as under eager NCCL: the pair exchanges point to point on DP
        import canzona.runtime.fsdp2 as R

        eager, R._eager_communicators = R._eager_communicators, lambda: True
    opt = build(model, plan, optimizer, ns_dtype=cfg.get("ns_dtype", torch.float32))
    if cfg.get("peer"):
        R._eager_communicators = eager
    if cfg.get("fp32_wire"):  # fp32 rows whatever the kernel
        opt._storage.wire_for = lambda kernel: torch.float32
    traces: list = []
    norms = _train_steps(model, opt, d, dp, traces)
    named = dict(model.named_parameters())
    out = {"config": cfg, "params": full(model), "norms": norms, "trace": traces[-1],
           "rounds": len(plan.fsdp2.rounds), "kind": type(opt).__name__,
           "state_bytes": opt.state_bytes(), "predicted": opt.predicted_state_bytes(),
           "local_rows": {n: p.to_local().shape[0] for n, p in named.items()},
           "wire": opt._storage.wire, "comm_bytes": opt.comm_bytes(),
           "sent": [sum(n for o, n in enumerate(r.send) if o != d) for r in opt._storage.rounds],
           "pair": type(opt._pair_group).__name__, "accounted": accounted(plan, d),
           "state": {n: {k: (type(v).__name__, tuple(v.shape), tuple(v.to_local().shape)
                             if hasattr(v, "to_local") else None)
                         for k, v in opt.state[p].items()} for n, p in named.items()}}
    opt.close()
    return out


# --- FSDP2 with TP: the world as a 2 × 2 ("dp", "tp") mesh ----------------------------------------

TP = 2


class TPBlock(Block):
    """:class:`Block` with a hidden size of 7, which TP splits unevenly (4 and 3): fc1 (7 × 8)
    and gate (5 × 8) column-parallel, fc2 (8 × 7) and up (8 × 5, its bias replicated over TP)
    row-parallel, or left whole (matrices replicated over TP; :func:`tp_sharded`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 7, bias=False)
        self.fc2 = nn.Linear(7, DIM, bias=False)


class TPModel(Model):
    """:class:`Model` with :class:`TPBlock`\\ s; the embedding, norms and head stay whole."""

    def __init__(self, seed: int = 0) -> None:
        nn.Module.__init__(self)
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)


_TP_MESH: list = []


def tp_mesh():
    """The world as a ("dp", "tp") mesh of 2 × 2 (made once per process)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _TP_MESH:
        _TP_MESH.append(init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp", "tp")))
    return _TP_MESH[0]


def tp_sharded(model: nn.Module, mesh) -> nn.Module:
    """torchtitan's order: TP over mesh["tp"] (block 0's fc1/fc2 and gate/up, block 1's
    fc1/fc2; the colwise outputs kept as DTensors, as uneven sizes need), then fully_shard over
    mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    layout = {}
    for name in ("blocks.0.fc1", "blocks.0.gate", "blocks.1.fc1"):
        layout[name] = ColwiseParallel(use_local_output=False)
    for name in ("blocks.0.fc2", "blocks.0.up", "blocks.1.fc2"):
        layout[name] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], layout)
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def train_tp(rank: int, world: int, *, optimizer: str, shares: dict | None = None) -> dict:
    """Train :class:`TPModel` with TP over the "tp" dim and FSDP2 over the "dp" dim of the 2 × 2
    world mesh, planned by ``canzona.plan_model(model, dp=2, tp=2)`` (the planner's owners, or
    a pair's shares)."""
    import canzona

    mesh = tp_mesh()
    d = rank // TP
    dp = WORLD // TP
    model = tp_sharded(TPModel(), mesh)
    plan = canzona.plan_model(model, dp=dp, tp=TP, storage="fsdp2", comm_dtype="fp32",
                              optimizer=optimizer, **H.plan_settings(optimizer))
    if shares:
        plan = paired(plan, shares)
    opt = build(model, plan, optimizer)
    norms = _train_steps(model, opt, d, dp)
    named = dict(model.named_parameters())
    out = {"params": full(model), "norms": norms, "inputs": (plan.inputs.dp, plan.inputs.tp),
           "owners": sorted({t.owner for t in plan.tasks if t.optimizer == "matrix"}),
           "split_dims": {t.param: s for t, s in zip(plan.tasks, plan.fsdp2.split_dims)},
           "placements": {n: repr(tuple(p.placements)) for n, p in named.items()},
           "state_bytes": opt.state_bytes(), "predicted": opt.predicted_state_bytes(),
           "sent": [sum(n for o, n in enumerate(r.send) if o != rank)
                    for r in opt._storage.rounds], "accounted": accounted(plan, rank),
           "shared": len(plan.fsdp2.shared)}
    opt.close()
    return out


def tp_refusals(rank: int, world: int) -> dict[str, str]:
    """A TP model with a tp = 1 plan, a tp = 2 plan on a model without TP: one line each."""
    import canzona

    out = {}
    model = tp_sharded(TPModel(), tp_mesh())
    out["tp=1 plan"] = _message(lambda: build(model, planned(TPModel(), 2), "muon"))
    tp_plan = canzona.plan_model(model, dp=2, tp=TP, storage="fsdp2", comm_dtype="fp32")
    out["1-D mesh"] = _message(lambda: build(shard(TPModel(), dp_mesh(WORLD)), tp_plan, "muon"))
    return out


def _message(fn) -> str:
    """What ``fn()`` raises, as ``Type: message`` (or "accepted")."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def refusals(rank: int, world: int) -> dict[str, str]:
    """Bad input, each refused in one line (before any collective but the fingerprint's)."""
    import canzona
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = dp_mesh(WORLD)
    plan = planned(Model(), WORLD)
    out = {}
    out["not sharded"] = _message(lambda: build(Model(), plan, "muon"))
    out["named parameters"] = _message(
        lambda: build(list(shard(Model(), mesh).named_parameters()), plan, "muon"))
    zero1 = canzona.plan_model(Model(), dp=WORLD, bucket_size=3000)
    out["zero1 plan"] = _message(lambda: build(shard(Model(), mesh), zero1, "muon"))
    out["mesh size"] = _message(lambda: build(shard(Model(), mesh), planned(Model(), 2), "muon"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    out["mixed precision"] = _message(lambda: build(shard(Model(), mesh, mp=mp), plan, "muon"))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    out["reduce dtype"] = _message(lambda: build(shard(Model(), mesh, mp=mp), plan, "muon"))
    out["fingerprint"] = _message(lambda: build(shard(Model(wide=True), mesh), plan, "muon"))
    for key, value in (("tp_group", object()), ("main_params", "fp32"), ("collective", "padded"),
                       ("overlap_param_gather", True), ("grad_sync", "external"),
                       ("pp_group", object()), ("sync_init", True)):
        out[key] = _message(lambda: build(shard(Model(), mesh), plan, "muon", **{key: value}))
    out["unknown"] = _message(lambda: build(shard(Model(), mesh), plan, "muon", bogus=1))
    shampoo = paired(planned(Model(), WORLD, "shampoo"), {"blocks.0.fc1.weight": (0, 1)})
    out["shared by shampoo"] = _message(lambda: build(shard(Model(), mesh), shampoo, "shampoo"))
    out["pair"] = _message(lambda: build(shard(Model(), mesh), paired(
        plan, {"blocks.0.fc1.weight": (1, 2)}), "muon"))
    out["2-D mesh"] = _message(lambda: build(shard(Model(), mesh), plan, "muon",
                                             device_mesh=_MESHES.get(0) or _two_d()))
    # accepted: the mesh given, the default keyword values given
    ok = build(shard(Model(), mesh), plan, "muon", device_mesh=mesh, tp_group=None,
               overlap_tp=True, tp_sum_grads=[])
    out["add_param_group"] = _message(lambda: ok.add_param_group({"params": []}))
    out["no_sync"] = _message(lambda: ok.no_sync())
    ok.close()
    out["closed step"] = _message(ok.step)
    return out


def _two_d():
    from torch.distributed.device_mesh import init_device_mesh

    _MESHES[0] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return _MESHES[0]


def surface(rank: int, world: int) -> dict:
    """The optimizer's surface at dp 4: groups read at each step, state dict round trip,
    torch's get_state_dict without a step, non-finite gradients raised and skipped alike,
    the context manager."""
    import canzona
    from canzona.runtime.errors import NonFiniteSkipWarning
    from canzona.runtime.optim import NonFiniteGradientError
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = dp_mesh(WORLD)
    out: dict = {"rank": rank}
    model = shard(Model(), mesh)
    plan = scrambled(planned(Model(), WORLD), rounds=2, seed=1)
    opt = build(model, plan, "muon")
    out["isinstance"] = isinstance(opt, canzona.CanzonaOptimizer)
    out["groups"] = sorted(g["name"] for g in opt.param_groups)
    x, y = batch(0)
    for step in range(2):
        loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    steps = []
    opt.step = lambda *a, **k: steps.append(1)  # get_state_dict must not step
    try:
        get_state_dict(model, opt)
        out["get_state_dict"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported
        out["get_state_dict"] = f"{type(exc).__name__}: {exc}"
    del opt.step
    out["get_state_dict steps"] = len(steps)
    # the groups are read at every step: lr = 0 in both, and a step changes no parameter
    kept = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    before = full(model)
    loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
    opt.step()
    opt.zero_grad()
    out["lr0 unchanged"] = all(torch.equal(a, b) for a, b in zip(before.values(),
                                                                  full(model).values()))
    for g, (lr, wd) in zip(opt.param_groups, kept):
        g["lr"], g["weight_decay"] = lr, wd
    with build(shard(Model(), mesh), plan, "muon") as other:
        other.load_state_dict(sd)
        mine = {k: v for k, v in other.state_dict()["state"].items()}
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        out["state loaded"] = all(
            torch.equal(local(a[key]), local(b[key])) for k, a in sd["state"].items()
            for b in [mine[k]] for key in a)
    out["closed by with"] = other._closed
    # a NaN in rank 1's rows of one matrix: every rank raises, nothing moves
    name = "blocks.0.fc1.weight"
    before = full(model)
    loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
    param = dict(model.named_parameters())[name]
    if rank == 1:
        param.grad.to_local()[0, 0] = float("nan")
    out["raise"] = _message(opt.step)
    out["raise type"] = out["raise"].split(":")[0]
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before.values(),
                                                             full(model).values()))
    opt.close()
    # nonfinite="skip": that matrix stays, the others move, every rank warns
    model = shard(Model(), mesh)
    opt = build(model, plan, "muon", matrix_options={"nonfinite": "skip"})
    before = full(model)
    loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
    if rank == 1:
        dict(model.named_parameters())[name].grad.to_local()[0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    after = full(model)
    out["skip warned"] = any(issubclass(w.category, NonFiniteSkipWarning) for w in caught)
    out["skipped kept"] = torch.equal(before[name], after[name])
    out["others moved"] = all(not torch.equal(before[n], after[n]) for n in before if n != name)
    opt.close()
    out["nonfinite error"] = NonFiniteGradientError.__name__
    # a kernel that raises on its owner: after every round that rank raises it and the others
    # name it; the ranks stay in step (the next step trains)
    model = shard(Model(), mesh)
    opt = build(model, plan, "muon", dp_group=mesh.get_group())
    owner = next(t.owner for t in plan.tasks if t.optimizer == "matrix")

    def broken(*args, **kwargs):
        raise ValueError("broken kernel")

    if rank == owner:  # Muon's owners orthogonalise (their momentum is on the rows)
        opt._matrix.orthogonalise = broken
    loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
    out["owner"] = owner
    out["kernel failure"] = _message(opt.step)
    opt._matrix.__dict__.pop("orthogonalise", None)
    opt.zero_grad()
    loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
    out["next step"] = _message(opt.step)
    opt.zero_grad()
    # the momentum step raising on a rank that sends rows: the owners hear of it in the gather
    if rank == 2:
        opt._matrix.momentum_inputs = broken
    loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
    out["rows failure"] = _message(opt.step)
    opt._matrix.__dict__.pop("momentum_inputs", None)
    opt.zero_grad()
    loss_fn(model, x[rows(rank, WORLD)], y[rows(rank, WORLD)]).backward()
    out["step after rows failure"] = _message(opt.step)
    opt.close()
    return out


CASES = [
    # dp 2 on both halves at once: Muon on one, Shampoo on the other, then the other way round
    ("dp2-a", functools.partial(train, dp=2, configs=(
        {"optimizer": "muon", "raf": True},
        {"optimizer": "shampoo", "raf": False, "scrambled": True}))),
    ("dp2-b", functools.partial(train, dp=2, configs=(
        {"optimizer": "shampoo", "raf": True},
        {"optimizer": "muon", "raf": False, "rab": False, "scrambled": True}))),
    ("dp4-muon", functools.partial(train, dp=4, configs=(
        {"optimizer": "muon", "raf": False, "rab": False, "scrambled": True},))),
    ("dp4-shampoo", functools.partial(train, dp=4, configs=(
        {"optimizer": "shampoo", "raf": True, "plan_sharded": True},))),
    # bfloat16 Newton–Schulz: the rows travel in bf16 on one half, in the plan's fp32 on the other
    ("dp2-bf16", functools.partial(train, dp=2, configs=(
        {"optimizer": "muon", "raf": True, "scrambled": True, "ns_dtype": torch.bfloat16},
        {"optimizer": "muon", "raf": True, "scrambled": True, "ns_dtype": torch.bfloat16,
         "fp32_wire": True}))),
    # matrices shared by pairs: Muon at dp 4 over both pairs (3 rounds, random owners), at dp 2
    # by the whole group (a process group on one half, point to point on the other)
    ("dp4-pairs", functools.partial(train, dp=4, configs=(
        {"optimizer": "muon", "raf": True, "scrambled": True, "shares": SHARES4},))),
    ("dp2-pairs", functools.partial(train, dp=2, configs=(
        {"optimizer": "muon", "raf": True, "shares": SHARES2},
        {"optimizer": "normuon", "raf": True, "shares": SHARES2, "peer": True}))),
    # FSDP2 with TP over the world as a 2 × 2 ("dp", "tp") mesh
    ("tp-muon", functools.partial(train_tp, optimizer="muon")),
    ("tp-shampoo", functools.partial(train_tp, optimizer="shampoo")),
    ("tp-pairs", functools.partial(train_tp, optimizer="muon", shares=SHARES_TP)),
    ("tp-refusals", tp_refusals),
    ("refusals", refusals),
    ("surface", surface),
]


@pytest.fixture(scope="module")
def world(fsdp2_world4):
    """The cases' results: this module's and the checkpoint module's run in one spawn
    (``conftest.fsdp2_world4``)."""
    return fsdp2_world4


# --- the reference --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def reference(optimizer: str, dp: int, ns_dtype: torch.dtype = torch.float32,
              tp: bool = False) -> dict:
    """One process, the unsharded model: the batch's gradient as the mean of the DP ranks'
    (each rank's loss / dp), torch's clipping, the matrix kernel per matrix, torch's AdamW."""
    import dataclasses

    from canzona.runtime.introspect import inventory

    torch.set_num_threads(1)
    model = TPModel() if tp else Model()
    route = {p.name: p.optimizer for p in inventory(model).params}
    named = list(model.named_parameters())
    mats = [p for n, p in named if route[n] == "matrix"]
    others = [p for n, p in named if route[n] != "matrix"]
    kernel = H.matrix_kernel(optimizer, LR[optimizer])
    if ns_dtype != torch.float32:
        kernel = type(kernel)(dataclasses.replace(kernel.config, ns_dtype=ns_dtype))
    states = [kernel.init_state(p.shape) for p in mats]
    adamw = torch.optim.AdamW(others, lr=H.ADAMW_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, H.lr_factor)
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        for d in range(dp):
            (loss_fn(model, x[rows(d, dp)], y[rows(d, dp)]) / dp).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        lr = LR[optimizer] * H.lr_factor(step)
        with torch.no_grad():
            for p, s in zip(mats, states):
                kernel.step([p], [p.grad], [s], lr=lr)
        adamw.step()
        sched.step()
        model.zero_grad()
    return {"params": H.params_of(model), "norms": norms}


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["dp2-a", "dp2-b", "dp4-muon", "dp4-shampoo"])
def test_fsdp2_trains_as_one_process(world, case):
    """Clipping active, 10 steps: every parameter within 1e-5 (relative) of one process on
    every rank, the norms too; every parameter moved."""
    dp = 2 if case.startswith("dp2") else 4
    ranks = H.results(world, case)
    start = H.params_of(Model())
    for r, got in enumerate(ranks):
        assert got["kind"] == "FSDP2Optimizer"
        ref = reference(got["config"]["optimizer"], dp)
        err = H.max_rel_err(got["params"], ref["params"])
        assert H.is_close_rel(err), f"{case}, rank {r} ({got['config']}): {err:.2e}"
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert min(got["norms"]) > CLIP  # clipping acted at every step
        assert all(not torch.equal(start[n], p) for n, p in got["params"].items())
        assert got["state_bytes"] == got["predicted"]


def test_muon_momentum_lives_on_the_rows_and_shampoo_state_on_owners(world):
    """Muon's momentum and AdamW's moments are DTensors placed as their parameter, this rank's
    rows (none on some ranks); Shampoo's state is whole on the matrix's owner, empty
    elsewhere."""
    for got in H.results(world, "dp4-muon"):
        for name, rows in got["local_rows"].items():
            for key, (kind, shape, local) in got["state"][name].items():
                if key == "step":
                    continue
                assert kind == "DTensor" and local[0] == rows, (name, key, kind, local)
        assert got["state"]["blocks.0.gate.weight"]["momentum_buffer"][1] == (5, 8)
    owned = {}
    for r, got in enumerate(H.results(world, "dp4-shampoo")):
        for name in ("blocks.0.fc1.weight", "blocks.1.fc2.weight"):
            if got["state"][name]:
                owned.setdefault(name, []).append(r)
                assert all(kind == "Tensor" for kind, _, _ in got["state"][name].values())
    assert all(len(ranks) == 1 for ranks in owned.values()) and len(owned) == 2


def test_bf16_newton_schulz_rows_travel_in_bf16_with_the_same_result(world):
    """Under bfloat16 Newton–Schulz Muon's rows travel in bf16 (half the bytes) and the
    parameters are bitwise those of the run whose rows travel in the plan's fp32 (the owner
    casts its input to bf16 first either way). Against one process with bf16 Newton–Schulz,
    which orthogonalises the matrices one by one where the owners batch alike shapes, bf16
    round-off may differ by an ulp (2⁻⁸ of an update element, scaled by the learning rate):
    they agree within 1e-3 relative (measured: ~2e-7)."""
    ranks = H.results(world, "dp2-bf16")
    bf16, fp32 = ranks[:2], ranks[2:]
    ref = reference("muon", 2, torch.bfloat16)
    for a, b in zip(bf16, fp32):
        assert a["wire"] == torch.bfloat16 and b["wire"] == torch.float32
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert 2 * a["comm_bytes"]["gather"] == b["comm_bytes"]["gather"]
        err = H.max_rel_err(a["params"], ref["params"])
        assert err < 1e-3, err


@pytest.mark.parametrize("case", ["dp4-pairs", "dp2-pairs"])
def test_matrices_shared_by_pairs_train_as_one_process(world, case):
    """Matrices a pair computes together (``plan.fsdp2.shared``: tall and wide, rows that
    straddle the blocks' boundary, a rank without rows; Muon at dp 4 over both pairs and 3
    rounds, at dp 2 Muon and NorMuon by the whole group, over a process group or point to
    point): every parameter within 1e-5 (relative) of one process, the norms too; each rank's
    gather sends what the planner's ``gather_bytes`` accounts (its rows to the member whose
    block they fall in); NorMuon's members keep their block's state."""
    dp = 4 if case.startswith("dp4") else 2
    for r, got in enumerate(H.results(world, case)):
        ref = reference(got["config"]["optimizer"], dp)
        err = H.max_rel_err(got["params"], ref["params"])
        assert H.is_close_rel(err), f"{case}, rank {r} ({got['config']}): {err:.2e}"
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert got["state_bytes"] == got["predicted"]
        assert got["sent"] == got["accounted"], (r, got["sent"], got["accounted"])
        assert got["pair"] == ("PeerPair" if got["config"].get("peer") else "ProcessGroup")
        if got["config"]["optimizer"] == "normuon":  # fc1 tall (10 × 8), fc2 wide (8 × 10)
            state = got["state"]
            assert state["blocks.0.fc1.weight"]["momentum_buffer"][1] == (5, 8)
            assert state["blocks.0.fc1.weight"]["second_momentum_buffer"][1] == (5, 1)
            assert state["blocks.0.fc2.weight"]["momentum_buffer"][1] == (8, 5)
            assert state["blocks.0.fc2.weight"]["second_momentum_buffer"][1] == (8, 1)


def test_uneven_rows_and_a_rank_without_rows(world):
    """At dp 4 the 10-row matrices hold 3/3/3/1 rows, the 5-row ones 2/2/1/0."""
    ranks = H.results(world, "dp4-shampoo")
    assert [r["local_rows"]["blocks.0.fc1.weight"] for r in ranks] == [3, 3, 3, 1]
    assert [r["local_rows"]["blocks.0.gate.weight"] for r in ranks] == [2, 2, 1, 0]


def test_the_next_rounds_gather_is_launched_before_this_round_is_computed(world):
    for case in ("dp4-muon", "dp2-b"):
        for r, got in enumerate(H.results(world, case)):
            trace, count = got["trace"], got["rounds"]
            if not got["config"].get("scrambled"):
                continue
            assert count == 3
            at = {e: i for i, e in enumerate(trace)}
            assert len(at) == len(trace) == 4 * count
            for k in range(count):
                assert at[("gather", k)] < at[("compute", k)] < at[("return", k)] \
                    < at[("apply", k)], (r, trace)
                if k + 1 < count:
                    assert at[("gather", k + 1)] < at[("compute", k)], (r, trace)
                    assert at[("return", k)] < at[("compute", k + 1)] < at[("apply", k)]


def test_bad_input_is_refused_in_one_line(world):
    for got in H.results(world, "refusals"):
        for key, msg in got.items():
            assert "\n" not in msg, (key, msg)
        assert got["not sharded"].startswith("PlanMismatchError") \
            and "not fully_shard-ed" in got["not sharded"]
        assert "nn.Module" in got["named parameters"]
        assert got["zero1 plan"].startswith("PlanMismatchError") \
            and "fully_shard-ed" in got["zero1 plan"] and "storage='fsdp2'" in got["zero1 plan"]
        assert "dp=2" in got["mesh size"] and "4 ranks" in got["mesh size"]
        assert "param_dtype=torch.bfloat16" in got["mixed precision"]
        assert "reduce_dtype=torch.bfloat16" in got["reduce dtype"]
        assert got["fingerprint"].startswith("PlanMismatchError") \
            and "blocks.1.fc1.weight" in got["fingerprint"] and "[12, 8]" in got["fingerprint"]
        for key in ("tp_group", "main_params", "collective", "overlap_param_gather",
                    "grad_sync", "pp_group", "sync_init"):
            assert got[key].startswith("ValueError") and f"{key}=" in got[key] \
                and "FSDP2 plan" in got[key], got[key]
        assert got["unknown"].startswith("TypeError") and "bogus" in got["unknown"]
        assert got["shared by shampoo"].startswith("PlanMismatchError") \
            and "blocks.0.fc1.weight" in got["shared by shampoo"] \
            and "not shared by its Gram" in got["shared by shampoo"]
        assert got["pair"].startswith("PlanMismatchError") and "[1, 2]" in got["pair"] \
            and "(2s, 2s + 1)" in got["pair"]
        assert "1-D DP mesh" in got["2-D mesh"] and "('dp', 'tp')" in got["2-D mesh"]
        assert got["add_param_group"].startswith("RuntimeError")
        assert "set_requires_gradient_sync" in got["no_sync"]
        assert "closed" in got["closed step"]


def test_the_optimizer_surface(world):
    for got in H.results(world, "surface"):
        assert got["isinstance"] and got["groups"] == ["adamw", "matrix"]
        assert got["get_state_dict steps"] == 0
        assert got["lr0 unchanged"]
        assert got["state loaded"] and got["closed by with"]
        assert got["raise type"] == got["nonfinite error"], got["raise"]
        assert "blocks.0.fc1.weight" in got["raise"] and got["unchanged"]
        assert got["skip warned"] and got["skipped kept"] and got["others moved"]
        if got["rank"] == got["owner"]:
            assert got["kernel failure"] == "ValueError: broken kernel"
        else:
            assert got["kernel failure"].startswith("RuntimeError") \
                and f"DP rank {got['owner']}" in got["kernel failure"], got["kernel failure"]
        assert got["next step"] == "accepted"
        if got["rank"] == 2:
            assert got["rows failure"] == "ValueError: broken kernel"
        else:
            assert got["rows failure"].startswith("RuntimeError") \
                and "making its rows" in got["rows failure"], got["rows failure"]
        assert got["step after rows failure"] == "accepted"


@pytest.mark.parametrize("case", ["tp-muon", "tp-shampoo", "tp-pairs"])
def test_fsdp2_with_tp_trains_as_one_process(world, case):
    """TP (uneven column- and row-parallel pairs, a bias and matrices TP replicates) then
    fully_shard on the 2 × 2 ("dp", "tp") world mesh, planned by ``plan_model(dp=2, tp=2)``
    (owners over all 4 ranks; for ``tp-pairs`` three matrices shared by pairs of mesh ranks),
    clipping active, 10 steps: every parameter of every rank (each TP copy of a replicated one)
    within 1e-5 (relative) of one process, the norms too; each rank's gather sends what the
    planner's ``gather_bytes`` accounts (a replicated matrix only from the owner's TP rank)."""
    start = H.params_of(TPModel())
    for r, got in enumerate(H.results(world, case)):
        ref = reference("shampoo" if case == "tp-shampoo" else "muon", 2, tp=True)
        err = H.max_rel_err(got["params"], ref["params"])
        assert H.is_close_rel(err), f"{case}, rank {r}: {err:.2e}"
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert min(got["norms"]) > CLIP
        assert all(not torch.equal(start[n], p) for n, p in got["params"].items())
        assert got["inputs"] == (2, TP) and got["owners"] == [0, 1, 2, 3]
        assert got["sent"] == got["accounted"], (r, got["sent"], got["accounted"])
        assert got["state_bytes"] == got["predicted"]
        assert got["shared"] == (3 if case == "tp-pairs" else 0)
        dims, where = got["split_dims"], got["placements"]
        assert (dims["blocks.0.fc1.weight"], dims["blocks.0.fc2.weight"]) == (0, 1)
        assert dims["blocks.1.gate.weight"] is None and dims["blocks.0.up.bias"] is None
        assert "_StridedShard" in where["blocks.0.fc1.weight"]
        assert where["blocks.0.up.bias"] == "(Shard(dim=0), Replicate())"
        assert where["blocks.1.gate.weight"] == "(Shard(dim=0),)"


def test_fsdp2_with_tp_refuses_another_tp_in_one_line(world):
    """A tp = 1 plan on the TP model, a tp = 2 plan on a model without TP (checkpoints of a TP
    run: ``test_fsdp2_checkpoint``)."""
    for got in H.results(world, "tp-refusals"):
        assert all("\n" not in m for m in got.values())
        assert got["tp=1 plan"].startswith("PlanMismatchError") \
            and "tp=1" in got["tp=1 plan"] and "2 TP ranks" in got["tp=1 plan"]
        assert got["1-D mesh"].startswith("PlanMismatchError") \
            and "tp=2" in got["1-D mesh"] and "1-D mesh" in got["1-D mesh"]


def test_a_fully_sharded_model_is_read_whole_by_introspection(world):
    """The planner's plan of the sharded model is the unsharded model's (fully_shard's rows
    read as the whole parameters; the case asserts it on every rank), and it ran."""
    for got in H.results(world, "dp4-shampoo"):
        assert got["config"]["plan_sharded"] and got["kind"] == "FSDP2Optimizer"
