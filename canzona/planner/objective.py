"""The planner's one objective, every solver's judge.

::

    score(cuts) = F(per-DP-index vectors: load, FLOPs, state bytes, reduce-scatter bytes)
                + Σ over buckets b  g_b(slice sizes of b),      g_b(s) = Σ_r h_b(s_r)

F looks at what each DP index carries (:class:`~canzona.planner.planning.Evaluation`); g at
what each bucket's collectives move, slice by slice (``h_b``, :meth:`Objective.slice_term`).
g is separable over the slices of a bucket, so the exact per-bucket DP (``dp.polish``) adds
``h_b(s_r)`` to the cost of giving rank r a slice of ``s_r`` elements and stays exact for its
sum-type phases; CP-SAT (``dp.cpsat``) gets a linear form of each part
(:meth:`Objective.cpsat_index_term`, :meth:`Objective.cpsat_slice_term`), and the joint
DP × TP refinement judges per GPU with the same g (:meth:`Objective.gpu_score`).

The search itself balances F's per-index scalar, the cost model's load (a task's load is its
FLOPs or its element count: ``cost.make_cost_model``); F is the maximum of it. Today's objective
is exactly that: F = max load, g = 0 (:data:`MAX_LOAD`). A new term — communication time per
bucket, an optimizer-state ceiling — is a subclass overriding these methods, passed as
``DPOptions(objective=...)``; every DP solver accepts or rejects cuts through :meth:`score`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import comm
from .hardware import HardwareProfile
from .planning import BucketProblem, Cuts, DPProblem, Evaluation, evaluate


class Objective:
    """F = max load over DP indices, g = 0; subclass to add terms (see the module docstring)."""

    name = "max-load"
    #: True when :meth:`slice_term` is not identically zero (solvers skip g otherwise).
    has_bucket_term = False
    #: True when :meth:`state_term` is not identically zero (the per-bucket DP then tracks
    #: every DP index's optimizer-state bytes and tries state-balancing cuts).
    has_state_term = False

    # --- F: the per-DP-index term -----------------------------------------------------------

    def index_term(self, ev: Evaluation) -> float:
        """F: the busiest DP index's load (through :meth:`load_term`)."""
        return self.load_term(max(ev.load))

    def load_term(self, max_load: float) -> float:
        """What a busiest load of ``max_load`` costs (itself, unless a subclass bounds it)."""
        return max_load

    def slice_caps(self, problem: DPProblem, bucket: BucketProblem) -> list[float]:
        """Largest slice sizes (elements) the per-bucket DP also tries, for g's max-type parts
        (none here)."""
        return []

    #: A bound on the busiest DP index's load the solvers keep to (None: none).
    load_ceiling: float | None = None

    def state_term(self, max_state: float) -> float:
        """What a busiest optimizer state of ``max_state`` bytes costs, in load units (0)."""
        return 0.0

    def state_grain(self, problem: DPProblem) -> float | None:
        """Target state bytes of one piece of a divisible item (None: cut by load only)."""
        return None

    def cpsat_index_term(self, model: Any, index_loads: Sequence[Any], upper: int) -> Any:
        """F's CP-SAT form over the scaled per-index load expressions: a variable M ≥ each
        index's load (what the model minimises, plus g's terms)."""
        m = model.new_int_var(0, upper, "max_load")
        for expr in index_loads:
            model.add(m >= expr)  # M is at least every DP index's load.
        return m

    # --- g: the per-bucket term, separable over its slices --------------------------------------

    def slice_term(self, problem: DPProblem, bucket: BucketProblem,
                   size: np.ndarray | int) -> np.ndarray | float:
        """h_b(s): the cost of one slice of ``size`` elements of ``bucket`` (elementwise on an
        array of sizes), in load units. Zero today."""
        return np.zeros_like(size, dtype=float) if isinstance(size, np.ndarray) else 0.0

    def cpsat_slice_term(self, model: Any, problem: DPProblem, bucket: BucketProblem,
                         size: Any, unit_load: float) -> Any | None:
        """h_b's CP-SAT form for the slice-size expression ``size`` (scaled by ``unit_load`` load
        units per model unit), or None when h_b is zero."""
        return None

    def bucket_term(self, problem: DPProblem, bucket: BucketProblem,
                    sizes: Sequence[int]) -> float:
        """g_b(sizes) = Σ_r h_b(s_r)."""
        if not self.has_bucket_term:
            return 0.0
        return float(np.sum(self.slice_term(problem, bucket, np.asarray(sizes, dtype=np.int64))))

    def bucket_terms(self, problem: DPProblem, cuts: Cuts) -> float:
        """Σ over buckets g_b of their slices under ``cuts``."""
        if not self.has_bucket_term:
            return 0.0
        total = 0.0
        for b in problem.buckets:
            c = cuts[(b.buffer, b.bucket)]
            total += self.bucket_term(problem, b, [y - x for x, y in zip(c, c[1:])])
        return total

    # --- the whole score ------------------------------------------------------------------------

    def score(self, problem: DPProblem, cuts: Cuts, ev: Evaluation | None = None) -> float:
        """F + Σ_b g_b for ``cuts`` (an int for today's objective: the max load)."""
        ev = ev or evaluate(problem, cuts)
        f = self.index_term(ev)
        return f + self.bucket_terms(problem, cuts) if self.has_bucket_term else f

    def gpu_score(self, index_gpu_max: Sequence[float], problem: DPProblem, cuts: Cuts) -> float:
        """Under TP: F on the busiest GPU of every DP index (``tp.index_gpu_max``), plus g."""
        f = self.load_term(max(index_gpu_max))
        return f + self.bucket_terms(problem, cuts) if self.has_bucket_term else f


