"""The atomic per-GPU bound and the bound with sharing (:func:`sharing_bound`, behind
``canzona inspect``'s sharing section and the ``auto`` decisions).

Whole-matrix ownership has a floor: no GPU finishes before the largest single task, so the
atomic bound is LB = max(mean, largest task), the mean being the useful work per GPU (the
single-device cost of every task, AdamW shards and replicated matrices included, over dp·tp
GPUs). A shared piece's collectives are not work a GPU must do — it computes other tasks while
it waits, as the micro-groups already overlap — so the mean grows only by the FLOPs sharing
adds (each rank's 2n³ of the polynomial, or its split share). :func:`sharing_bound` decides
greedily: while the heaviest unshared task exceeds the mean (the useful work plus the FLOPs
added so far), share it with the option of least added FLOPs whose critical path fits under
that mean, else the one with the shortest path. The bound with sharing is on each GPU's work:
max(that mean, largest unshared task, largest shared piece); the longest critical path
(``longest_path``) is reported beside it, a floor on the step's time. Loads are in the plan's
cost units (a task's load per FLOP converts FLOPs and seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import HardwareProfile, load_hardware
from ..planning import DPProblem, equal_cuts
from ..tp.context import TPContext, index_work
from .blocks import shard_block_decision
from .pieces import DP_GROUP_SIZES, Group, ShareOption, profile_rate, share_options
from .prices import flops_to_load, seconds_to_load


@dataclass(frozen=True, slots=True)
class SharedTask:
    """A task the bound shares, in the plan's cost units: its load alone; ``piece_load``, each
    sharing rank's work (its FLOPs); ``path_load``, its critical path on a sharing rank (those
    FLOPs and the collectives it waits for); ``overhead``, the FLOPs added over the whole group
    (k pieces minus the task)."""

    task: int
    name: str
    shape: tuple[int, int]
    load: int
    option: ShareOption
    piece_load: float
    path_load: float
    overhead: float


@dataclass(frozen=True, slots=True)
class SharingReport:
    """The atomic bound and the bound with sharing, per GPU, in the plan's cost units."""

    optimizer: str
    gpus: int
    mean: float  # useful work per GPU
    largest_task: int
    atomic_lb: float
    shared_lb: float
    overhead: float  # Σ of the shared tasks' added FLOPs (cost units)
    shared: tuple[SharedTask, ...]
    note: str = ""
    #: the longest single task's critical path (a shared piece with its collectives, or an
    #: unshared task): a floor on the step, not on any GPU's work
    longest_path: float = 0.0

    @property
    def atomic_ratio(self) -> float:
        return self.atomic_lb / self.mean if self.mean else 1.0

    @property
    def shared_ratio(self) -> float:
        return self.shared_lb / self.mean if self.mean else 1.0

    def to_dict(self) -> dict:
        return {
            "optimizer": self.optimizer, "gpus": self.gpus, "mean": self.mean,
            "largest_task": self.largest_task, "atomic_lb": self.atomic_lb,
            "atomic_lb_over_mean": round(self.atomic_ratio, 6), "shared_lb": self.shared_lb,
            "shared_lb_over_mean": round(self.shared_ratio, 6), "overhead": self.overhead,
            "longest_path": self.longest_path,
            "longest_path_over_mean": round(self.longest_path / self.mean, 6) if self.mean else 1.0,
            "note": self.note,
            "shared": [{"task": s.task, "name": s.name, "shape": list(s.shape), "load": s.load,
                        "group": s.option.group, "k": s.option.k,
                        "split_poly": s.option.split_poly, "piece_load": s.piece_load,
                        "path_load": s.path_load, "overhead": s.overhead,
                        "comm_s": s.option.comm_s, "hidden_s": s.option.hidden_s}
                       for s in self.shared],
        }


def _useful_total(problem: DPProblem) -> float:
    """Per-GPU work summed over all GPUs: every task once, AdamW shards once per TP rank, matrices
    TP does not split once per TP rank (every rank of the index computes them)."""
    ctx = TPContext.build(problem, problem.comm_dtype)
    cuts = {(b.buffer, b.bucket): equal_cuts(b) for b in problem.buckets}
    base, owned, pinned = index_work(problem, cuts, ctx)
    return (sum(base) * problem.sizes.tp + sum(problem.loads[i] for ids in owned for i in ids)
            + sum(map(sum, pinned or ())))


