"""Which matrices a share mode shares (``TPOptions.share``, read as a :class:`ShareMode`): over
their TP group (:func:`share_decision`, what ``DPProblem.shared`` holds), over DP pairs at
tp = 1 (:func:`pair_decision`; Shampoo's blocks: :func:`block_decision`), over TP pairs
(:func:`tp_pair_decision`); the options a mode admits (:func:`chosen`: the one place that reads
``all`` / ``all-split``); and the short kind of a parameter's name (:func:`kind_of`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..errors import CanzonaWarning, OptionError
from ..hardware import HardwareProfile, load_hardware
from ..options import TP_SHARE
from ..planning import DPProblem, PairShare
from .blocks import block_pieces, block_row, piece_loads, shard_block_decision
from .bound import sharing_bound
from .pieces import DP_GROUP_SIZES, Group, ShareOption, profile_rate, share_options
from .prices import price_pair, price_tp_pair, seconds_to_load


@dataclass(frozen=True, slots=True)
class ShareMode:
    """A value of ``TPOptions.share`` (``options.TP_SHARE``) as the sharing decisions and the
    candidates read it. ``off``: nothing shared; ``auto``: the bound's choice, and the other
    candidate sets, each kept only where the objective says so; ``all`` / ``all-split``: every
    eligible matrix, without / with the polynomial split, kept; ``pairs`` (tp > 1): every tall
    column-parallel Muon matrix shared by two TP groups, every other eligible one by its TP
    group, with the split, kept; ``sub-groups`` (tp ≥ 4): every class of alike eligible
    matrices in rounds of TP sub-groups (``rounds.every_round``), the rest by their TP group,
    with the split, kept."""

    name: str = "off"

    @classmethod
    def of(cls, mode: ShareMode | str) -> ShareMode:
        """``mode`` as a :class:`ShareMode` (a name of ``options.TP_SHARE``)."""
        if isinstance(mode, ShareMode):
            return mode
        if mode not in TP_SHARE:
            raise OptionError(f"{{TPOptions.share}} must be one of: {', '.join(TP_SHARE)}; got "
                              f"{mode!r}.", fields=("TPOptions.share",))
        return cls(mode)

    @property
    def off(self) -> bool:
        return self.name == "off"

    @property
    def auto(self) -> bool:
        return self.name == "auto"

    @property
    def pairs(self) -> bool:
        """``pairs``: TP pairs wherever a matrix allows them."""
        return self.name == "pairs"

    @property
    def every(self) -> bool:
        """Every eligible matrix shared (not the bound's choice)."""
        return self.name in ("all", "all-split", "pairs", "sub-groups")

    @property
    def split(self) -> bool:
        """Shared with the polynomial split (of the modes that share every eligible matrix)."""
        return self.name in ("all-split", "pairs", "sub-groups")

    @property
    def sub_groups(self) -> bool:
        """Whether rounds of TP sub-groups are tried (``auto``) or asked for
        (``sub-groups``)."""
        return self.name in ("auto", "sub-groups")

    @property
    def tp_pairs(self) -> bool:
        """Whether TP pairs are tried (``auto``) or asked for (``pairs``)."""
        return self.name in ("auto", "pairs")

    @property
    def kept(self) -> bool:
        """What the mode shares is kept whatever the objective says (``all``, ``all-split``,
        ``pairs``, ``sub-groups``): a candidate that shares replaces one that does not."""
        return self.name not in ("off", "auto")

    def admits(self, option: ShareOption) -> bool:
        """Whether an option of an eligible matrix is the one this mode shares it with."""
        return option.split_poly == self.split

    def tries(self, dp_pairs: bool = False) -> tuple[ShareMode, ...]:
        """The decisions a plan compares: ``auto`` tries the bound's choice and every eligible
        matrix with the split (``dp_pairs``: without it too); another mode itself."""
        if not self.auto:
            return (self,)
        names = ("auto", "all", "all-split") if dp_pairs else ("auto", "all-split")
        return tuple(ShareMode(n) for n in names)


def chosen(problem: DPProblem, hw: HardwareProfile, mode: ShareMode, groups: tuple[Group, ...],
           *, bound_groups: tuple[Group, ...] | None = None,
           dp_sizes: tuple[int, ...] = DP_GROUP_SIZES, lockstep: bool = False
           ) -> dict[int, ShareOption]:
    """Task id → the option ``mode`` shares it with over ``groups``: for a mode sharing every
    eligible matrix, each task's first option the mode admits (in task order); else the
    bound's choice (:func:`sharing_bound` over ``bound_groups``, ``groups`` if None; its
    options over ``groups``, heaviest task first)."""
    if mode.every:
        out = {}
        for t in problem.tasks:
            opts = [o for o in share_options(problem, t.id, hw, groups=groups, dp_sizes=dp_sizes)
                    if mode.admits(o)]
            if opts:
                out[t.id] = opts[0]
        return out
    report = sharing_bound(problem, hardware=hw, groups=bound_groups or groups,
                           dp_sizes=dp_sizes, lockstep=lockstep)
    return {x.task: x.option for x in report.shared if x.option.group in groups}


def share_decision(problem: DPProblem, hardware: str | HardwareProfile = "h100",
                   mode: ShareMode | str = "auto"
                   ) -> dict[int, tuple[float, bool, float, float, float]]:
    """The tasks shared over their TP group (``auto``: those the bound shares, choosing by what
    a piece adds to a lockstep; every eligible one otherwise, :func:`chosen`): task id → (load
    per TP rank, polynomial split, compute seconds, collective seconds, of those the seconds
    beside its own Gram products), what ``DPProblem.shared`` holds; the load is max(compute,
    collectives) in cost units. Shampoo: the matrices whose shards are whole blocks,
    preconditioned shard by shard (``blocks.shard_block_decision``), whatever the mode."""
    if problem.settings.spec.block_hosted:
        return shard_block_decision(problem, hardware)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    rate = profile_rate(hw)
    got = chosen(problem, hw, ShareMode.of(mode), ("tp",), lockstep=True)
    return {i: _entry(problem, i, o, rate) for i, o in got.items()}


def _entry(problem: DPProblem, task: int, o: ShareOption, rate: float
           ) -> tuple[float, bool, float, float, float]:
    """(load, split, compute s, collective s, hidden s) of one shared task: the load, for the DP
    side, is the longer of its compute and its collectives (the others of its group hide the
    shorter in the lockstep run); the schedule replaces the sum by the group's lockstep
    phase."""
    compute = o.compute_s(rate)
    return (seconds_to_load(problem, task, max(compute, o.comm_s), rate), o.split_poly, compute,
            o.comm_s, o.hidden_s)


def pair_decision(problem: DPProblem, hardware: str | HardwareProfile = "h100",
                  mode: ShareMode | str = "auto") -> dict[int, PairShare]:
    """At tp = 1: the tasks DP pairs share (Shampoo: :func:`block_decision`; ``auto``: those the
    bound shares over pairs; every eligible one otherwise — a whole Muon matrix of a dense
    buffer, :func:`chosen`). A piece's load is its compute plus its exchanges (a DP index rarely
    holds two pieces of one pair to hide one behind the other), priced on NVLink
    (``prices.priced_for`` reprices the pairs the cuts put on two nodes)."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    mode = ShareMode.of(mode)
    if problem.settings.spec.block_hosted:
        return block_decision(problem, mode)
    if problem.sizes.tp != 1 or problem.dp < 2 or not problem.settings.spec.gram_shared:
        return {}
    dense = {problem.tasks[i].param for b in problem.buckets for it in b.items for i in it.tasks
             if not problem.layout.buffers[b.buffer].expert}
    got = chosen(problem, hw, mode, ("dp",), dp_sizes=(2,))
    return {i: price_pair(problem, i, o.split_poly, hw, hw.link(2))
            for i, o in sorted(got.items()) if problem.tasks[i].param in dense}


def block_decision(problem: DPProblem, mode: ShareMode | str = "auto") -> dict[int, PairShare]:
    """Shampoo at tp = 1: the matrices whose blocks two DP indices host. A matrix is cut between
    two runs of whole block rows (``blocks.block_row``); each piece is the Shampoo kernel on its
    rows, exactly the whole matrix's update on those rows, with no exchange. ``auto``: the
    matrices heavier than a quarter of the mean load per DP index; otherwise every one with two
    block rows or more."""
    st = problem.settings
    if problem.sizes.tp != 1 or problem.dp < 2 or not st.spec.block_hosted:
        return {}
    dense = {problem.tasks[i].param for b in problem.buckets for it in b.items for i in it.tasks
             if not problem.layout.buffers[b.buffer].expert}
    floor = problem.total / problem.dp / 4 if ShareMode.of(mode).auto else -1
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
                     mode: ShareMode | str = "auto") -> dict[int, PairShare]:
    """At tp > 1 (Muon): the tall column-parallel matrices a TP group would share with the same
    TP ranks at a partner DP index (k = 2·tp, ``runtime.optim.transports.TPPair``): ``auto``,
    those the bound shares so (:func:`sharing_bound` over TP groups and TP pairs); otherwise
    every eligible one, with or without the polynomial split (:func:`chosen`). Each priced by
    ``prices.price_tp_pair``. The DP problem (``with_pairs``), the per-GPU objective
    (``tp.context``), the TP schedule (a half in each partner's lockstep), the plan
    (``dp_shared`` at tp > 1, ``SharedTaskPlan.partner``) and the runtime account for them."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    sizes = problem.sizes
    if not problem.settings.spec.gram_shared or sizes.tp == 1 or problem.dp < 2:
        return {}
    got = chosen(problem, hw, ShareMode.of(mode), ("tp_pair",), bound_groups=("tp", "tp_pair"))
    return {i: price_tp_pair(problem, i, o.split_poly, hw) for i, o in sorted(got.items())
            if problem.tasks[i].shape[0] // sizes.tp >= 2}


def kind_of(name: str) -> str:
    """``decoder.layers.3.mlp.linear_fc1.weight`` → ``mlp.linear_fc1``."""
    parts = [p for p in name.split("#")[0].split(".") if not p.isdigit() and p != "weight"]
    return ".".join(parts[-2:]) if len(parts) >= 2 else (parts[0] if parts else name)


def tp_share_sets(problem: DPProblem, mode: ShareMode, hw: HardwareProfile, *,
                  stacklevel: int = 2) -> list[dict[int, tuple[float, bool, float, float, float]]]:
    """At tp > 1, the candidate sets of tasks TP groups share (``DPProblem.shared``), distinct,
    the first the plan starts from: each decision ``mode`` tries (:func:`share_decision`), and
    for Shampoo under ``auto`` none as well (its shard blocks save compute only: the modelled
    step decides). Warns (``stacklevel`` as ``warnings.warn`` counts it from the caller) where
    nothing can be shared."""
    shares: list[dict] = []
    for m in mode.tries():
        cand = share_decision(problem, hw, m)
        if cand not in shares:
            shares.append(cand)
    name, spec = problem.settings.name, problem.settings.spec
    if mode.auto and spec.block_hosted and shares[0]:
        shares.append({})
    if not spec.block_hosted and not any(shares):
        why = ("no TP-split matrix here is split along its long dimension (its TP shards would "
               "be its row blocks)" if spec.gram_shared else
               f"sharing applies to Muon's Newton–Schulz and Shampoo's blocks; {name}'s updates "
               f"stay whole")
        warnings.warn(f"TPOptions.share = {mode.name!r}: no matrix is shared over its TP group: "
                      f"{why}.", CanzonaWarning, stacklevel=stacklevel + 1)
    if spec.block_hosted and not shares[0]:
        warnings.warn(f"TPOptions.share = {mode.name!r}: no {spec.title} matrix here has TP shards "
                      f"that are whole blocks of max_preconditioner_dim = "
                      f"{problem.settings.max_preconditioner_dim}, so every one is hosted whole "
                      f"(a block size dividing the shards' segments allows it).",
                      CanzonaWarning, stacklevel=stacklevel + 1)
    return shares


def dp_pair_sets(problem: DPProblem, mode: ShareMode, hw: HardwareProfile, *,
                 stacklevel: int = 2) -> list[dict[int, PairShare]]:
    """At tp = 1, the candidate sets of tasks DP pairs share, distinct and not empty: each
    decision ``mode`` tries (:func:`pair_decision`). Warns (``stacklevel`` as
    ``warnings.warn`` counts it from the caller) where there is none."""
    pairs: list[dict] = []
    for m in mode.tries(dp_pairs=True):
        cand = pair_decision(problem, hw, m)
        if cand and cand not in pairs:
            pairs.append(cand)
    if not pairs:
        warnings.warn(f"TPOptions.share = {mode.name!r}: no matrix is worth splitting over DP "
                      f"pairs here (a whole Muon matrix of a dense buffer, Muon or Shampoo with "
                      f"two block rows or more, dp ≥ 2).", CanzonaWarning,
                      stacklevel=stacklevel + 1)
    return pairs