#: Today's objective: the busiest DP index's load, nothing per bucket.
MAX_LOAD = Objective()


class StepTime(Objective):
    """The default: the predicted optimizer step, in load units — the busiest DP index's
    compute plus, per bucket, the predicted time of its collectives under the fastest method
    (:mod:`canzona.planner.comm`), so the solvers themselves weigh a nearly even layout with the
    stock collectives against a balanced one that needs per-root calls.

    Seconds become load units at the problem's own rate (its total compute time under the
    hardware profile over its tasks' loads, the same with shared pieces or without).
    ``ceiling`` bounds the compute: a max load above it costs :data:`OVER_CEILING` times the
    excess, so the communication terms never buy more than the allowed growth of the compute
    gap.

    The per-bucket DP sees the separable part of a bucket's time, the per-call latency of the
    per-root calls (2α for every non-empty slice: a reduce and a broadcast), and, through
    :meth:`slice_caps`, the largest slice at which padding to it costs no more than per-root
    calls; :meth:`bucket_term` is the whole predicted time, which decides.
    """

    name = "step-time"
    has_bucket_term = True

    def __init__(self, problem: DPProblem, hardware: HardwareProfile, *,
                 ceiling: float | None = None, state_cap: float | None = None) -> None:
        # the tasks' own loads (``problem.total`` also counts shared pieces' exchanges, or per
        # TP rank for a TP pair's halves): one rate for a problem with or without pieces, so
        # the modelled steps of the two compare
        seconds = sum(hardware.seconds(c.flops) for c in problem.costs)
        base = sum(problem.loads)
        self.seconds_per_load = seconds / base if base else 1.0
        _, self.link = comm.plan_link(hardware, problem.sizes.dp, problem.sizes.tp)
        self.ceiling = self.load_ceiling = ceiling
        self.state_cap = state_cap
        state = sum(c.state_bytes for c in problem.costs)
        # State over the cap by a fraction x of the cap costs STATE_WEIGHT · x mean loads.
        mean_load = problem.total / problem.dp
        self._state_weight = (STATE_WEIGHT * mean_load / state_cap
                              if state_cap and state else 0.0)
        self.has_state_term = state_cap is not None and state > 0
        self._bytes = [(comm.ELEMENT_BYTES[buf.grad_dtype], comm.ELEMENT_BYTES[buf.dtype])
                       for buf in problem.layout.buffers]
        self._cache: dict[tuple[int, tuple[int, ...]], float] = {}

    def to_load(self, seconds: float) -> float:
        return seconds / self.seconds_per_load

    def index_term(self, ev: Evaluation) -> float:
        return self.load_term(max(ev.load)) + self.state_term(max(ev.state_bytes))

    def state_term(self, max_state: float) -> float:
        if self.state_cap is not None and max_state > self.state_cap:
            return self._state_weight * (max_state - self.state_cap)
        return 0.0

    def state_grain(self, problem: DPProblem) -> float | None:
        """1/64 of the mean state per DP index."""
        if not self.has_state_term:
            return None
        return sum(c.state_bytes for c in problem.costs) / problem.dp / 64

    def load_term(self, max_load: float) -> float:
        if self.ceiling is not None and max_load > self.ceiling:
            return max_load + OVER_CEILING * (max_load - self.ceiling)
        return max_load

    def slice_term(self, problem: DPProblem, bucket: BucketProblem,
                   size: np.ndarray | int) -> np.ndarray | float:
        per_call = 2 * self.to_load(self.link.latency_s)
        if isinstance(size, np.ndarray):
            return np.where(size > 0, per_call, 0.0)
        return per_call if size > 0 else 0.0

    def bucket_term(self, problem: DPProblem, bucket: BucketProblem,
                    sizes: Sequence[int]) -> float:
        key = (bucket.buffer, tuple(map(int, sizes)))
        hit = self._cache.get(key)
        if hit is None:
            g, p = self._bytes[bucket.buffer]
            hit = self.to_load(comm.choose(key[1], grad_bytes=g, param_bytes=p,
                                           link=self.link).seconds)
            self._cache[key] = hit
        return hit

    def slice_caps(self, problem: DPProblem, bucket: BucketProblem) -> list[float]:
        """Largest slices worth trying: where padding every slice to the largest costs no more
        than per-root calls with every rank owning a slice, (R-1)·m·e ≤ S·e + 2(R-1)α·busbw,
        for e the reduce's and the gather's bytes together."""
        R = bucket.ranks
        if R < 2:
            return []
        g, p = self._bytes[bucket.buffer]
        S = bucket.end - bucket.start
        m = (S + 2 * (R - 1) * self.link.latency_s * self.link.busbw / (g + p)) / (R - 1)
        return [m] if m >= S / R else []

    def cpsat_slice_term(self, model: Any, problem: DPProblem, bucket: BucketProblem,
                         size: Any, unit_load: float) -> Any | None:
        return None  # CP-SAT balances the compute; the communication stage follows it

    def gpu_score(self, index_gpu_max: Sequence[float], problem: DPProblem, cuts: Cuts) -> float:
        """Under TP: the busiest GPU's load plus g (the ceiling bounds DP-index loads only)."""
        return max(index_gpu_max) + self.bucket_terms(problem, cuts)


#: A max load above the ceiling costs this many times its excess (a bound, in effect).
OVER_CEILING = 1e9
#: A busiest state above its cap by a fraction x of it costs STATE_WEIGHT · x mean loads:
#: after the load ceiling, ahead of the communication terms (a collective time is a few
#: mean loads at most).
STATE_WEIGHT = 1000.0


def objective_name(objective: object) -> str:
    """The name of ``DPOptions.objective`` (a name, an :class:`Objective`, or None for
    ``max-load``): what a plan records, and what the sharing candidates are judged by."""
    if isinstance(objective, str):
        return objective
    return getattr(objective, "name", "max-load") if objective is not None else "max-load"
