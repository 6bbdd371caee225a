"""The candidate placements of the pair searches: at tp = 1 both starts of the DP pair search
(:func:`bundle_candidates`, :func:`bundle_pairs`), at tp > 1 the TP pair search
(:func:`tp_bundle_candidate`), each laid out."""

from __future__ import annotations

from collections.abc import Mapping

from ..hardware import HardwareProfile
from ..planning import Cuts, DPProblem, PairShare
from .cpsat_start import pattern_start
from .dp_search import PairSearch
from .layout import lay_out
from .prices import pair_link
from .tp_search import TPPairSearch


def bundle_pairs(problem: DPProblem, pairs: Mapping[int, PairShare], hw: HardwareProfile, *,
                 scratch_cap: int = 0, max_moves: int = 5000,
                 pattern: bool = True) -> tuple[DPProblem, Cuts] | None:
    """A partition with DP pairs as bundles: (the reordered problem with the pairs it uses,
    its cuts), or None where it does not apply (not Muon, tp > 1, expert buffers, fewer than
    two DP indices, no candidate, partners (2s, 2s + 1) on two nodes) or shares nothing: of
    :func:`bundle_candidates`, the one whose busiest index is lightest (the heaviest-first
    start on a tie; None if that one shares nothing). ``scratch_cap``: bytes a pair's lockstep may hold (0: unbounded);
    ``pattern``: also start from the class-level ILP's patterns (``pattern_start``)."""
    got = bundle_candidates(problem, pairs, hw, scratch_cap=scratch_cap, max_moves=max_moves,
                            pattern=pattern)
    best = None
    for busiest, layout in got:
        if best is None or busiest < best[0] * (1 - 1e-9):
            best = (busiest, layout)
    return None if best is None else best[1]


def bundle_candidates(problem: DPProblem, pairs: Mapping[int, PairShare], hw: HardwareProfile,
                      *, scratch_cap: int = 0, max_moves: int = 5000, pattern: bool = True
                      ) -> list[tuple[float, tuple[DPProblem, Cuts] | None]]:
    """Both starts of the bundle search, each searched, made whole where it may and laid out:
    heaviest first where the busiest index it touches ends lightest, and (``pattern``) the
    patterns of a class-level ILP. Per start (busiest index's load, (problem, cuts) or None
    where it shares nothing); an empty list where bundles do not apply (see
    :func:`bundle_pairs`). The caller judges them (``pipeline._solve_pairs`` by its
    objective: a start with a heavier busiest index may move fewer bytes)."""
    if problem.settings.name != "muon" or problem.sizes.tp != 1 or problem.dp < 2 or not pairs \
            or any(buf.expert for buf in problem.layout.buffers) \
            or pair_link(hw, (0, 1)) is not hw.intra_node or hw.gpus_per_node % 2:
        return []
    search = PairSearch(problem, pairs, scratch_cap)
    for i in sorted(range(len(search.load)), key=lambda i: (-search.load[i], i)):
        search.place(i)
    search.improve(max_moves)
    search.unshare()
    out = [(search.busiest(), lay_out(problem, pairs, search, hw))]
    other = pattern_start(problem, pairs, scratch_cap, search.busiest()) if pattern else None
    if other is not None:
        other.improve(max_moves)
        other.unshare()
        if other.where != search.where:
            out.append((other.busiest(), lay_out(problem, pairs, other, hw)))
    return out


def tp_bundle_candidate(problem: DPProblem, pairs: Mapping[int, PairShare],
                        hw: HardwareProfile, *, scratch_cap: int = 0, max_moves: int = 2000,
                        force: bool = False) -> tuple[float, tuple[DPProblem, Cuts] | None]:
    """tp > 1, Muon (``problem.shared``: the tasks TP groups share): a placement with the
    ``pairs`` (``sharing.tp_pair_decision``) shared by fixed partner indices (:class:`TPPairSearch`,
    heaviest first, then moves and exchanges off the busiest index; ``force``: every one of
    them shared, which needs a bucket per pair and task: more pairs than that are left whole),
    laid out as :func:`lay_out` does (each bucket by DP index, a shared matrix's TP shards cut
    between its partners). Returns (the
    search's busiest index, (the reordered problem with the pairs used, its cuts) or None
    where it shares nothing). ``pipeline.tp_pair_candidates`` offers it to the pipeline."""
    if problem.settings.name != "muon" or problem.sizes.tp == 1 or problem.dp < 2 or not pairs \
            or any(buf.expert for buf in problem.layout.buffers):
        return 0.0, None
    search = TPPairSearch(problem, pairs, scratch_cap, force)
    search.start()
    search.improve(max_moves)
    return search.busiest(), lay_out(problem, pairs, search, hw)  # type: ignore[arg-type]
