"""The step simulator: what one optimizer step of a plan costs on a cluster, rank by rank.

Torch-free. Two layers, a module each:

* **Plain data** (:class:`Workload`, in :mod:`.engine` with :func:`simulate` and the iteration
  model): per global rank the seconds of its local optimizer work, per DP bucket its collective
  times and the DP indices that join it, per DP index its TP micro-groups (gather / per-rank compute
  / scatter seconds). Anything that can say what a strategy does — a plan
  (:func:`workload_from_plan`), or a baseline built by hand (layer-wise, ``sc``, …) — is simulated
  by the same :func:`simulate`.
* **The adapter** :func:`workload_from_plan` (:mod:`.from_plan`) turns a
  :class:`~canzona.planner.plan.Plan` and a :class:`~canzona.planner.hardware.HardwareProfile` into
  a workload: bucket collectives from :mod:`canzona.planner.comm` under the bucket's recorded
  ``method`` (α–β, the DP link of :func:`~canzona.planner.comm.plan_link`), TP all-to-alls from the
  micro-groups' element matrices (the TP link is ``hw.link(tp)``: NVLink when tp ≤ gpus_per_node),
  compute as each task's :class:`~canzona.planner.cost.Roofline` time, the same function the
  ``roofline`` cost model balances: its FLOPs at ``peak[dtype] · compute_efficiency`` (matrix
  work and AdamW in ``bf16`` unless told) or its kernels' bytes over ``memory_bandwidth``,
  whichever is longer, plus its element-wise passes over ``memory_bandwidth``
  (``formulas.*_PASSES``; AdamW's ``ADAMW_BYTES_PER_ELEMENT``). A shared piece takes its own
  FLOPs and its share of the task's memory time.

The model (a small deterministic event simulation; times in seconds, 0 = start of backward):

1. **Backward and the reduces.** Backward lasts ``backward_s``. A bucket's gradients are complete
   when backward has gone through its part of the buffer: buffers are laid out in reverse layer
   order, so bucket k of a buffer of S elements is ready at ``backward_s · end_k / S``. Each DP
   index has one DP communication stream; buckets are issued in ready order (ties: buffer, bucket)
   and a collective starts when it is ready and every joining index's stream is free (collectives
   are synchronous), then takes its α–β time. What ends before ``backward_s`` is hidden behind
   backward; the rest is the exposed ``dp_reduce``.
2. **The step** of DP index d starts when backward has ended and its reduces are done (the
   optimizer waits for all of them). On every TP rank of d, in the plan's group order: the gather
   all-to-all of group 0 starts; group k's compute on rank t starts when its gather has ended and
   t's compute stream is free; group k+1's gather is issued as soon as every rank has started
   group k's compute (it overlaps that compute); group k's scatter follows on the TP stream once
   every rank has finished group k (all-to-alls are synchronous over the TP group). This is the
   pipeline of :mod:`canzona.planner.tp.schedule`, with per-rank compute instead of the busiest
   rank's (equal to its ``modelled_s`` when the busiest rank is the same in every group). After
   its last group the rank computes its owned whole matrices (not TP-split) and its AdamW
   slices; it is done when that compute and the last scatter have ended.
3. **The all-gathers** of TP rank t's DP group start when every rank (·, t) that joins them is done,
   one after another in forward order (reverse of the reduce order). The parameters are ready at
   the last one's end. With ``overlap_param_gather`` they run into the next forward: only the part
   longer than ``forward_s`` is charged to the step.

Totals: the optimizer step is the time from the end of backward to the parameters ready on every
rank; the critical rank is the one done last (the all-gathers then wait for it; ties, to the
nanosecond: the one computing the most, then the lowest global rank). Its breakdown —
``dp_reduce`` (exposed), ``compute`` (the critical rank's compute seconds), ``tp_gather_scatter``
(its step span not spent computing: exposed TP all-to-alls and waiting for the TP group),
``dp_gather`` (exposed) — sums to the step time. Vocabulary padding makes the embedding and
output layer's AdamW slices a little larger than the logical shapes (the update runs on them).

What overlaps what (:meth:`StepSim.hidden`, and every rank's stages by stream in
:meth:`StepSim.rank_timeline`): the reduces with backward; the TP gather of group k+1 and the
scatter of group k with the compute of groups k and k+1; the all-gathers with the next forward
(``overlap_param_gather`` only). Compute, the DP stream and the TP stream run concurrently.

Iteration: :func:`forward_backward_seconds` is ``6 · N_active · tokens`` at a stated MFU, split
1 : 2 into forward and backward (:func:`split_forward_backward`); :func:`iteration_time` adds
the step's exposed time (simulate the step with that ``backward_s`` and ``forward_s``).

Pipeline stages (:mod:`.stages`): a 1F1B schedule played out microbatch by microbatch, each
stage's step simulated behind its own last backward; the iteration ends with the slowest stage's.

Not modelled: contention between the DP and TP streams or with backward's own kernels, NCCL's
coalescing of per-root calls (each pays α, as in ``comm``), launch overheads, caches (every
pass reads and writes memory).
Deterministic: no randomness, fixed iteration orders, floats rounded to nanoseconds on output.
"""

from .engine import (ROUND, BucketWork, GroupWork, RankSim, RankWork,
                     Stage, StepSim, Workload, forward_backward_seconds, iteration_time,
                     simulate, split_forward_backward)
from .from_plan import (DEFAULT_MFU, DEFAULT_SEQ, active_params, plan_forward_backward,
                        plan_hardware, simulate_plan, simulate_plan_behind, workload_from_plan)
from .stages import (MICROBATCHES_PER_STAGE, PipelineSim, one_f_one_b, pipeline_iteration,
                     simulate_pipeline)

__all__ = ["DEFAULT_MFU", "DEFAULT_SEQ", "MICROBATCHES_PER_STAGE", "ROUND", "BucketWork",
           "GroupWork", "PipelineSim", "RankSim", "RankWork", "Stage", "StepSim", "Workload",
           "active_params", "forward_backward_seconds", "iteration_time", "one_f_one_b",
           "pipeline_iteration", "plan_forward_backward", "plan_hardware", "simulate",
           "simulate_pipeline", "simulate_plan", "simulate_plan_behind",
           "split_forward_backward", "workload_from_plan"]
