"""Every check the runtime makes before it acts, each failing in one line.

* the plan's shape against this runtime and the process group (tp, ep, dp, arguments);
* the plan's fingerprint against the live parameters, and every rank's plan against the others
  (one small all-gather, so that all ranks fail together);
* the settings the plan records against the constructor's arguments (the param groups a
  scheduler changes are checked in ``groups``);
* the work order: the ranks together update every element of every parameter exactly once.

Local checks that can differ between ranks run inside :func:`agree`'s collective; every other
check depends only on values all ranks share, so all ranks raise it alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from canzona.planner.heads import is_head
from canzona.planner.inventory import EXPERT_PART, ModelSpec
from canzona.planner.layout import padded_vocab
from canzona.planner.plan import Plan
from canzona.runtime.checkpoint.names import expert_index
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.experts import plan_experts
from canzona.runtime.introspect import dtype_name, fsdp2_modules, inventory
from canzona.runtime.megatron import find_gpt
from canzona.runtime.optim import registry
from canzona.runtime.schedule import Schedule

#: Values of the constructor's ``main_params``.
MAIN_PARAMS = (None, "fp32")
GRAD_SYNC = ("reduce_scatter", "external")
# torch ≥ 2.10 renamed the tensor collectives (the old names warn).
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


# --- arguments and sizes -------------------------------------------------------------------------


def checked_timeout(collective_timeout: Any) -> float | None:
    """``collective_timeout`` as seconds (a number > 0), or None."""
    if collective_timeout is not None and (isinstance(collective_timeout, bool) or not (
            isinstance(collective_timeout, (int, float)) and collective_timeout > 0)):
        raise ValueError(f"collective_timeout must be a number of seconds > 0 (or None), "
                         f"got {collective_timeout!r}")
    return None if collective_timeout is None else float(collective_timeout)


def check_overlap_target(model: Any, overlap_param_gather: bool) -> None:
    if overlap_param_gather and not isinstance(model, nn.Module):
        raise ValueError("overlap_param_gather=True needs the nn.Module (its forward pre-hook "
                         "waits for the parameters)")


def check_not_ddp(model: Any, grad_sync: str) -> None:
    """A ``DistributedDataParallel`` model already averages its gradients: canzona reducing them
    again would be wrong, so it takes them as they are or not at all."""
    if grad_sync != "external" and isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("the model is wrapped in DistributedDataParallel, which already averages "
                         "the gradients: pass grad_sync='external' to use DDP's averaged .grad, "
                         "or give canzona the unwrapped model (model.module) and drop DDP, as "
                         "canzona reduces the gradients itself")


def check_not_fully_sharded(model: Any, pairs: list[tuple[str, Tensor]]) -> None:
    """A ZeRO-1 plan (canzona's own buckets over DP) for a model whose parameters are already
    sharded over DP: a ``fully_shard``-ed (FSDP2) module, or a DTensor sharded on a named mesh
    dim other than ``tp``. One line, before any collective."""
    sharded = fsdp2_modules(model)
    if sharded:
        where = f"module '{sharded[0][0]}'" if sharded[0][0] else "the root module"
        raise PlanMismatchError(
            f"the model is fully_shard-ed (FSDP2: {where}) but the plan is a ZeRO-1 plan; plan "
            "it for FSDP2's storage (canzona.plan_model(model, dp=..., storage='fsdp2')) or "
            "give canzona the model without fully_shard.")
    for name, p in pairs:
        mesh = getattr(p, "device_mesh", None)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        for k, pl in enumerate(getattr(p, "placements", ()) if names else ()):
            if pl.is_shard() and k < len(names) and names[k] != "tp":
                raise PlanMismatchError(
                    f"parameter '{name}' is a DTensor sharded {pl!r} on mesh dim "
                    f"'{names[k]}', not 'tp': sharded over data parallelism, as fully_shard "
                    "shards, which a ZeRO-1 plan does not execute; plan a fully_shard-ed model "
                    "with storage='fsdp2'.")


def check_main_params(main_params: Any) -> None:
    if main_params not in MAIN_PARAMS:
        raise ValueError(f"main_params = {main_params!r} is not allowed; choose None (update the "
                         "parameters in their own dtype) or 'fp32' (fp32 main copies of the owned "
                         "parts of bf16/fp16 parameters)")


def check_plan_sizes(plan: Any, *, grad_sync: str, tp_group: Any) -> None:
    """The plan is a Plan this runtime executes (ep > 1 with expert buffers and no expert matrix
    shared by DP indices; tp > 1 with its TP schedule and a TP group of that size);
    ``grad_sync`` is known."""
    if not isinstance(plan, Plan):
        raise TypeError("plan must be a canzona Plan (canzona.load_plan), got "
                        f"{type(plan).__name__}")
    if grad_sync not in GRAD_SYNC:
        raise ValueError(f"grad_sync = {grad_sync!r} is not allowed; choose 'reduce_scatter' or "
                         "'external'")
    if plan.inputs.ep != 1:
        if not any(b.expert for b in plan.buffers):
            raise PlanMismatchError(
                f"the plan is for ep={plan.inputs.ep} but has no expert buffers; expert "
                "parallelism needs a mixture-of-experts model's plan (plan a dense model at "
                "ep=1).")
        in_experts = {sl.name for b in plan.buffers if b.expert for k in b.buckets
                      for sl in k.slots}
        expert_pairs = [plan.tasks[x.id].param for x in plan.dp_shared
                        if plan.tasks[x.id].param in in_experts]
        if expert_pairs:
            raise PlanMismatchError(
                f"the plan shares expert matrix '{expert_pairs[0]}' between two DP indices; the "
                "runtime executes expert matrices whole on their expert-DP rank: plan with "
                "share='off' or 'auto'.")
    tp = plan.inputs.tp
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp == 1:
        if size != 1:
            raise PlanMismatchError(f"tp_group has {size} ranks but the plan is for tp=1.")
        return
    if tp_group is None:
        raise PlanMismatchError(f"the plan is for tp={tp}: pass tp_group= (the TP group of this "
                                "rank's DP index) and dp_group= (this TP rank's DP group).")
    if size != tp:
        raise PlanMismatchError(f"the plan is for tp={tp} but tp_group has {size} ranks.")
    if plan.tp is None:
        raise PlanMismatchError(f"the plan is for tp={tp} but has no TP schedule (a DP-only "
                                "plan); make it with 'canzona plan' or canzona.plan_model.")


def local_layout_problem(plan: Plan, pairs: list[tuple[str, Tensor]],
                         held: set[str] | None = None) -> str | None:
    """Under TP (the live parameters are local shards): None if names, order, dtypes and local
    sizes match the plan's buckets and every TP-split matrix has its layout's local shape, else
    one line naming the first parameter that differs (``held``: the parameters this rank holds,
    ``ExpertLayout.held``)."""
    slots = {s.name: (s.end - s.start, buf.dtype) for buf in plan.buffers for b in buf.buckets
             for s in b.slots}
    order = [n for n in dict.fromkeys(t.param for t in plan.tasks) if held is None or n in held]
    live = [n for n, _ in pairs]
    if live != order:
        k = next((k for k, (a, b) in enumerate(zip(order, live)) if a != b),
                 min(len(order), len(live)))
        a = order[k] if k < len(order) else "nothing"
        b = live[k] if k < len(live) else "nothing"
        return (f"the plan does not match the model: parameter #{k} is '{a}' in the plan but "
                f"'{b}' in the model.")
    shapes: dict[str, tuple[int, ...]] = {}
    shared: set[str] = set()
    if plan.tp is not None:
        for ix in plan.tp.indices:
            for g in ix.groups:
                for gt in g.tasks:
                    param = plan.tasks[gt.id].param
                    shapes[param] = tuple(plan.tp.layouts[gt.layout].local_shape)
            for x in ix.shared:
                shared.add(plan.tasks[x.id].param)
                shapes[plan.tasks[x.id].param] = tuple(plan.tp.layouts[x.layout].local_shape)
    # A matrix that TP replicates is whole on every rank, and its tasks' shapes are how the
    # runtime views its slice: they must be the live shape (not, say, its transpose).
    hosted = {t.param for t in plan.tasks if t.host is not None} | shared
    whole = {name: shape for name, shape, _ in plan_params(plan)}
    for t in plan.tasks:
        if t.optimizer == "matrix" and t.param not in hosted and t.param not in shapes:
            shapes[t.param] = whole[t.param]
            if is_head(t.part) and plan.inputs.optimizer.records_heads:
                rows, cols = whole[t.param]  # its heads: each in one TP rank's row shard
                shapes[t.param] = (rows // plan.inputs.tp, cols)
                hosted.add(t.param)  # named a TP shard below
    for name, p in pairs:
        numel, dtype = slots[name]
        got = dtype_name(p.dtype, name)
        if got != dtype:
            return (f"the plan does not match the model: parameter '{name}' is {dtype} in the "
                    f"plan but {got} in the model.")
        want = shapes.get(name)
        if (want is not None and tuple(p.shape) != want) or p.numel() != numel:
            what = list(want) if want is not None else f"{numel} elements"
            kind = "matrix" if name in whole and name not in hosted else "TP shard"
            return (f"the plan does not match the model: {kind} '{name}' should be {what} "
                    f"but is {list(p.shape)} on this rank.")
    return None


def check_split_parts(plan: Plan, pairs: list[tuple[str, Tensor]]) -> None:
    """At tp = 1 the runtime updates a split part as contiguous rows of its parameter. Megatron's
    fused QKV (``linear_qkv``, TP layout ``qkv``) holds its rows grouped per KV group
    ([q_g; k_g; v_g] per group), so its Q, K and V are not contiguous there: refuse rather than
    orthogonalise the wrong rows (tp > 1 gathers the parts by the plan's shard maps and is
    exact)."""
    if plan.inputs.tp != 1:
        return
    parts = {t.param for t in plan.tasks if t.part in ("q", "k", "v")}
    if not parts:
        return
    live = {p.name: p for p in inventory(pairs).params}
    for name in parts:
        p = live.get(name)
        if p is not None and p.tp_layout == "qkv":
            raise PlanMismatchError(
                f"the plan splits Q/K/V of '{name}' at tp = 1, but the model holds Megatron's "
                "fused QKV grouped per KV group, whose parts are not contiguous rows; plan "
                "without split_qkv at tp = 1 (or at tp >= 2, where the parts are gathered "
                "exactly).")


def mesh_groups(mesh: Any, dp_group: Any, tp_group: Any,
                expert_dp_group: Any = None) -> tuple[Any, Any, Any]:
    """(dp_group, tp_group, expert_dp_group) of a 2-D ``DeviceMesh``: dims ``dp`` and ``tp``, or
    for expert parallelism ``edp`` and ``ep`` in that order (Megatron's: the DP rank is
    edp_rank·ep + ep_rank; the DP group the whole mesh, the expert-DP group its ``edp`` dim)."""
    if dp_group is not None or tp_group is not None or expert_dp_group is not None:
        raise ValueError("pass either device_mesh= or dp_group=/tp_group=/expert_dp_group=, not "
                         "both")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if getattr(mesh, "ndim", None) == 2 and set(names) == {"dp", "tp"}:
        return mesh.get_group("dp"), mesh.get_group("tp"), None
    if getattr(mesh, "ndim", None) == 2 and names == ("edp", "ep"):
        whole = None if mesh.size() == dist.get_world_size() else mesh._flatten().get_group()
        experts = mesh.get_group("edp") if mesh.size(1) > 1 else None  # ep 1: no expert group
        return whole, None, experts
    raise ValueError(f"device_mesh must be a 2-D DeviceMesh with dims named 'dp' and 'tp' (or, "
                     f"for expert parallelism, 'edp' and 'ep' in that order), got "
                     f"{getattr(mesh, 'ndim', '?')}-D with names {names}")


def check_experts(plan: Plan, names: list[str], model: Any) -> None:
    """The experts the model holds against the plan's, without a collective: a Megatron-core
    model's expert-parallel size and number of experts (its ``TransformerConfig``), and for any
    model the number of experts it holds per rank (E / ep of the plan's)."""
    ep = plan.inputs.ep
    planned = plan_experts(plan)
    found = find_gpt(model)
    if found is not None:
        c = found[1].config
        built = int(getattr(c, "expert_model_parallel_size", 1) or 1)
        if built != ep:
            raise PlanMismatchError(
                f"the plan is for ep={ep} but the model is built with "
                f"TransformerConfig.expert_model_parallel_size={built}; plan it at ep={built} "
                "(canzona.plan_model reads it from the model).")
        experts = int(getattr(c, "num_moe_experts", None) or 0)
        if experts != len(planned):
            raise PlanMismatchError(
                f"the plan has {len(planned)} experts but the model's "
                f"TransformerConfig.num_moe_experts is {experts}; plan this model.")
    held = {expert_index(n) for n in names} - {None}
    if held and not planned:
        first = next(n for n in names if expert_index(n) is not None)
        raise PlanMismatchError(
            f"the plan has no experts (a dense model's) but the model holds expert weights "
            f"('{first}', …); plan this model.")
    if planned and held and len(held) * ep != len(planned):
        raise PlanMismatchError(
            f"the model holds {len(held)} experts on this rank but the plan, for "
            f"{len(planned)} experts at ep={ep}, gives each rank {len(planned) // ep}; plan the "
            f"model at the expert-parallel size it is built for (ep="
            f"{len(planned) // len(held) if len(planned) % len(held) == 0 else '?'}).")


def check_group_size(plan: Plan, dp: int) -> None:
    if dp != plan.inputs.dp:
        raise PlanMismatchError(f"the plan is for dp={plan.inputs.dp} but the data-parallel "
                                f"group has {dp} ranks.")


# --- the plan against the model and the other ranks ----------------------------------------------


def plan_params(plan: Plan) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, logical shape, dtype) per parameter, in registration (task) order."""
    dtype = {s.name: buf.dtype for buf in plan.buffers for b in buf.buckets for s in b.slots}
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for t in plan.tasks:
        shapes.setdefault(t.param, []).append(tuple(t.shape))
    out = []
    experts = {t.param for t in plan.tasks if t.part is not None
               and t.part.startswith(EXPERT_PART) and t.part[len(EXPERT_PART):].isdigit()}
    for name, parts in shapes.items():
        if name in experts:  # E stacked expert matrices: [E, m, n]
            shape = (len(parts), *parts[0])
        else:
            shape = parts[0] if len(parts) == 1 else (sum(p[0] for p in parts), *parts[0][1:])
        out.append((name, shape, dtype.get(name, "?")))
    return out


def fingerprint_problem(plan: Plan, pairs: list[tuple[str, Tensor]],
                        held: set[str] | None = None) -> str | None:
    """None if the plan's fingerprint matches the live parameters, else one line naming the first
    parameter that differs (name, shape or dtype). Under expert parallelism (``held``: the
    parameters this rank holds, ``ExpertLayout.held``) the rank's parameters are compared with
    the plan's, name by name: the fingerprint covers every EP rank's experts."""
    planned = plan_params(plan)
    if not pairs or not planned:  # a pipeline stage without parameters, and its plan
        if not pairs and not planned:
            return None
        held_by = "the model" if pairs else "the plan"
        first = (pairs[0][0] if pairs else planned[0][0])
        return (f"{held_by} has parameters ('{first}', …) and the other none: give each "
                "pipeline stage its own module and plan")
    spec = _unpadded_vocab(inventory(pairs), planned, plan.inputs.tp)
    live = [(p.name, tuple(p.shape), p.dtype) for p in spec.params]
    if held is not None:
        planned = [x for x in planned if x[0] in held]
        if planned == live:
            return None
    elif spec.fingerprint() == plan.fingerprint:
        # The fingerprint is one string; the runtime acts on the tasks (a matrix task's shape is
        # how its slice is viewed). A plan whose tasks contradict its own fingerprint was edited.
        if planned == live:
            return None
        return _contradiction(planned, live)
    diff = _first_difference(planned, live)
    if diff is not None:
        return _MISMATCH[diff[3]].format(*diff[:3])
    if len(planned) != len(live):
        return _count_problem(planned, live)
    return (f"the plan does not match the model: names, shapes and dtypes agree but the TP "
            f"attributes differ (fingerprint {plan.fingerprint[:19]}… vs "
            f"{spec.fingerprint()[:19]}…).")


def fsdp2_fingerprint_problem(plan: Any, spec: ModelSpec) -> str | None:
    """None if an FSDP2 plan's fingerprint and tasks match ``spec``, the live inventory (a
    ``fully_shard``-ed model read whole: global shapes), else one line naming the first
    parameter that differs (name or shape; the plan records dtypes in its fingerprint only)."""
    planned = list(dict.fromkeys((t.param, tuple(t.shape)) for t in plan.tasks))
    live = [(p.name, tuple(p.shape)) for p in spec.params]
    if spec.fingerprint() == plan.fingerprint and planned == live:
        return None
    for k, (a, b) in enumerate(zip(planned, live)):
        if a[0] != b[0]:
            return (f"the plan does not match the model: parameter #{k} is '{a[0]}' in the "
                    f"plan but '{b[0]}' in the model.")
        if a[1] != b[1]:
            return (f"the plan does not match the model: parameter '{a[0]}' has shape "
                    f"{list(a[1])} in the plan but {list(b[1])} in the model.")
    if len(planned) != len(live):
        return _count_problem(planned, live)
    return (f"the plan does not match the model: names and shapes agree but the dtypes or "
            f"layouts differ (fingerprint {plan.fingerprint[:19]}… vs "
            f"{spec.fingerprint()[:19]}…).")


def _count_problem(planned: list, live: list) -> str:
    """One line for a plan and a model of different parameter counts (lists of tuples whose
    first item is the name), naming the first parameter the shorter one lacks."""
    longer, other = (planned, "model") if len(planned) > len(live) else (live, "plan")
    first = longer[min(len(planned), len(live))][0]
    return (f"the plan does not match the model: {len(planned)} parameters in the plan, "
            f"{len(live)} in the model; the {other} lacks '{first}'.")


def _unpadded_vocab(spec: ModelSpec, planned: list[tuple[str, tuple[int, ...], str]],
                    tp: int) -> ModelSpec:
    """The live inventory with a Megatron vocabulary-parallel table (layout ``vocab``) taken at
    the plan's logical vocabulary when the model holds it padded as Megatron pads it (a
    multiple of 128·tp, even at tp = 1): the plan records the tokenizer's vocabulary and lays
    out the padded rows, the model holds them."""
    shapes = {name: shape for name, shape, _ in planned}
    params = []
    for p in spec.params:
        want = shapes.get(p.name)
        if (p.tp_layout == "vocab" and want is not None and len(want) == len(p.shape) >= 1
                and want != p.shape and want[1:] == p.shape[1:]
                and p.shape[0] == padded_vocab(want[0], tp)):
            p = dataclasses.replace(p, shape=tuple(want))
        params.append(p)
    return ModelSpec(config=spec.config, params=tuple(params), label=spec.label)


#: The first difference between the plan's parameters and the model's, by field ({0}: index,
#: {1}/{2}: the planned and live (name, shape, dtype)).
_MISMATCH = {
    "name": "the plan does not match the model: parameter #{0} is '{1[0]}' in the plan but "
            "'{2[0]}' in the model.",
    "shape": "the plan does not match the model: parameter '{1[0]}' has shape {1[1]} in the "
             "plan but {2[1]} in the model.",
    "dtype": "the plan does not match the model: parameter '{1[0]}' is {1[2]} in the plan but "
             "{2[2]} in the model.",
}
_CONTRADICTION = {
    "name": "the plan contradicts its own fingerprint: parameter #{0} is '{1[0]}' in the plan's "
            "tasks but '{2[0]}' in the model and the fingerprint; {fix}.",
    "shape": "the plan contradicts its own fingerprint: the tasks of '{1[0]}' give shape {1[1]} "
             "but the model and the fingerprint have {2[1]}; {fix}.",
    "dtype": "the plan contradicts its own fingerprint: '{1[0]}' is {1[2]} in the plan's buffers "
             "but {2[2]} in the model and the fingerprint; {fix}.",
}


def _first_difference(planned: list, live: list) -> tuple[int, tuple, tuple, str] | None:
    """(index, planned entry, live entry, "name" | "shape" | "dtype") of the first parameter
    that differs, or None (the lists may still differ in length)."""
    for k, (a, b) in enumerate(zip(planned, live)):
        for field, i in (("name", 0), ("shape", 1), ("dtype", 2)):
            if a[i] != b[i]:
                return k, (a[0], list(a[1]), a[2]), (b[0], list(b[1]), b[2]), field
    return None


def _contradiction(planned: list[tuple[str, tuple[int, ...], str]],
                   live: list[tuple[str, tuple[int, ...], str]]) -> str:
    """The line for a plan whose fingerprint matches the model but whose tasks or buffers do not
    (names, order, logical shapes or dtypes): the file was edited after planning."""
    fix = "the plan was edited after it was made; regenerate it with 'canzona plan' or plan_model"
    diff = _first_difference(planned, live)
    if diff is not None:
        return _CONTRADICTION[diff[3]].format(*diff[:3], fix=fix)
    return (f"the plan contradicts its own fingerprint: {len(planned)} parameters in its tasks, "
            f"{len(live)} in the model and the fingerprint; {fix}.")


def plan_digest(plan: Plan) -> bytes:
    """sha256 of the plan's JSON: what the ranks compare, and what a checkpoint records."""
    return hashlib.sha256(plan.model_dump_json().encode()).digest()


