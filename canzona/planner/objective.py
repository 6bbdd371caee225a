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

from .planning import BucketProblem, Cuts, DPProblem, Evaluation, evaluate


class Objective:
    """F = max load over DP indices, g = 0; subclass to add terms (see the module docstring)."""

    name = "max-load"
    #: True when :meth:`slice_term` is not identically zero (solvers skip g otherwise).
    has_bucket_term = False

    # --- F: the per-DP-index term -----------------------------------------------------------

    def index_term(self, ev: Evaluation) -> float:
        """F: the busiest DP index's load."""
        return max(ev.load)

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
        f = max(index_gpu_max)
        return f + self.bucket_terms(problem, cuts) if self.has_bucket_term else f


#: Today's objective: the busiest DP index's load, nothing per bucket.
MAX_LOAD = Objective()
