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
from functools import lru_cache

from .comm import ELEMENT_BYTES
from .cost import Task, TaskCost, build_tasks, task_cost
from .errors import SizeError
from .formulas import fsdp2_blocks
from .hardware import HardwareProfile, LinkProfile
from .inventory import ModelSpec
from .layout import ParallelSizes
from .settings import OptimizerSettings
from .sharing.pieces import profile_rate, shared_piece

__all__ = ["FSDP2_STRATEGIES", "SHARE_K", "FSDP2Problem", "FSDP2Solution", "block_bounds",
           "deal_rounds", "gather_bytes", "make_fsdp2_problem", "round_timeline", "solve_fsdp2",
           "step_bound", "wire_dtype"]

#: Ranks that share a matrix: adjacent pairs (2s, 2s + 1).
SHARE_K = 2
#: Bytes per element of the shared Newton–Schulz's collectives (bf16, as it runs).
NS_BYTES = 2

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
    """The tasks of a model under FSDP2 at ``dp`` ranks (with TP: a dp × tp mesh, rank
    d·tp + t), and what each costs.

    Attributes:
        compute_s: per task, its update's time on one rank (0 for AdamW tasks).
        split_dims: per task, the dimension TP shards (None: replicated over TP).
        elem_bytes: bytes per element the rows travel in (``comm_dtype``).
    """

    spec: ModelSpec
    settings: OptimizerSettings
    dp: int
    tp: int
    split_dims: tuple[int | None, ...]
    tasks: tuple[Task, ...]
    costs: tuple[TaskCost, ...]
    compute_s: tuple[float, ...]
    comm_dtype: str
    elem_bytes: int
    hardware: HardwareProfile
    link_name: str
    link: LinkProfile
    cmax_bytes: int
    _pieces: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def matrices(self) -> list[int]:
        """The matrix tasks' ids."""
        return [t.id for t in self.tasks if t.optimizer == "matrix"]

    def full_bytes(self, i: int) -> int:
        """Task ``i``'s whole matrix in the comm dtype."""
        rows, cols = self.tasks[i].shape
        return rows * cols * self.elem_bytes

    @property
    def ranks(self) -> int:
        """The GPUs that own matrices: dp · tp."""
        return self.dp * self.tp

    def most_held(self, i: int) -> int:
        """The most bytes of task ``i`` one rank holds (its block, ``formulas.fsdp2_block``)."""
        blocks = fsdp2_blocks(self.tasks[i].shape, self.split_dims[i], self.dp, self.tp)
        return self.elem_bytes * max((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks)

    def weight(self, i: int) -> float:
        """Task ``i``'s time on its owner: its compute, and receiving its rows and sending its
        update rows back (at most all of them)."""
        return self.compute_s[i] + 2 * self.full_bytes(i) / self.link.busbw

    def shareable(self, i: int) -> bool:
        """Whether task ``i`` may be shared by a pair: a matrix of an optimizer whose
        Newton–Schulz is shared by its Gram (Muon, NorMuon), at least two ranks, both sides
        at least two long."""
        t = self.tasks[i]
        return (t.optimizer == "matrix" and self.ranks >= 2 and self.settings.spec.gram_shared
                and min(t.shape) >= SHARE_K)

    def blocks(self, i: int, k: int = 2) -> tuple[int, ...]:
        """:func:`block_bounds` of task ``i``."""
        return block_bounds(self.tasks[i].shape, k)

    def piece_s(self, i: int, k: int = 2) -> float:
        """One member's seconds of task ``i`` shared by ``k`` adjacent ranks: its block's
        Newton–Schulz and the Gram's collectives they do not hide
        (``sharing.pieces.shared_piece`` on the link k ranks span)."""
        key = (self.tasks[i].shape, k)
        got = self._pieces.get(key)
        if got is None:
            m, n = max(self.tasks[i].shape), min(self.tasks[i].shape)
            piece = shared_piece("dp", k, False, m, n, self.settings.ns_steps, NS_BYTES,
                                 self.hardware.link(k), rate=profile_rate(self.hardware))
            got = self._pieces[key] = piece.alone_s(profile_rate(self.hardware))
        return got

    def piece_weight(self, i: int, k: int = 2) -> float:
        """:meth:`weight` of one member's piece: its seconds, and receiving its block and
        sending its update back."""
        return self.piece_s(i, k) + 2 * self.full_bytes(i) / k / self.link.busbw

    def moved(self, i: int, dests: Sequence[tuple[int, int, int]]
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """:func:`gather_bytes` of task ``i``."""
        return gather_bytes(self.tasks[i].shape, self.split_dims[i], self.dp, self.tp,
                            self.elem_bytes, tuple(dests))


def block_bounds(shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The k + 1 boundaries of a matrix's blocks along its long dimension (rows of a tall
    matrix, columns of a wide one), ``ceil(long / k)`` each: what each of k ranks sharing it
    computes."""
    long = max(shape)
    each = -(-long // k)
    return tuple(min(j * each, long) for j in range(k + 1))


@lru_cache(maxsize=1 << 14)
def gather_bytes(shape: tuple[int, ...], split_dim: int | None, dp: int, tp: int,
                 elem_bytes: int, dests: tuple[tuple[int, int, int], ...]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A matrix's gather to ``dests`` (per destination: its rank and the block [b0, b1) of the
    long dimension it computes: rows of a tall matrix, columns of a wide one) from the blocks
    the dp × tp ranks hold (``formulas.fsdp2_block``; rank d·tp + t): per rank the bytes it
    sends, and the bytes each rank receives. A rank keeps what it holds of its own block; of a
    matrix replicated over TP, the copy on the destination's TP rank is sent."""
    rows, cols = shape
    tall = rows >= cols
    ranks = dp * tp
    sent, received = [0] * ranks, [0] * ranks
    for r, (r0, r1, c0, c1) in enumerate(fsdp2_blocks(shape, split_dim, dp, tp)):
        if r0 == r1 or c0 == c1:
            continue
        for o, b0, b1 in dests:
            if r == o or (split_dim is None and r % tp != o % tp):
                continue
            if tall:
                part = (min(r1, b1) - max(r0, b0)) * (c1 - c0)
            else:
                part = (r1 - r0) * (min(c1, b1) - max(c0, b0))
            if part > 0:
                sent[r] += part * elem_bytes
                received[o] += part * elem_bytes
    return tuple(sent), tuple(received)


def make_fsdp2_problem(spec: ModelSpec, dp: int, settings: OptimizerSettings, *,
                       hardware: HardwareProfile, comm_dtype: str | None = None,
                       cmax_bytes: int = 512 << 20, tp: int = 1) -> FSDP2Problem:
    """The FSDP2 problem of ``spec`` at ``dp`` ranks (with ``tp`` > 1: a dp × tp mesh, TP
    splitting the parameters as their ``tp_layout`` says, FSDP2 the TP-local rows).
    ``comm_dtype``: the rows' dtype on the wire; by default :func:`wire_dtype`.

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
    comm_dtype = comm_dtype or wire_dtype(settings)
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
    layouts = {p.name: p.tp_layout for p in spec.params}
    dims = tuple(None if tp == 1 else SPLIT_DIMS[layouts[t.param]] for t in tasks)
    link = hardware.link(dp * tp)  # the all-to-alls span the whole mesh
    name = "intra_node" if link is hardware.intra_node else "inter_node"
    return FSDP2Problem(spec, settings, dp, tp, dims, tasks, costs, compute, comm_dtype,
                        ELEMENT_BYTES[comm_dtype], hardware, name, link, cmax_bytes)


#: The dimension TP shards of each TP layout (``inventory.TPLayout``): column-parallel and
#: fused layouts by rows (torchtitan's ``ColwiseParallel``, the embedding's vocabulary),
#: row-parallel by columns; None: replicated.
SPLIT_DIMS: dict[str, int | None] = {"column": 0, "qkv": 0, "gate_up": 0, "vocab": 0,
                                     "row": 1, "replicated": None}


def wire_dtype(settings: OptimizerSettings) -> str:
    """The dtype the rows travel in: an optimizer whose state is elementwise in the rows
    (``OptimizerSpec.local_state``: Muon) sends the Newton–Schulz inputs, which its kernel
    casts to the Newton–Schulz dtype first (bf16 by default; the runtime sends them in the
    dtype it runs); the others send FSDP2's fp32 gradients."""
    return "bf16" if settings.spec.local_state else "fp32"


@dataclasses.dataclass(frozen=True)
class FSDP2Solution:
    """Owners and rounds of a strategy, and the modelled step.

    Attributes:
        owners: matrix task id → its DP rank (a shared task: its first member; ``sync``: every
            rank computes every matrix, the owners are unused).
        rounds: per round, its task ids in order.
        step_s: the modelled step of the matrices (:func:`round_timeline`).
        bound_s: a lower bound on that step for any owners, pairs and rounds
            (:func:`step_bound`).
        shared: task id → the adjacent ranks that share it (each computes its block of the
            long dimension, :meth:`FSDP2Problem.blocks`).
    """

    strategy: str
    owners: dict[int, int]
    rounds: tuple[tuple[int, ...], ...]
    step_s: float
    bound_s: float
    shared: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def places(self) -> dict[int, tuple[int, ...]]:
        """Task id → the ranks that compute it."""
        return _places(self.owners, self.shared)

    def loads(self, problem: FSDP2Problem) -> list[float]:
        """Per rank (dp · tp), the weight of the matrices and pieces it computes
        (:meth:`FSDP2Problem.weight`, :meth:`FSDP2Problem.piece_weight`)."""
        out = [0.0] * problem.ranks
        for i, ranks in self.places.items():
            w = problem.weight(i) if len(ranks) == 1 else problem.piece_weight(i, len(ranks))
            for r in ranks:
                out[r] += w
        return out


def _places(owners: dict[int, int], shared: dict[int, tuple[int, ...]] | None
            ) -> dict[int, tuple[int, ...]]:
    shared = shared or {}
    return {i: shared.get(i, (o,)) for i, o in owners.items()}


# -- owners -------------------------------------------------------------------------------------


def longest_first(ids: Sequence[int], weight: Sequence[float] | dict[int, float], ranks: int,
                  *, base: Sequence[float] | None = None) -> dict[int, int]:
    """Longest-first (LPT): the heaviest task first, each on the least loaded rank (ties: the
    lowest rank; equal weights: the lower id first), from the loads ``base`` (default 0)."""
    loads = list(base) if base is not None else [0.0] * ranks
    owners: dict[int, int] = {}
    for i in sorted(ids, key=lambda i: (-weight[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += weight[i]
    return owners


def pair_places(ids: Sequence[int], weight: dict[int, float], ranks: int
                ) -> tuple[dict[int, tuple[int, int]], list[float]]:
    """Shared tasks on adjacent pairs (2s, 2s + 1), longest-first (a piece on each member);
    and the per-rank loads they leave."""
    loads = [0.0] * ranks
    out: dict[int, tuple[int, int]] = {}
    pairs = [(2 * s, 2 * s + 1) for s in range(ranks // SHARE_K)]
    for i in sorted(ids, key=lambda i: (-weight[i], i)):
        a, b = min(pairs, key=lambda ab: (max(loads[ab[0]], loads[ab[1]]), ab))
        out[i] = (a, b)
        loads[a] += weight[i]
        loads[b] += weight[i]
    return out, loads


def refine(owners: dict[int, int], weight: dict[int, float], ranks: int, *,
           base: Sequence[float] | None = None, rounds: int = 2000) -> dict[int, int]:
    """Moves and swaps that lower the busiest rank's load, until none does (or ``rounds``
    improvements): a task of the busiest rank moves to the least loaded rank where that lowers
    the pair's larger load, else swaps with a lighter task of another rank that does. ``base``:
    loads the tasks sit on (pieces of shared tasks), which do not move."""
    owners = dict(owners)
    loads = list(base) if base is not None else [0.0] * ranks
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


def _item(problem: FSDP2Problem, i: int, ranks: tuple[int, ...]) -> tuple[float, int]:
    """(compute seconds, whole-matrix bytes held) of task ``i`` on each of ``ranks``."""
    if len(ranks) == 1:
        return problem.compute_s[i], problem.full_bytes(i)
    k = len(ranks)
    return problem.piece_s(i, k), -(-problem.full_bytes(i) // k)


def capped_rounds(problem: FSDP2Problem, places: dict[int, tuple[int, ...]]
                  ) -> tuple[tuple[int, ...], ...]:
    """The rounds of the shortest modelled step (:func:`round_timeline`; ties: fewer rounds):
    K from the fewest that keep every rank's matrices and pieces of a round within ``C_max``
    (one larger than it alone) to the most a rank computes (every count up to 8 above the
    fewest, then a quarter more at a time), dealt onto the K rounds by :func:`deal_rounds`.
    More rounds hide more of the gathers behind compute and cost a latency each."""
    held = _held(problem, places)
    least = max(_rounds_needed([_item(problem, i, places[i])[1] for i in ids],
                               problem.cmax_bytes) for ids in held)
    most = max(least, max(len(ids) for ids in held))
    counts = list(range(least, min(most, least + 8) + 1))
    while counts[-1] < most:
        counts.append(min(most, max(counts[-1] + 1, counts[-1] * 5 // 4)))
    best: tuple[float, tuple[tuple[int, ...], ...]] | None = None
    for count in counts:
        rounds = deal_rounds(problem, places, count)
        t = round_timeline(problem, places, rounds)
        if best is None or t < best[0] - 1e-12:
            best = (t, rounds)
    assert best is not None
    return best[1]


def _held(problem: FSDP2Problem, places: dict[int, tuple[int, ...]]) -> list[list[int]]:
    held: list[list[int]] = [[] for _ in range(problem.ranks)]
    for i, ranks in sorted(places.items()):
        for r in ranks:
            held[r].append(i)
    return held


def deal_rounds(problem: FSDP2Problem, places: dict[int, tuple[int, ...]], count: int
                ) -> tuple[tuple[int, ...], ...]:
    """Every rank's matrices and pieces onto ``count`` rounds: each round's compute alike
    across ranks, none over ``C_max`` where the matrices allow. A shared task's members take
    it in the same round (they compute it together), placed first; then each rank's whole
    matrices, longest-first into its round of least compute that has room. A round lists its
    tasks by first rank, then id; empty rounds are dropped."""
    cap = problem.cmax_bytes
    compute = [[0.0] * count for _ in range(problem.ranks)]
    used = [[0] * count for _ in range(problem.ranks)]
    rounds: list[list[int]] = [[] for _ in range(count)]

    def put(i: int, ranks: tuple[int, ...]) -> None:
        c, b = _item(problem, i, ranks)
        fits = [k for k in range(count) if all(used[r][k] + b <= cap for r in ranks)]
        pick = (lambda k: (max(compute[r][k] for r in ranks), k))
        k = (min(fits, key=pick) if fits
             else min(range(count), key=lambda k: (max(used[r][k] for r in ranks), k)))
        rounds[k].append(i)
        for r in ranks:
            compute[r][k] += c
            used[r][k] += b

    order = sorted(places, key=lambda i: (len(places[i]) == 1,
                                          -_item(problem, i, places[i])[0], i))
    for i in order:
        put(i, places[i])
    return tuple(tuple(sorted(r, key=lambda i: (places[i][0], i))) for r in rounds if r)


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


# -- the modelled step --------------------------------------------------------------------------


def round_traffic(problem: FSDP2Problem, places: dict[int, tuple[int, ...]],
                  tasks: Sequence[int]) -> tuple[list[int], list[int], list[int], list[float]]:
    """A round's per-rank gathered whole-matrix (or block) bytes, bytes sent and received in
    its gather, and compute seconds."""
    dp = problem.ranks
    gathered, sent, received, compute = [0] * dp, [0] * dp, [0] * dp, [0.0] * dp
    for i in tasks:
        ranks = places[i]
        b = problem.blocks(i, len(ranks))
        out, into = problem.moved(i, [(o, b[j], b[j + 1]) for j, o in enumerate(ranks)])
        c, held = _item(problem, i, ranks)
        for r in range(dp):
            sent[r] += out[r]
            received[r] += into[r]
        for j, o in enumerate(ranks):
            gathered[o] += (problem.full_bytes(i) if len(ranks) == 1 else
                            (b[j + 1] - b[j]) * min(problem.tasks[i].shape) * problem.elem_bytes)
            compute[o] += c
    return gathered, sent, received, compute


def round_timeline(problem: FSDP2Problem, places: dict[int, tuple[int, ...]],
                   rounds: Sequence[Sequence[int]]) -> float:
    """The matrices' step, rounds pipelined as the runtime issues them.

    Each rank runs, for round k: issue the gather of round k + 1, wait for round k's gather,
    compute round k, issue round k's return. The collectives run one at a time in issue order
    (G0, G1, R0, G2, R1, …), each once every rank has issued it, for the α–β time of its
    busiest rank; the step ends when the last return does. A shared task's members compute it
    together in its round (its Gram's collectives are in its pieces' seconds)."""
    if not rounds:
        return 0.0
    dp, link = problem.ranks, problem.link
    comm, compute = [], []
    for tasks in rounds:
        _, sent, received, c = round_traffic(problem, places, tasks)
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
    """A lower bound on the matrices' step for any owners, pairs and rounds, the largest of:

    * the busiest rank's compute: at least the mean of the matrices' compute (a shared piece
      does no less than its share of the whole) and, for every matrix, the least of computing
      it whole and one piece of it;
    * any one matrix, whole or shared: its owner receives all its rows (its block's) but its
      own, computes, then sends the update back, one after the other;
    * the channel's busy time: every byte some rank must receive, and send back, twice over
      (per rank at least the mean);

    with one gather latency before and one return latency after."""
    ids = problem.matrices
    if not ids:
        return 0.0
    link, dp = problem.link, problem.ranks
    alpha = 2 * link.latency_s
    own_rows = problem.most_held

    least = {i: max(0, problem.full_bytes(i) - own_rows(i)) for i in ids}
    whole = {i: problem.compute_s[i] + 2 * least[i] / link.busbw for i in ids}
    piece = {i: problem.piece_s(i) + 2 * max(0, problem.full_bytes(i) // SHARE_K - own_rows(i))
             / link.busbw for i in ids if problem.shareable(i)}
    one = max(min(whole[i], piece.get(i, whole[i])) for i in ids)
    compute = max(sum(problem.compute_s[i] for i in ids) / dp,
                  max(min(problem.compute_s[i], problem.piece_s(i) if i in piece
                          else problem.compute_s[i]) for i in ids))
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
        owners = longest_first(ids, flops, problem.ranks)
        rounds = _one_per_rank(owners, flops, problem.ranks)
        return FSDP2Solution(strategy, owners, rounds,
                             round_timeline(problem, _places(owners, None), rounds), bound)
    best = _placed(problem, frozenset(), bound)
    classes = _share_classes(problem)
    for group in classes:  # heaviest shapes first, each kept where it helps
        tried = _placed(problem, best[0] | group, bound)
        if tried[1].step_s < best[1].step_s - 1e-12:
            best = tried
    every = frozenset().union(*classes) if classes else frozenset()
    if every and every != best[0]:  # pieces help together what they do not one class at a time
        tried = _placed(problem, every, bound)
        if tried[1].step_s < best[1].step_s - 1e-12:
            best = tried
    return best[1]


def _placed(problem: FSDP2Problem, shared_ids: frozenset[int], bound: float
            ) -> tuple[frozenset[int], FSDP2Solution]:
    """canzona's owners and rounds with ``shared_ids`` shared by adjacent pairs: the pairs
    placed longest-first, the whole matrices longest-first beside them and refined, the rounds
    of the shortest step."""
    ids = [i for i in problem.matrices if i not in shared_ids]
    pieces = {i: problem.piece_weight(i) for i in shared_ids}
    pairs, base = pair_places(sorted(shared_ids), pieces, problem.ranks)
    weight = {i: problem.weight(i) for i in ids}
    owners = refine(longest_first(ids, weight, problem.ranks, base=base), weight,
                    problem.ranks, base=base)
    owners.update({i: ab[0] for i, ab in pairs.items()})
    shared = {i: tuple(ab) for i, ab in pairs.items()}
    places = _places(owners, shared)
    rounds = capped_rounds(problem, places)
    return shared_ids, FSDP2Solution("canzona", owners, rounds,
                                     round_timeline(problem, places, rounds), bound,
                                     shared)


def _share_classes(problem: FSDP2Problem) -> list[frozenset[int]]:
    """The shareable matrices by shape, heaviest first: sharing a heavy matrix shortens its
    rank, and sharing lighter ones gives the rounds finer pieces to hide the gathers behind."""
    ids = [i for i in problem.matrices if problem.shareable(i)]
    if problem.ranks < SHARE_K or not ids:
        return []
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i in ids:
        by_shape.setdefault(problem.tasks[i].shape, []).append(i)
    return [frozenset(v) for _, v in sorted(by_shape.items(),
                                            key=lambda kv: (-problem.weight(kv[1][0]), kv[0]))]


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
    link, dp = problem.link, problem.ranks
    gather = sum(link.seconds(problem.full_bytes(i) * (dp - 1) / dp) for i in ids)
    return gather + sum(problem.compute_s[i] for i in ids)
