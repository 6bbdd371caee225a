"""Strategies side by side: every way to run the optimizer step, priced alike.

Torch-free. One registry (:mod:`.registry`) names the strategies and feeds both front ends:
``canzona compare`` simulates each one's workload (:mod:`.workloads`, :mod:`.compare`) and
``canzona inspect`` prints each one's DP and TP rows (:func:`baseline_rows`,
:func:`tp_baseline_rows`). The strategies, in table order:

* ``sc`` — synchronous compute, how DDP + Muon runs: every gradient bucket is all-reduced
  during backward (ring all-reduce, 2(R−1)/R·S per rank) and every DP rank updates every
  parameter; a TP-split matrix is first all-gathered over the TP group and computed whole on every
  TP rank (Megatron's TP Muon ``duplicated`` mode), one matrix at a time. No all-gather after.
* ``zero1`` — ZeRO-1's equal chunks, the optimizer applied to each rank's fragments (every
  TP rank its own shard of them): **not the exact optimizer** (a split matrix is orthogonalised
  in pieces); shown for scale only.
* ``asc`` (``inspect`` only) — ZeRO-1's equal chunks, each matrix computed whole by the rank
  holding its start.
* ``layerwise`` — megatron-core 0.16.1's ``LayerWiseDistributedOptimizer``: the gradients
  all-reduced as in ``sc``; whole parameters dealt to DP ranks as its ``shard_params`` deals them
  (:func:`~canzona.planner.baselines.megatron_layerwise`: ascending local size, ping-pong; the
  all-reduced parameters over the DP group, the expert-parallel ones over their expert-DP groups);
  TP-split matrices ``duplicated`` on the owner's TP ranks; then one uneven all-gather per group of
  the parameters each rank was dealt, which NCCL runs as one broadcast per root (``gather_method``;
  ``padded`` is what gloo, without uneven all-gather, runs instead). Per iteration it moves
  all-reduce + all-gather ≈ 1.5× ZeRO-1's bytes.
* ``layerwise-lpt`` — the same with the parameters dealt by LPT on max(m,n)·min(m,n)² of the
  TP-local shape (:func:`~canzona.planner.baselines.layerwise_lpt`), a proxy of their cost
  that can balance the real cost worse than ``layerwise``.
* ``megatron-packed`` — Megatron's 2026 shard-aligned layer-wise layout
  (:func:`~canzona.planner.baselines.megatron_packed`): its own padded buckets, the stock even
  reduce-scatter and all-gather, whole matrices per shard, TP-split matrices ``duplicated``.
* ``canzona-greedy`` — the paper's method: α-balanced greedy cuts (α = 1) and the TP greedy
  micro-groups, each bucket moved by the method the communication model picks.
* ``canzona`` — the planner's default plan (or the one given).

The canzona rows are simulated from their plans
(:func:`~canzona.planner.simulate.workload_from_plan`); the others are built from the same
:class:`~canzona.planner.planning.DPProblem` with the same compute, AdamW and link formulas.
"""

from .registry import (CANZONA, CANZONA_GREEDY, DESCRIPTIONS, EXACT, REGISTRY, STRATEGIES,
                       Strategy, baseline_rows, strategy_workload, tp_baseline_rows)
from .compare import (Comparison, PipelineComparison, StrategyRun, compare, compare_pipeline,
                      compare_plan, compare_problem)

__all__ = ["CANZONA", "CANZONA_GREEDY", "DESCRIPTIONS", "EXACT", "REGISTRY", "STRATEGIES",
           "Comparison", "PipelineComparison", "Strategy", "StrategyRun", "baseline_rows",
           "compare", "compare_pipeline", "compare_plan", "compare_problem", "strategy_workload",
           "tp_baseline_rows"]
