"""The plan file's one home.

* :mod:`.schema` — the pydantic schema and its atomic save (a leaf; re-exported here, so
  ``from canzona.planner.plan import Plan, save_plan`` is the schema and nothing more);
* :mod:`.load` — :func:`~canzona.planner.plan.load.load_plan` and
  :func:`~canzona.planner.plan.load.parse_plan`: every check a plan file gets;
* :mod:`.convert` — the chain of converters from older schema versions;
* :mod:`.structure`, :mod:`.checks`, :mod:`.tp_checks`, :mod:`.pair_checks` — the consistency
  checks (the fields against each other; the planner's formulas);
* :mod:`.inverse` — a plan read back as the problem it solves.

This package imports only the schema: the loader and the checks use the planner's machinery,
which itself imports the schema.
"""

from .schema import (BASE_VERSION, COMPACT_VERSION, DP_PAIR_VERSION, FSDP2_VERSION,
                     HEADS_VERSION, PIPELINE_VERSION, RECIPE_VERSION, SCHEMA_VERSION,
                     SUB_GROUP_VERSION, TP_PAIR_VERSION, TP_SHARE_VERSION, BucketPlan,
                     BufferPlan, CollectiveMethod, CommPlan, FSDP2Plan, FSDP2Section,
                     FSDP2SharedPlan, GroupTaskPlan, Metrics, MicroGroupPlan, PairTaskPlan,
                     PipelinePlan, Plan, PlanInputs, RankLayout, RoundPlan, ShardLayoutPlan,
                     SharedTaskPlan, SlotPlan, SolverOptions, StageInputs, SubGroupPlan,
                     TaskPlan, TPIndexPlan, TPMetrics, TPPlan, gc_paused, save_plan,
                     sub_round_problem, write_atomically)

__all__ = ["BASE_VERSION", "COMPACT_VERSION", "DP_PAIR_VERSION", "FSDP2_VERSION",
           "HEADS_VERSION", "PIPELINE_VERSION", "RECIPE_VERSION", "SCHEMA_VERSION",
           "SUB_GROUP_VERSION", "TP_PAIR_VERSION", "TP_SHARE_VERSION", "BucketPlan",
           "BufferPlan", "CollectiveMethod", "CommPlan", "FSDP2Plan", "FSDP2Section",
           "FSDP2SharedPlan", "GroupTaskPlan", "Metrics", "MicroGroupPlan", "PairTaskPlan",
           "PipelinePlan", "Plan", "PlanInputs", "RankLayout", "RoundPlan", "ShardLayoutPlan",
           "SharedTaskPlan", "SlotPlan", "SolverOptions", "StageInputs", "SubGroupPlan",
           "TaskPlan", "TPIndexPlan", "TPMetrics", "TPPlan", "gc_paused", "save_plan",
           "sub_round_problem", "write_atomically"]