def agree(plan: Plan, problem: str | None, *, dp: int, group: Any, device: torch.device) -> None:
    """Every rank holds the same plan, and the plan fits the model on every rank.

    One all-gather of (plan digest, fingerprint ok) per rank, so that a rank whose model differs
    and its peers all raise, each naming what it can see.
    """
    message = _agreement(plan, problem, size=dp, group=group, device=device, label="DP")
    if message:
        raise PlanMismatchError(message)


def agree_grid(plan: Plan, problem: str | None, *, dp: int, dp_group: Any, tp: int,
               tp_group: Any, device: torch.device) -> None:
    """:func:`agree` over the dp × tp grid: the DP group, then the TP group, then one flag
    all-reduced over both, so that every rank of the grid raises when any rank found a problem
    (two hops reach every rank)."""
    messages = [_agreement(plan, problem, size=dp, group=dp_group, device=device, label="DP"),
                _agreement(plan, problem, size=tp, group=tp_group, device=device, label="TP")]
    flag = torch.tensor([1 if any(messages) else 0], dtype=torch.int64, device=device)
    for size, group in ((dp, dp_group), (tp, tp_group)):
        if size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    for message in messages:
        if message:
            raise PlanMismatchError(message)
    if int(flag.item()):
        raise PlanMismatchError("the plan does not match the model, or differs, on another rank "
                                "of the dp × tp grid (see that rank's error).")