def sharing_bound(problem: DPProblem, *, hardware: str | HardwareProfile = "h100",
                  ns_bytes: int = 2, groups: tuple[Group, ...] = ("tp", "tp_pair", "dp"),
                  lockstep: bool = False,
                  dp_sizes: tuple[int, ...] = DP_GROUP_SIZES) -> SharingReport:
    """The atomic per-GPU bound and the bound with Muon tasks shared (see the module docstring).

    Args:
        problem: the plan's DP problem (``make_problem``; ``plan.inverse.read_problem`` for a plan).
        hardware: the profile whose links time the collectives and whose achieved rate turns
            seconds into FLOPs.
        ns_bytes: bytes per element of the Newton–Schulz iteration (bf16: 2).
        groups: the sharing groups allowed (``("tp",)``: ``decision.share_decision``'s
            ``auto``).
        dp_sizes: the DP group sizes allowed (``(2,)``: the pairs ``decision.pair_decision``
            plans).
        lockstep: choose among the options that fit by the longer of a piece's compute and its
            collectives (what it adds to a group run in lockstep, where the others hide the
            shorter) instead of by the FLOPs sharing adds.
    """
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    gpus = problem.dp * problem.sizes.tp
    total = _useful_total(problem)
    mean = total / gpus
    matrix = [t.id for t in problem.tasks if t.optimizer == "matrix"]
    largest = max((problem.loads[i] for i in matrix), default=0)
    atomic = max(mean, float(largest))
    name, spec = problem.settings.name, problem.settings.spec
    if spec.block_hosted and problem.sizes.tp > 1:
        # blocks shard by shard: no FLOPs added, no collective
        blocks = shard_block_decision(problem, hw)
        shared = []
        for i, (piece, *_) in sorted(blocks.items()):
            t = problem.tasks[i]
            flops = problem.costs[i].flops
            o = ShareOption("tp", problem.sizes.tp, False,
                            int(piece * flops / problem.loads[i]) if problem.loads[i] else 0, 0.0)
            shared.append(SharedTask(i, t.name, (max(t.shape), min(t.shape)), problem.loads[i],
                                     o, piece, piece, 0.0))
        rest = max((problem.loads[i] for i in matrix if i not in blocks), default=0)
        top = max([s.piece_load for s in shared] + [float(rest)], default=0.0)
        return SharingReport(name, gpus, mean, largest, atomic, max(mean, top), 0.0,
                             tuple(shared), longest_path=top,
                             note=f"{spec.title}: the matrices whose TP shards are whole "
                                  "blocks are preconditioned shard by shard (no gather); the "
                                  "others stay whole")
    if not spec.gram_shared:
        return SharingReport(name, gpus, mean, largest, atomic, atomic, 0.0, (),
                             note=f"sharing applies to Muon's Newton–Schulz (and Shampoo's "
                                  f"blocks); {name} tasks stay whole")
    rate = profile_rate(hw)
    order = sorted(matrix, key=lambda i: (-problem.loads[i], i))
    shared: list[SharedTask] = []
    extra = 0.0
    for i in order:
        load = problem.loads[i]
        target = (total + extra) / gpus
        if load <= target:
            break
        flops = problem.costs[i].flops
        best = None
        for o in share_options(problem, i, hw, ns_bytes=ns_bytes, groups=groups,
                               dp_sizes=dp_sizes):
            path = seconds_to_load(problem, i, o.alone_s(rate), rate)
            if problem.seconds_per_load is None:
                over = max(0.0, flops_to_load(problem, i, o.k * o.piece_flops - flops, rate))
                cost = flops_to_load(problem, i, max(o.piece_flops, o.comm_s * rate), rate)
            else:  # the pieces' compute in seconds, their memory passes included
                over = max(0.0, seconds_to_load(problem, i, o.k * o.compute_s(rate), rate) - load)
                cost = seconds_to_load(problem, i, max(o.compute_s(rate), o.comm_s), rate)
            fits = path <= target
            cost = cost if lockstep else over
            key = (not fits, cost if fits else path, o.k, o.split_poly)
            if best is None or key < best[0]:
                best = (key, o, path, over)
        t = problem.tasks[i]
        if best is None or best[2] >= load:
            continue
        _, o, path, over = best
        m, n = max(t.shape), min(t.shape)
        piece = flops_to_load(problem, i, o.piece_flops, rate) \
            if problem.seconds_per_load is None \
            else seconds_to_load(problem, i, o.compute_s(rate), rate)
        s = SharedTask(i, t.name, (m, n), load, o, piece, path, over)
        shared.append(s)
        extra += s.overhead
    mean_with = (total + extra) / gpus
    pieces = max((s.piece_load for s in shared), default=0.0)
    rest = [problem.loads[i] for i in matrix if i not in {s.task for s in shared}]
    unshared_max = max(rest, default=0)
    bound = max(mean_with, pieces, float(unshared_max))
    path = max((s.path_load for s in shared), default=0.0)
    return SharingReport(name, gpus, mean, largest, atomic, max(bound, mean), extra,
                         tuple(shared), longest_path=max(path, float(unshared_max)))
