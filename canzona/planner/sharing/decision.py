"""Which matrices a share mode shares (``TPOptions.share``): over their TP group
(:func:`share_decision`, what ``DPProblem.shared`` holds), over DP pairs at tp = 1
(:func:`pair_decision`; Shampoo's blocks: :func:`block_decision`), over TP pairs
(:func:`tp_pair_decision`); and the short kind of a parameter's name (:func:`kind_of`)."""

from __future__ import annotations

from ..cost import load_hardware
from ..hardware import HardwareProfile
from ..planning import DPProblem, PairShare
from .blocks import block_pieces, block_row, piece_loads, shard_block_decision
from .bound import sharing_bound
from .pieces import profile_rate, share_options
from .prices import price_pair, price_tp_pair


def share_decision(problem: DPProblem, hardware: str, mode: str = "auto"
                   ) -> dict[int, tuple[float, bool, float, float, float]]:
    """``TPOptions.share``: the tasks shared over their TP group (``auto``: those the bound of
    ``planner.sharing`` shares; ``all``/``all-split``: every eligible one): task id → (load per
    TP rank, polynomial split, compute seconds, collective seconds, of those the seconds beside
    its own Gram products), what ``DPProblem.shared`` holds; the load is max(compute,
    collectives) in cost units. Shampoo: the matrices whose
    shards are whole blocks, preconditioned shard by shard (``sharing.shard_block_decision``)."""
    if problem.settings.name == "shampoo":  # blocks preconditioned shard by shard, every mode
        return shard_block_decision(problem, hardware)
    hw = load_hardware(hardware)
    rate = profile_rate(hw)
    out = {}
    if mode in ("all", "all-split"):
        for t in problem.tasks:
            opts = [o for o in share_options(problem, t.id, hw, groups=("tp",))
                    if o.split_poly == (mode == "all-split")]
            if opts:
                out[t.id] = _entry(problem, t.id, opts[0], rate)
        return out
    report = sharing_bound(problem, hardware=hw, groups=("tp",), lockstep=True)
    for x in report.shared:
        out[x.task] = _entry(problem, x.task, x.option, rate)
    return out


def _entry(problem: DPProblem, task: int, o, rate: float  # noqa: ANN001
           ) -> tuple[float, bool, float, float, float]:
    """(load, split, compute s, collective s, hidden s) of one shared task: the load, for the DP side,
    is the longer of its compute and its collectives (the others of its group hide the shorter
    in the lockstep run); the schedule replaces the sum by the group's lockstep phase."""
    flops = problem.costs[task].flops
    unit = problem.loads[task] / flops if flops else 0.0
    compute = o.piece_flops / rate
    return (max(compute, o.comm_s) * rate * unit, o.split_poly, compute, o.comm_s, o.hidden_s)