def _agreement(plan: Plan, problem: str | None, *, size: int, group: Any, device: torch.device,
               label: str) -> str | None:
    """The line to raise after one all-gather of (plan digest, problem flag) over ``group``
    (None: all agree). Every rank of the group calls it, whatever its own ``problem``."""
    if size == 1:
        return problem
    mine = torch.tensor(list(plan_digest(plan)) + [0 if problem else 1], dtype=torch.int64,
                        device=device)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    _all_gather(everyone, mine, group=group)
    rows = everyone.view(size, -1).cpu().tolist()
    digests = [bytes(r[:-1]).hex()[:12] for r in rows]
    if len(set(digests)) > 1:
        listed = ", ".join(f"rank {r}: {d}" for r, d in enumerate(digests))
        return (f"the {label} ranks hold different plans (sha256 {listed}); load the same plan "
                "file on every rank.")
    if problem:
        return problem
    bad = [r for r, row in enumerate(rows) if row[-1] == 0]
    if bad:
        return (f"the plan does not match the model on {label} rank(s) {bad} (see their error "
                "for the first differing parameter).")
    return None


def check_work_order(schedule: Schedule, names: list[str]) -> None:
    """The work orders of all ranks update every element of every parameter exactly once, and
    each rank only inside its own slices (an invariant of a consistent plan)."""
    pieces: list[list[tuple[int, int]]] = [[] for _ in names]
    for order in schedule.work:
        for bi in range(len(schedule.buckets)):
            items = [(t.param, t.name, t.lo, t.hi, t.row0 * t.shape[1]) for t in order.matrix[bi]]
            items += [(a.param, a.name, a.lo, a.hi, a.offset) for a in order.adamw[bi]]
            if order.split:
                items += [(x.param, x.name, x.lo, x.hi, x.offset) for x in order.split[bi]]
            sizes = schedule.buckets[bi].sizes  # an expert bucket's group can be smaller
            size = sizes[order.rank] if order.rank < len(sizes) else 0
            for i, name, lo, hi, start in items:
                if not 0 <= lo <= hi <= size:
                    raise PlanMismatchError(f"the plan's work order puts '{name}' outside DP rank "
                                            f"{order.rank}'s slice of bucket {bi}; the plan is "
                                            "inconsistent.")
                pieces[i].append((start, start + hi - lo))
    for i, parts in enumerate(pieces):
        lo, hi = schedule.param_range[i]
        end = 0
        for a, z in sorted(parts):
            if a != end:
                how = "twice" if a < end else "not at all"
                raise PlanMismatchError(f"the plan's work order updates elements {min(a, end)}… of "
                                        f"'{names[i]}' {how}; the plan is inconsistent.")
            end = z
        if end != hi - lo or schedule.param_bucket[i] < 0:
            raise PlanMismatchError(f"the plan's work order leaves elements {end}… of "
                                    f"'{names[i]}' without an owner; the plan is inconsistent.")


