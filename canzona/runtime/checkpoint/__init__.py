"""Optimizer checkpoints, in two kinds.

* :mod:`~canzona.runtime.checkpoint.sharded`: ``CanzonaOptimizer.state_dict()`` — this rank's
  state under this plan; it loads only under the same plan and DP rank.
* Logical checkpoints, which load under any other plan of the same model:
  :mod:`~canzona.runtime.checkpoint.mapping` (where a rank's pieces sit in the canonical tensors),
  :mod:`~canzona.runtime.checkpoint.pieces` (those boxes as DCP's write items and planners),
  :mod:`~canzona.runtime.checkpoint.keys` (the logical keys and one rank's entries under them),
  :mod:`~canzona.runtime.checkpoint.dcp` (``canzona.dcp_state`` and the checks before a load) and
  :mod:`~canzona.runtime.checkpoint.files` (``canzona.save_checkpoint`` /
  ``canzona.load_checkpoint``: crash-safe directories).
"""
