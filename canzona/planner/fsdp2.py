"""Planning for FSDP2's storage: a ``fully_shard`` model keeps every parameter as ``Shard(0)``
rows over the DP ranks (``formulas.fsdp2_rows``), and FSDP2 itself reduces the gradients and
gathers the parameters. What the optimizer step needs from a plan is who computes each matrix's
update and how its rows get there and back:

* **owners** — each matrix task on one DP rank. A rank's work is the Newton–Schulz (or Shampoo,
  SOAP) time of its matrices and the bytes it receives for them and sends back, both from the
  hardware profile. Longest-first on that weight, then moves and swaps off the busiest rank.
* **rounds** — the matrices gathered by one all-to-all, computed, and returned by a second;
  each rank's matrices are spread over the rounds so that no rank holds more than ``C_max`` of
  whole matrices in a round and every round's compute is alike across ranks.
* **the modelled step** (:func:`round_timeline`) — the rounds pipelined as the runtime issues
  them: round k + 1's gather is issued before round k's compute, round k's return after it,
  every collective on one channel in issue order.

:func:`solve_fsdp2` gives the owners and rounds of a strategy (``canzona``; ``dist-muon``:
torchtitan DistMuon's method, longest-first owners on the matrix FLOPs and one matrix per rank
per round; ``sync``: every rank gathers every matrix and computes all of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .comm import ELEMENT_BYTES
from .cost import Task, TaskCost, build_tasks, task_cost
from .errors import SizeError
from .formulas import fsdp2_rows
from .hardware import HardwareProfile, LinkProfile
from .inventory import ModelSpec
from .layout import ParallelSizes
from .settings import OptimizerSettings

__all__ = ["FSDP2_STRATEGIES", "FSDP2Problem", "FSDP2Solution", "make_fsdp2_problem",
           "round_timeline", "solve_fsdp2"]

#: The strategies :func:`solve_fsdp2` knows, with what each does.
FSDP2_STRATEGIES: dict[str, str] = {
    "canzona": "owners by longest-first on compute and bytes, refined off the busiest rank; "
               "rounds under the memory cap, each round's compute alike across ranks",
    "dist-muon": "torchtitan DistMuon's method: owners by longest-first on the matrix FLOPs, "
                 "one matrix per rank per round, in that order",
    "sync": "no owners: every rank gathers every matrix and computes all of them",
}


@dataclasses.dataclass(frozen=True)
class FSDP2Problem:
    """The tasks of a model under FSDP2 at ``dp`` ranks, and what each costs.

    Attributes:
        compute_s: per task, its update's time on one rank (0 for AdamW tasks).
        moved: per task, (rows, columns) of the matrix the gather moves (AdamW tasks: (0, 0)).
        elem_bytes: bytes per element the rows travel in (``comm_dtype``).
    """

    spec: ModelSpec
    settings: OptimizerSettings
    dp: int
    tasks: tuple[Task, ...]
    costs: tuple[TaskCost, ...]
    compute_s: tuple[float, ...]
    comm_dtype: str
    elem_bytes: int
    hardware: HardwareProfile
    link_name: str
    link: LinkProfile
    cmax_bytes: int

    @property
    def matrices(self) -> list[int]:
        """The matrix tasks' ids."""
        return [t.id for t in self.tasks if t.optimizer == "matrix"]

    def full_bytes(self, i: int) -> int:
        """Task ``i``'s whole matrix in the comm dtype."""
        rows, cols = self.tasks[i].shape
        return rows * cols * self.elem_bytes

    def rows(self, i: int) -> tuple[tuple[int, int], ...]:
        """Per rank, (first row, rows) of task ``i``'s parameter."""
        return fsdp2_rows(self.tasks[i].shape[0], self.dp)

    def moved_bytes(self, i: int, owner: int) -> tuple[list[int], int]:
        """Task ``i`` owned by ``owner``: per rank, the bytes it sends the owner in the gather,
        and the bytes the owner receives."""
        cols = self.tasks[i].shape[1]
        sent = [0 if r == owner else n * cols * self.elem_bytes
                for r, (_, n) in enumerate(self.rows(i))]
        return sent, sum(sent)

    def weight(self, i: int) -> float:
        """Task ``i``'s time on its owner: its compute, and receiving its rows and sending its
        update rows back (at most all of them)."""
        return self.compute_s[i] + 2 * self.full_bytes(i) / self.link.busbw