def pair_decision(problem: DPProblem, hardware: str | HardwareProfile = "h100",
                  mode: str = "auto") -> dict[int, PairShare]:
    """``TPOptions.share`` at tp = 1: the tasks DP pairs share (Shampoo: ``block_decision``;
    ``auto``: those the bound shares over pairs; ``all``/``all-split``: every eligible one — a whole Muon matrix of a
    dense buffer). A piece's load is its compute plus its exchanges (a DP index rarely holds two
    pieces of one pair to hide one behind the other), priced on NVLink (``priced_for`` reprices
    the pairs the cuts put on two nodes)."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    if problem.settings.name == "shampoo":
        return block_decision(problem, mode)
    if problem.sizes.tp != 1 or problem.dp < 2 or problem.settings.name != "muon":
        return {}
    dense = {problem.tasks[i].param for b in problem.buckets for it in b.items for i in it.tasks
             if not problem.layout.buffers[b.buffer].expert}
    if mode in ("all", "all-split"):
        chosen = {}
        for t in problem.tasks:
            opts = [o for o in share_options(problem, t.id, hw, groups=("dp",), dp_sizes=(2,))
                    if o.split_poly == (mode == "all-split")]
            if opts:
                chosen[t.id] = opts[0]
    else:
        report = sharing_bound(problem, hardware=hw, groups=("dp",), dp_sizes=(2,))
        chosen = {x.task: x.option for x in report.shared}
    return {i: price_pair(problem, i, o.split_poly, hw, hw.link(2))
            for i, o in sorted(chosen.items()) if problem.tasks[i].param in dense}


def block_decision(problem: DPProblem, mode: str = "auto") -> dict[int, PairShare]:
    """Shampoo at tp = 1: the matrices whose blocks two DP indices host (item 3 of issue 18).
    A matrix is cut between two runs of whole block rows (``block_row``); each piece is the
    Shampoo kernel on its rows, exactly the whole matrix's update on those rows, with no
    exchange. ``auto``: the matrices heavier than a quarter of the mean load per DP index;
    ``all``/``all-split``: every one with two block rows or more."""
    st = problem.settings
    if problem.sizes.tp != 1 or problem.dp < 2 or st.name != "shampoo":
        return {}
    dense = {problem.tasks[i].param for b in problem.buckets for it in b.items for i in it.tasks
             if not problem.layout.buffers[b.buffer].expert}
    floor = problem.total / problem.dp / 4 if mode == "auto" else -1
    out = {}
    for t in problem.tasks:
        if t.optimizer != "matrix" or t.part is not None or len(t.shape) != 2 \
                or t.param not in dense or problem.loads[t.id] <= floor:
            continue
        rows, cols = t.shape
        row = block_row(rows, st.max_preconditioner_dim)
        if row is None:
            continue
        flops, states = block_pieces(st, rows, cols, row)
        loads = piece_loads(problem.loads[t.id], problem.costs[t.id].flops, flops)
        out[t.id] = PairShare(row, False, loads, flops, 0.0, 0.0, states)
    return out


def tp_pair_decision(problem: DPProblem, hardware: str | HardwareProfile = "h100",
                     mode: str = "auto") -> dict[int, PairShare]:
    """At tp > 1 (Muon): the tall column-parallel matrices a TP group would share with the same
    TP ranks at a partner DP index (k = 2·tp, ``runtime.optim.shared_ns.TPPair``): ``auto``,
    those the bound shares so (:func:`sharing_bound` over TP groups and TP pairs); ``all`` /
    ``all-split``, every eligible one, with or without the polynomial split. Each priced by
    :func:`price_tp_pair`. The DP problem (``with_pairs``), the per-GPU objective
    (``tp.context``), the TP schedule (a half in each partner's lockstep), the plan
    (``dp_shared`` at tp > 1, ``SharedTaskPlan.partner``) and the runtime account for them."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    sizes = problem.sizes
    if problem.settings.name != "muon" or sizes.tp == 1 or problem.dp < 2:
        return {}
    if mode in ("all", "all-split"):
        chosen = {}
        for t in problem.tasks:
            opts = [o for o in share_options(problem, t.id, hw, groups=("tp_pair",))
                    if o.split_poly == (mode == "all-split")]
            if opts:
                chosen[t.id] = opts[0]
    else:
        report = sharing_bound(problem, hardware=hw, groups=("tp", "tp_pair"))
        chosen = {x.task: x.option for x in report.shared if x.option.group == "tp_pair"}
    return {i: price_tp_pair(problem, i, o.split_poly, hw) for i, o in sorted(chosen.items())
            if problem.tasks[i].shape[0] // sizes.tp >= 2}


def kind_of(name: str) -> str:
    """``decoder.layers.3.mlp.linear_fc1.weight`` → ``mlp.linear_fc1``."""
    parts = [p for p in name.split("#")[0].split(".") if not p.isdigit() and p != "weight"]
    return ".".join(parts[-2:]) if len(parts) >= 2 else (parts[0] if parts else name)
