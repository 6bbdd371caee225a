"""The TP search's start from the pattern model (tp > 1, Muon): every class of alike matrices
the TP group shares free to stay over its TP group, go to TP pairs (halves on partner indices)
or to rounds of TP sub-groups (``rounds``); CP-SAT chooses how many take each option and which
multiset of pieces each DP index runs (``patterns``, at most :data:`START_MOST` pieces an
index, each index's lockstep as the schedule models it); the patterns are then given real
matrices (a class's first in task order go to rounds, the next to pairs) and the search
(``tp_search.TPPairSearch``) places the rest and improves it (:func:`tp_pattern_start`)."""

from __future__ import annotations

from collections.abc import Mapping

from ..planning import DPProblem, PairShare
from ..tp.context import half_piece, lockstep_piece, round_piece
from .patterns import Kind, enumerate_patterns, least_ceiling, lockstep_load
from .rounds import classes as alike_classes, rounds_of, sub_round, with_rounds
from .tp_search import TPPairSearch

#: Pieces one DP index runs at most in the start's patterns.
START_MOST = 4


def _kinds(problem: DPProblem, classes: list[list[int]], pairs: Mapping[int, PairShare],
           hw) -> list[Kind]:  # noqa: ANN001
    """Per class (its tasks): over its TP group as ``problem.shared`` has it, halves where
    ``pairs`` holds its tasks, and a round of each sub-group size."""
    tp = problem.sizes.tp
    out = []
    for c, ids in enumerate(classes):
        i = ids[0]
        out.append(Kind(c, "tp", 1, 1, lockstep_piece(problem, i)))
        x = pairs.get(i)
        if x is not None and x.alone_s > 0 and all(j in pairs for j in ids):
            out.append(Kind(c, "pair", 2, 1, half_piece(problem, i, x), half=True))
        for k in range(2, tp):
            if tp % k == 0 and len(ids) >= tp // k:
                r = sub_round(problem, ids[:tp // k], k, hw)
                if r is not None:
                    out.append(Kind(c, f"sub{k}", 1, tp // k, round_piece(problem, r)))
    return out


def tp_pattern_start(problem: DPProblem, pairs: Mapping[int, PairShare], hw, *,  # noqa: ANN001
                  scratch_cap: int = 0, ceiling: float | None = None
                  ) -> tuple[DPProblem, dict[int, PairShare], TPPairSearch] | None:
    """A placement from the pattern model (see the module): (the problem with the rounds it
    uses, the pairs it uses, the search placed and not yet improved), or None where the model
    finds nothing under ``ceiling`` (another start's busiest index; None: any) or has too
    many patterns, and for a model with expert buffers (the search does not lay them out). At
    an odd dp no index has a partner: rounds and the TP group only. ``problem.shared``: the
    tasks the TP group shares; ``pairs``: the TP pairs the tall ones may take
    (``decision.tp_pair_decision``)."""
    classes = list(alike_classes(problem).values())
    if not classes or any(buf.expert for buf in problem.layout.buffers):
        return None
    if problem.dp % 2:  # no partner indices: rounds and the TP group only
        pairs = {}
    kinds = _kinds(problem, classes, pairs, hw)
    if all(k.option == "tp" for k in kinds):
        return None
    counts = [len(ids) for ids in classes]
    load = lockstep_load(kinds, scratch_cap)
    top = ceiling if ceiling is not None else float("inf")
    pats = enumerate_patterns(kinds, counts, top, load, START_MOST, prune=True)
    if not pats:
        return None
    got = least_ceiling(kinds, counts, problem.dp, pats, exact=True, partners=bool(pairs))
    if got is None:
        return None
    _, use, _ = got
    assert use is not None
    took = [sum(n * pats[p][0][j] for p, n in use.items()) * k.mats // k.per
            for j, k in enumerate(kinds)]
    # real matrices: per class its first ones to rounds (by sub-group size), then to pairs
    rounds, paired = [], {}
    pool: dict[int, list[int]] = {}  # kind → its tasks (a round: its first task)
    for c, ids in enumerate(classes):
        left = list(ids)
        for j, k in enumerate(kinds):
            if k.cls != c or k.option in ("tp", "pair") or not took[j]:
                continue
            got_rounds = rounds_of(problem, left[:took[j]], int(k.option[3:]), hw)
            rounds += got_rounds
            pool[j] = [r.tasks[0] for r in got_rounds]
            left = left[took[j]:]
        for j, k in enumerate(kinds):
            if k.cls == c and k.option == "pair" and took[j]:
                pool[j] = left[:took[j]]
                paired.update({i: pairs[i] for i in left[:took[j]]})
                left = left[took[j]:]
        for j, k in enumerate(kinds):
            if k.cls == c and k.option == "tp":
                pool[j] = left
    used = with_rounds(problem, rounds)
    search = TPPairSearch(used, paired, scratch_cap)
    item = {t: i for i, t in enumerate(search.task)}
    placed: dict[int, tuple[str, int]] = {}
    instances = [pats[p][0] for p in sorted(use) for _ in range(use[p])]
    halves = [j for j, k in enumerate(kinds) if k.half]
    with_halves = sorted((x for x in instances if any(x[j] for j in halves)),
                         key=lambda x: tuple(x[j] for j in halves))
    plain = [x for x in instances if not any(x[j] for j in halves)]
    taken = {j: 0 for j in pool}

    def take(j: int) -> int | None:
        if taken[j] >= len(pool[j]):
            return None
        taken[j] += 1
        return item[pool[j][taken[j] - 1]]

    def whole(x: tuple[int, ...], e: int) -> None:  # pattern x's whole pieces on index e
        for j, c in enumerate(x):
            if j in halves or j not in pool:
                continue
            for _ in range(c):
                i = take(j)
                if i is not None:
                    placed[i] = ("w", e)

    d = 0
    for a in range(0, len(with_halves) - 1, 2):  # partners hold the same halves
        s = d // 2
        shared: list[int] = []
        for j in halves:
            for _ in range(with_halves[a][j]):
                i = take(j)
                if i is not None and search.fits(shared + [i]):
                    shared.append(i)
                    placed[i] = ("s", s)
                elif i is not None:
                    taken[j] -= 1  # left to the search
        whole(with_halves[a], d)
        whole(with_halves[a + 1], d + 1)
        d += 2
    for x in plain:
        if d >= problem.dp:
            break
        whole(x, d)
        d += 1
    search.seed(placed)
    search.start()
    return used, paired, search