# --- settings: the constructor's against the plan --------------------------


#: The ``canzona plan`` flag that records a kernel setting, for the fix of a mismatch.
PLAN_FLAGS = {"ns_steps": "canzona plan --ns-steps", "ns_coefficients": "canzona plan --ns"}


def build_matrix_kernel(plan: Plan, *, optimizer: str | None, explicit: dict[str, Any],
                        options: dict[str, Any], ns_dtype: torch.dtype) -> tuple[Any, Any, dict]:
    """The matrix kernel's spec (``canzona.runtime.optim.registry``), the kernel, and the config
    fields the plan records (they must not change). ``explicit``: the constructor's named
    settings (``lr``, ``weight_decay``, ``momentum``, ``ns_steps``; None = the default);
    ``options``: ``matrix_options``."""
    s = plan.inputs.optimizer
    if optimizer is not None and optimizer != s.name:
        raise PlanMismatchError(f"optimizer={optimizer!r} disagrees with the plan, which was "
                                f"made for {s.name!r}.")
    spec = registry.get(s.name)
    if spec is None:
        raise PlanMismatchError(f"the plan is for optimizer {s.name!r}, which has no runtime "
                                f"kernel (registered: {', '.join(registry.names())}).")
    recorded = spec.recorded(s)
    fields = {f.name for f in dataclasses.fields(spec.config) if f.init}
    given = dict(options)
    for key, value in explicit.items():
        if value is None:
            continue
        if key not in fields:
            hint = spec.hints.get(key)
            raise PlanMismatchError(f"{spec.kernel.name} has no {key} setting (the plan is for "
                                    f"{s.name!r}){'; ' + hint if hint else ''}.")
        given[key] = value
    cfg = {**recorded, **given}
    for key, value in given.items():
        if key in recorded and not spec.agrees(key, value, recorded[key], cfg):
            flag = PLAN_FLAGS.get(key)
            fix = f" (plan with {flag} to change it)" if flag else ""
            raise PlanMismatchError(f"{key}={value!r} disagrees with the plan, which was made "
                                    f"with {key}={recorded[key]!r}{fix}.")
    if "ns_dtype" in fields:
        cfg.setdefault("ns_dtype", ns_dtype)
    return spec, spec.build(spec.config(**cfg)), recorded
