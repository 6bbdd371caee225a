"""Sharing: one matrix update computed by several ranks — a TP group, two DP indices (DP pairs,
tp = 1), the TP groups of two DP indices (TP pairs, k = 2·tp) — beyond whole-matrix ownership.

Modules, lowest first (each imports only those before it, and the planner below it: ``tp``,
``dp``, ``planning``, ``cost``, ``formulas``):

* ``pieces`` — one rank's piece of a shared Muon update over each group: FLOPs, collective
  seconds and what its own Gram products hide of them; every option a task has
  (``share_options``);
* ``prices`` — the two pieces of a pair-shared matrix priced in cost units (``PairShare``),
  on the link between its owners;
* ``blocks`` — Shampoo's blocks as pieces (block rows over a DP pair, TP shards that are
  whole blocks);
* ``bound`` — the atomic per-GPU bound and the bound with sharing (``sharing_bound``);
* ``decision`` — how a share mode reads (``ShareMode``) and which matrices it shares over a
  TP group, DP pairs or TP pairs (the one mode filter: ``chosen``);
* ``pairs`` — a problem with pair-shared matrices (``with_pairs``), its cuts, and each DP
  index's load with the waits between partners (``pair_waits``);
* ``search`` — the search both pair searches are: every matrix whole on an index or shared by
  fixed partners (2s, 2s + 1), changed off the busiest index while that lowers it;
* ``dp_search``, ``tp_search`` — the DP pair search (tp = 1) and the TP pair search (tp > 1);
  ``cpsat_start`` — the DP pair search's class-level CP-SAT start;
* ``rounds`` — rounds of TP sub-groups (tp/k alike matrices of one index, each shared by k
  strided TP ranks) priced, and a problem with them (``with_rounds``);
* ``patterns`` — the layout-free pattern model (CP-SAT): a start for the TP search, and the
  certified floor with any sharing option (``pattern_bound``); ``tp_start`` — that start;
* ``layout`` — a pair search's placement laid out in the buckets;
* ``candidates`` — the candidate plans of a share mode, solved, and the rule that keeps the
  best (``Candidates``, what ``pipeline.plan_problem`` runs).

The lockstep seconds of a batch of shared pieces (``lockstep_seconds``, ``Lockstep``) are the
TP schedule's as well and live in ``tp.context``.
"""

from .blocks import (block_pieces, block_row, piece_loads, shard_block_decision,
                     shard_blocks_aligned)
from .bound import SharedTask, SharingReport, sharing_bound
from .candidates import (Candidate, Candidates, bundle_candidates, bundle_pairs,
                         tp_bundle_candidate, tp_pair_candidates)
from .decision import (ShareMode, block_decision, chosen, dp_pair_sets, kind_of, pair_decision,
                       share_decision, tp_pair_decision, tp_share_sets)
from .dp_search import PairSearch
from .pairs import pair_timeline, pair_waits, pairs_in_nodes, pieces_apart, with_pairs
from .pieces import (DP_GROUP_SIZES, Group, ShareOption, gram_pipeline, profile_rate,
                     share_options, shared_piece, tp_pair_piece, tp_sub_piece)
from .patterns import PatternBound, pattern_bound
from .prices import pair_link, price_pair, price_tp_pair, priced_for
from .search import Search
from .tp_search import TPPairSearch

__all__ = [
    "Candidate", "Candidates", "DP_GROUP_SIZES", "Group", "PairSearch", "PatternBound",
    "Search", "ShareMode",
    "ShareOption", "SharedTask", "SharingReport", "TPPairSearch", "block_decision",
    "block_pieces", "block_row", "bundle_candidates", "bundle_pairs", "chosen", "dp_pair_sets",
    "gram_pipeline", "kind_of", "pair_decision", "pair_link", "pair_timeline", "pair_waits",
    "pairs_in_nodes", "pattern_bound", "piece_loads", "pieces_apart", "price_pair",
    "price_tp_pair",
    "priced_for", "profile_rate", "shard_block_decision", "shard_blocks_aligned",
    "share_decision", "share_options", "shared_piece", "sharing_bound", "tp_bundle_candidate",
    "tp_pair_candidates", "tp_pair_decision", "tp_pair_piece", "tp_share_sets", "tp_sub_piece",
    "with_pairs",
]