def make_fsdp2_problem(spec: ModelSpec, dp: int, settings: OptimizerSettings, *,
                       hardware: HardwareProfile, comm_dtype: str = "fp32",
                       cmax_bytes: int = 512 << 20) -> FSDP2Problem:
    """The FSDP2 problem of ``spec`` at ``dp`` ranks (one DP mesh dimension; ``comm_dtype``:
    what FSDP2's reduced gradients are, the rows' dtype on the wire).

    Raises:
        SizeError: settings FSDP2 storage does not run (parts of a fused matrix, per-head
            QKV, 3-D stacked experts), naming the field.
    """
    if settings.qkv_split != "fused" or settings.split_gate_up:
        field = ("OptimizerSettings.split_gate_up" if settings.split_gate_up
                 else "OptimizerSettings.qkv_split")
        raise SizeError(f"FSDP2 storage updates whole parameters; {field} splits a fused "
                        "matrix into parts. Plan it with the default (qkv_split 'fused', "
                        "split_gate_up false).", fields=(field,))
    sizes = ParallelSizes(dp=dp, tp=1)
    tasks = tuple(build_tasks(spec, settings, sizes))
    for t in tasks:
        if t.part is not None:
            raise SizeError(f"'{t.param}' is a 3-D stack of expert matrices; FSDP2 storage "
                            "plans 2-D matrices (and AdamW tensors of any shape).",
                            fields=("ModelSpec.params",))
    costs = tuple(task_cost(t, settings, sizes, comm_dtype) for t in tasks)
    compute = tuple(hardware.seconds(c.flops) if t.optimizer == "matrix" else 0.0
                    for t, c in zip(tasks, costs))
    link = hardware.link(dp)  # one DP mesh dimension: dp consecutive ranks
    name = "intra_node" if link is hardware.intra_node else "inter_node"
    return FSDP2Problem(spec, settings, dp, tasks, costs, compute, comm_dtype,
                        ELEMENT_BYTES[comm_dtype], hardware, name, link, cmax_bytes)


@dataclasses.dataclass(frozen=True)
class FSDP2Solution:
    """Owners and rounds of a strategy, and the modelled step.

    Attributes:
        owners: matrix task id → its DP rank (``sync``: every rank computes every matrix; the
            owners are then the ranks the matrices would be returned from, unused).
        rounds: per round, its task ids in order.
        step_s: the modelled step of the matrices (:func:`round_timeline`).
        bound_s: a lower bound on that step for any owners and rounds.
    """

    strategy: str
    owners: dict[int, int]
    rounds: tuple[tuple[int, ...], ...]
    step_s: float
    bound_s: float

    def loads(self, problem: FSDP2Problem) -> list[float]:
        """Per rank, the weight of the matrices it owns (:meth:`FSDP2Problem.weight`)."""
        out = [0.0] * problem.dp
        for i, o in self.owners.items():
            out[o] += problem.weight(i)
        return out


# -- owners -------------------------------------------------------------------------------------


def longest_first(ids: Sequence[int], weight: Sequence[float] | dict[int, float], ranks: int
                  ) -> dict[int, int]:
    """Longest-first (LPT): the heaviest task first, each on the least loaded rank (ties: the
    lowest rank; equal weights: the lower id first)."""
    loads = [0.0] * ranks
    owners: dict[int, int] = {}
    for i in sorted(ids, key=lambda i: (-weight[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += weight[i]
    return owners


def refine(owners: dict[int, int], weight: dict[int, float], ranks: int, *,
           rounds: int = 2000) -> dict[int, int]:
    """Moves and swaps that lower the busiest rank's load, until none does (or ``rounds``
    improvements): a task of the busiest rank moves to the least loaded rank where that lowers
    the pair's larger load, else swaps with a lighter task of another rank that does."""
    owners = dict(owners)
    loads = [0.0] * ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    for i, o in sorted(owners.items()):
        loads[o] += weight[i]
        held[o].append(i)
    eps = 1e-12
    for _ in range(rounds):
        top = max(range(ranks), key=lambda r: (loads[r], -r))
        best: tuple[float, int, int, int | None] | None = None
        for i in held[top]:
            for r in range(ranks):
                if r == top:
                    continue
                moved = max(loads[top] - weight[i], loads[r] + weight[i])
                if moved < loads[top] - eps and (best is None or moved < best[0] - eps):
                    best = (moved, i, r, None)
                for j in held[r]:
                    d = weight[i] - weight[j]
                    if d <= eps:
                        continue
                    swapped = max(loads[top] - d, loads[r] + d)
                    if swapped < loads[top] - eps and (best is None or swapped < best[0] - eps):
                        best = (swapped, i, r, j)
        if best is None:
            break
        _, i, r, j = best
        held[top].remove(i)
        held[r].append(i)
        owners[i] = r
        loads[top] -= weight[i]
        loads[r] += weight[i]
        if j is not None:
            held[r].remove(j)
            held[top].append(j)
            owners[j] = top
            loads[r] -= weight[j]
            loads[top] += weight[j]
    return owners


# -- rounds -------------------------------------------------------------------------------------


def capped_rounds(problem: FSDP2Problem, owners: dict[int, int]) -> tuple[tuple[int, ...], ...]:
    """The rounds of the shortest modelled step (:func:`round_timeline`; ties: fewer rounds):
    K from the fewest that keep every rank's whole matrices of a round within ``C_max`` (a
    matrix larger than it alone) to the most matrices a rank owns, each rank's matrices dealt
    onto the K rounds by :func:`deal_rounds`. More rounds hide more of the gathers behind
    compute and cost a latency each."""
    held = _held(problem, owners)
    least = max(_rounds_needed([problem.full_bytes(i) for i in ids], problem.cmax_bytes)
                for ids in held)
    most = max(least, max(len(ids) for ids in held))
    best: tuple[float, tuple[tuple[int, ...], ...]] | None = None
    for count in range(least, most + 1):
        rounds = deal_rounds(problem, owners, count)
        t = round_timeline(problem, owners, rounds)
        if best is None or t < best[0] - 1e-12:
            best = (t, rounds)
    assert best is not None
    return best[1]


def _held(problem: FSDP2Problem, owners: dict[int, int]) -> list[list[int]]:
    held: list[list[int]] = [[] for _ in range(problem.dp)]
    for i, o in sorted(owners.items()):
        held[o].append(i)
    return held


def deal_rounds(problem: FSDP2Problem, owners: dict[int, int], count: int
                ) -> tuple[tuple[int, ...], ...]:
    """Each rank's matrices onto ``count`` rounds (:func:`_deal`): every round's compute alike
    across ranks, none over ``C_max`` where the matrices allow. A round lists its tasks by
    owner, then id; empty rounds are dropped."""
    rounds: list[list[int]] = [[] for _ in range(count)]
    for ids in _held(problem, owners):
        for k, part in enumerate(_deal(problem, ids, count, problem.cmax_bytes)):
            rounds[k].extend(part)
    return tuple(tuple(sorted(r, key=lambda i: (owners[i], i))) for r in rounds if r)


def _rounds_needed(sizes: list[int], cap: int) -> int:
    """The rounds first-fit-decreasing packs ``sizes`` into at ``cap`` (an oversized size
    alone)."""
    bins: list[int] = []
    for s in sorted(sizes, reverse=True):
        for k, used in enumerate(bins):
            if used + s <= cap:
                bins[k] += s
                break
        else:
            bins.append(s)
    return max(1, len(bins))


def _deal(problem: FSDP2Problem, ids: list[int], count: int, cap: int) -> list[list[int]]:
    """One rank's matrices onto ``count`` rounds: longest-first on compute, into the round of
    least compute whose bytes stay within ``cap`` (none: the round of fewest bytes)."""
    compute = [0.0] * count
    used = [0] * count
    out: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(ids, key=lambda i: (-problem.compute_s[i], i)):
        size = problem.full_bytes(i)
        fits = [k for k in range(count) if used[k] + size <= cap]
        k = (min(fits, key=lambda k: (compute[k], k)) if fits
             else min(range(count), key=lambda k: (used[k], k)))
        out[k].append(i)
        compute[k] += problem.compute_s[i]
        used[k] += size
    return out


# -- the modelled step --------------------------------------------------------------------------


def round_traffic(problem: FSDP2Problem, owners: dict[int, int], tasks: Sequence[int]
                  ) -> tuple[list[int], list[int], list[int], list[float]]:
    """A round's per-rank gathered whole-matrix bytes, bytes sent and received in its gather,
    and compute seconds."""
    dp = problem.dp
    gathered, sent, received, compute = [0] * dp, [0] * dp, [0] * dp, [0.0] * dp
    for i in tasks:
        o = owners[i]
        out, into = problem.moved_bytes(i, o)
        for r, b in enumerate(out):
            sent[r] += b
        received[o] += into
        gathered[o] += problem.full_bytes(i)
        compute[o] += problem.compute_s[i]
    return gathered, sent, received, compute


def round_timeline(problem: FSDP2Problem, owners: dict[int, int],
                   rounds: Sequence[Sequence[int]]) -> float:
    """The matrices' step, rounds pipelined as the runtime issues them.

    Each rank runs, for round k: issue the gather of round k + 1, wait for round k's gather,
    compute round k, issue round k's return. The collectives run one at a time in issue order
    (G0, G1, R0, G2, R1, …), each once every rank has issued it, for the α–β time of its
    busiest rank; the step ends when the last return does."""
    if not rounds:
        return 0.0
    dp, link = problem.dp, problem.link
    comm, compute = [], []
    for tasks in rounds:
        _, sent, received, c = round_traffic(problem, owners, tasks)
        comm.append(link.seconds(max(max(sent), max(received))))
        compute.append(c)
    K = len(rounds)
    channel = 0.0
    done = [0.0] * dp          # each rank's compute of the previous round ends

    def run(seconds: float, issued: float) -> float:
        nonlocal channel
        channel = max(channel, issued) + seconds
        return channel

    gather_end = [0.0] * K
    gather_end[0] = run(comm[0], 0.0)
    if K > 1:
        gather_end[1] = run(comm[1], 0.0)
    last = gather_end[0]
    for k in range(K):
        done = [max(gather_end[k], done[r]) + compute[k][r] for r in range(dp)]
        last = run(comm[k], max(done))                     # round k's return
        if k + 2 < K:
            gather_end[k + 2] = run(comm[k + 2], max(done))  # issued after that return
    return last


def step_bound(problem: FSDP2Problem) -> float:
    """A lower bound on the matrices' step for any owners and rounds, the largest of:

    * the busiest rank's compute (at least the mean), with one gather latency before it and
      one return latency after;
    * any one matrix: its owner receives all its rows but its own, computes, then sends the
      update rows back, one after the other;
    * the channel's busy time: every byte some rank must receive, and send back (per rank at
      least the mean), twice over."""
    ids = problem.matrices
    if not ids:
        return 0.0
    link, dp = problem.link, problem.dp
    alpha = 2 * link.latency_s
    compute = max(max(problem.compute_s[i] for i in ids),
                  sum(problem.compute_s[i] for i in ids) / dp)
    # the owner of a matrix receives at least all rows but its own, whoever owns it
    least = {i: problem.full_bytes(i) - max(n for _, n in problem.rows(i))
             * problem.tasks[i].shape[1] * problem.elem_bytes for i in ids}
    one = max(problem.compute_s[i] + 2 * least[i] / link.busbw for i in ids)
    channel = 2 * (sum(least.values()) / dp) / link.busbw
    return max(compute, one, channel) + alpha


# -- strategies ---------------------------------------------------------------------------------


def solve_fsdp2(problem: FSDP2Problem, strategy: str = "canzona") -> FSDP2Solution:
    """Owners, rounds and the modelled step of ``strategy`` (a key of
    :data:`FSDP2_STRATEGIES`)."""
    if strategy not in FSDP2_STRATEGIES:
        raise ValueError(f"unknown FSDP2 strategy {strategy!r}; choose one of "
                         f"{', '.join(FSDP2_STRATEGIES)}")
    ids = problem.matrices
    bound = step_bound(problem)
    if strategy == "sync":
        return FSDP2Solution(strategy, {i: 0 for i in ids}, (tuple(ids),) if ids else (),
                             _sync_step(problem), bound)
    if strategy == "dist-muon":
        flops = {i: float(problem.costs[i].flops) for i in ids}
        owners = longest_first(ids, flops, problem.dp)
        rounds = _one_per_rank(owners, flops, problem.dp)
    else:
        weight = {i: problem.weight(i) for i in ids}
        owners = refine(longest_first(ids, weight, problem.dp), weight, problem.dp)
        rounds = capped_rounds(problem, owners)
    return FSDP2Solution(strategy, owners, rounds, round_timeline(problem, owners, rounds),
                         bound)


def _one_per_rank(owners: dict[int, int], order: dict[int, float], ranks: int
                  ) -> tuple[tuple[int, ...], ...]:
    """Round k holds each rank's k-th matrix in longest-first order (DistMuon's megabatches:
    one matrix per rank per all-to-all)."""
    held: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(owners, key=lambda i: (-order[i], i)):
        held[owners[i]].append(i)
    count = max((len(h) for h in held), default=0)
    return tuple(tuple(h[k] for h in held if k < len(h)) for k in range(count))


def _sync_step(problem: FSDP2Problem) -> float:
    """Every rank all-gathers every matrix (one collective per matrix), then computes all."""
    ids = problem.matrices
    link, dp = problem.link, problem.dp
    gather = sum(link.seconds(problem.full_bytes(i) * (dp - 1) / dp) for i in ids)
    return gather + sum(problem.compute_s[i] for i in ids)
