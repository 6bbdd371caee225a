"""The candidate plans of a share mode and the rule that keeps the best (:class:`Candidates`,
what ``pipeline.plan_problem`` runs): the plan without pairs first, then at tp = 1 the DP
pairs (each candidate set of split tasks placed by the DP partition, and by both starts of the
DP pair search: :func:`bundle_candidates`), at tp > 1 the other sets of TP-shared tasks and the
TP pairs (:func:`tp_bundle_candidate`), each solved, laid out and, at tp > 1, scheduled."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ..solve import solve
from ..solve import Solution, modelled_step, state_target
from ..errors import CanzonaError, CanzonaWarning
from ..formulas import LOCKSTEP_CMAX
from ..hardware import HardwareProfile
from ..objective import StepTime, objective_name
from ..options import DPOptions, TPOptions
from ..planning import Cuts, DPProblem, PairShare, evaluate, pair_owners
from ..tp import TPContext, TPSchedule, schedule_tp
from .cpsat_start import pattern_start
from .decision import ShareMode, dp_pair_sets, tp_pair_decision, tp_share_sets
from .dp_search import PairSearch
from .layout import lay_out
from .pairs import pair_waits, pairs_in_nodes, pieces_apart, with_pairs
from .prices import pair_link, priced_for
from .rounds import every_round, with_rounds
from .tp_search import TPPairSearch
from .tp_start import tp_pattern_start

#: What a candidate is, for :meth:`Candidates.better`: the plan without pairs (and with the
#: first set of TP-shared tasks), DP pairs, another set of TP-shared tasks, TP pairs, rounds of
#: TP sub-groups.
BASE, DP_PAIRS, SHARED, TP_PAIRS, SUB_GROUPS = ("base", "dp-pairs", "shared", "tp-pairs",
                                                "sub-groups")
#: A busiest GPU within this factor of its plan's mean GPU load is balanced: ``auto`` tries
#: no rounds of TP sub-groups beside it.
BALANCED = 1.01


@dataclass(eq=False)
class Candidate:
    """One candidate plan: its DP solution (the problem it solved, with the tasks it shares,
    and its cuts), its ``kind``, and at tp > 1 its TP context and schedule."""

    solution: Solution
    kind: str
    ctx: TPContext | None = None
    schedule: TPSchedule | None = None
    #: what :meth:`Candidates.better` computed of it, by name
    memo: dict[str, float] = field(default_factory=dict)

    @property
    def problem(self) -> DPProblem:
        return self.solution.problem

    @property
    def cuts(self) -> Cuts:
        return self.solution.cuts


class Candidates:
    """The candidate plans of ``tp_options.share`` (a :class:`~.decision.ShareMode`) for
    ``problem``, in the order they are tried (iterate; each solved and, with ``schedule``, its
    TP schedule built), and the rule that keeps the best (:meth:`better`). Deciding what to
    share happens on construction (``decision.tp_share_sets``, ``decision.dp_pair_sets``), so
    a mode the problem cannot take is refused before any solving. ``stacklevel``: the warnings
    name the line that many frames above the caller (as ``warnings.warn`` counts)."""

    def __init__(self, problem: DPProblem, dp_options: DPOptions, tp_options: TPOptions,
                 hw: HardwareProfile, *, schedule: bool = False,
                 progress: Callable[[str], None] | None = None, stacklevel: int = 2) -> None:
        self.o, self.t, self.hw = dp_options, tp_options, hw
        self.mode = mode = ShareMode.of(tp_options.share)
        self.progress = progress
        self.say = progress or (lambda _msg: None)
        self.schedule = schedule
        self.step = objective_name(dp_options.objective) == "step-time"
        self.cap = LOCKSTEP_CMAX * tp_options.cmax_bytes  # a lockstep's scratch bytes
        tp = problem.sizes.tp
        if mode.pairs and tp == 1:
            raise CanzonaError("TPOptions.share = 'pairs' (--share pairs) shares a matrix over "
                               "two TP groups (tp > 1); at tp = 1 use 'all' or 'all-split' (DP "
                               "pairs).")
        if mode.pairs and not dp_options.reorder:
            raise CanzonaError("TPOptions.share = 'pairs' (--share pairs) lays a shared matrix "
                               "out between its two DP indices by reordering each bucket's "
                               "parameters; it needs DPOptions.reorder (drop --no-reorder), or "
                               "use 'all-split'.")
        #: whether rounds of TP sub-groups are tried (``auto``) or asked for (``sub-groups``):
        #: as TP pairs, a TP group of 4 ranks or more, and no pipeline stage
        staged = problem.spec.stage is not None and problem.spec.stage.pp > 1
        self.sub_groups = schedule and mode.sub_groups and dp_options.reorder \
            and problem.settings.spec.gram_shared and tp >= 4 and not staged
        if mode.name == "sub-groups" and not self.sub_groups:
            why = (f"a TP group of 4 ranks or more (tp is {tp})" if tp < 4 else
                   f"an optimizer sharing its Newton–Schulz (Muon, NorMuon; "
                   f"{problem.settings.name} does not)"
                   if not problem.settings.spec.gram_shared else
                   "DPOptions.reorder (drop --no-reorder): a round's matrices lie on one DP "
                   "index" if not dp_options.reorder else
                   "a model without pipeline stages (the runtime creates the sub-groups over "
                   "the whole world, which a pipeline's stages share)" if staged else
                   "a TP schedule (not dp_only)")
            raise CanzonaError(f"TPOptions.share = 'sub-groups' (--share sub-groups) shares "
                               f"matrices over TP sub-groups of k < tp ranks: it needs {why}; "
                               f"use 'all-split' otherwise.")
        #: the candidate sets of TP-shared tasks (tp > 1), the first the plan's start
        self.shares: list[dict] = []
        if not mode.off and tp > 1 and not problem.shared:
            self.say("sharing decision")
            self.shares = tp_share_sets(problem, mode, hw, stacklevel=stacklevel + 1)
            problem = dataclasses.replace(problem, shared=self.shares[0])
        if problem.shared:  # the DP side batches the lockstep as the schedule will
            problem = dataclasses.replace(problem, lockstep_cap=self.cap)
        #: the candidate sets of tasks DP pairs share (tp = 1)
        self.pairs: list[dict] = []
        if not mode.off and tp == 1 and not problem.pairs:
            self.say("sharing decision (DP pairs)")
            self.pairs = dp_pair_sets(problem, mode, hw, stacklevel=stacklevel + 1)
        self.problem = problem
        #: whether TP pairs are tried: asked for (``pairs``) or tried (``auto``) where the plan
        #: has a TP schedule, Muon's matrices and reordered buckets to lay them out in
        self.tp_pairs = schedule and mode.tp_pairs and dp_options.reorder \
            and problem.settings.spec.gram_shared
        self._terms: StepTime | None = None
        #: the lightest busiest GPU of the TP-scheduled candidates made so far, and that
        #: candidate's mean GPU load
        self._lightest: float | None = None
        self._lightest_mean = 0.0

    # -- the candidates ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Candidate]:
        """The plan without pairs (the first set of TP-shared tasks), then the DP pairs' (tp =
        1), the other sets of TP-shared tasks' and the TP pairs' (tp > 1, with ``schedule``)."""
        self.say("DP partition")
        sol = solve(self.problem, self.o, progress=self.progress, hardware=self.hw)
        yield self._candidate(sol, BASE, "tp micro-groups")
        if self.pairs:
            yield from self._dp_pairs(sol)
        if not self.schedule:
            return
        for shared in self.shares[1:]:  # share="auto": the other sets of TP-shared tasks
            self.say("DP partition (other shared tasks)")
            other = solve(dataclasses.replace(self.problem, shared=shared,
                                              lockstep_cap=self.cap if shared else 0),
                          self.o, progress=self.progress, hardware=self.hw)
            yield self._candidate(other, SHARED)
        if self.tp_pairs:  # fc1/QKV shared by two TP groups (k = 2·tp) on partner indices
            self.say("tp pairs")
            for shared in self.shares if self.mode.auto else self.shares[:1]:
                start = dataclasses.replace(self.problem, shared=shared, lockstep_cap=self.cap)
                for used, cuts in tp_pair_candidates(start, self.hw, scratch_cap=self.cap,
                                                     force=self.mode.pairs):
                    yield self._candidate(Solution(cuts, "heuristic", used.lower_bound(), used),
                                          TP_PAIRS)
        if self.sub_groups and not self._balanced():  # rounds of TP sub-groups (with pairs)
            self.say("tp sub-groups")
            for shared in self.shares if self.mode.auto else self.shares[:1]:
                start = dataclasses.replace(self.problem, shared=shared, lockstep_cap=self.cap)
                for used, cuts in sub_group_candidates(start, self.hw, self.mode,
                                                       scratch_cap=self.cap,
                                                       pairs=self.tp_pairs,
                                                       ceiling=self._lightest):
                    yield self._candidate(Solution(cuts, "heuristic", used.lower_bound(), used),
                                          SUB_GROUPS)

    def _balanced(self) -> bool:
        """Whether the lightest busiest GPU so far is within :data:`BALANCED` of its own mean
        GPU load: rounds, which add all-to-alls, cannot go below the mean (``auto`` skips
        them there; ``sub-groups`` never does)."""
        if not self.mode.auto or self._lightest is None:
            return False
        return self._lightest <= BALANCED * self._lightest_mean

    def _candidate(self, sol: Solution, kind: str, stage: str | None = None) -> Candidate:
        """``sol`` as a candidate, with its TP schedule where the plan has one (the lightest
        busiest GPU of those made so far kept: a start of rounds aims below it)."""
        if not self.schedule:
            return Candidate(sol, kind)
        if stage:
            self.say(stage)
        ctx = TPContext.build(sol.problem, self.t.comm_dtype)
        made = Candidate(sol, kind, ctx, schedule_tp(sol.problem, sol.cuts, self.t, ctx=ctx,
                                                     warn=False))
        gpu = self._gpu(made)
        if self._lightest is None or gpu < self._lightest:
            grid = made.schedule.grid()  # type: ignore[union-attr]
            self._lightest = gpu
            self._lightest_mean = sum(map(sum, grid)) / (len(grid) * len(grid[0]))
        return made

    def _dp_pairs(self, sol: Solution) -> Iterator[Candidate]:
        """tp = 1: for each candidate set of split tasks, each cut into its two pieces and the
        partition solved again (every stage, the collectives' and the optimizer state's
        included) in the bucket order of the plan without pairs and in Megatron's, so that a
        bucket cut may fall between a task's pieces; a task whose pieces stay on one DP index
        is whole again, a pair on two nodes exchanges over the network. Then, where parameters
        may be reordered, each set as bundles of fixed partners (:func:`bundle_candidates`:
        both starts of its search; a pair's lockstep within 2 · C_max)."""
        self.say("DP pairs")
        problem, hw = self.problem, self.hw
        whole = dataclasses.replace(self.o, reorder=False)
        for pairs in self.pairs:
            for base in (sol.problem,) if sol.problem is problem else (sol.problem, problem):
                cuts = solve(with_pairs(base, pairs), whole, hardware=hw).cuts
                if self.mode.kept:  # "all": the pieces apart wherever a cut can move
                    cuts = pieces_apart(with_pairs(base, pairs), cuts)
                cuts = pairs_in_nodes(base, pairs, cuts, hw)  # fewer pairs across two nodes
                owners = pair_owners(with_pairs(base, pairs), cuts)
                used = with_pairs(base, priced_for(base, {i: x for i, x in pairs.items()
                                                          if owners[i][0] != owners[i][1]},
                                                   owners, hw))
                yield Candidate(Solution(cuts, "heuristic", used.lower_bound(), used), DP_PAIRS)
        if self.o.reorder:
            self.say("DP pairs (bundles)")
            for pairs in self.pairs:  # both starts of the search, judged by the objective
                for _, got in bundle_candidates(problem, pairs, hw, scratch_cap=self.cap):
                    if got is not None:
                        used, cuts = got
                        yield Candidate(Solution(cuts, "heuristic", used.lower_bound(), used),
                                        DP_PAIRS)

    # -- the rule that keeps the best --------------------------------------------------------
    def better(self, new: Candidate, best: Candidate) -> bool:
        """Whether ``new`` replaces ``best`` (the one kept of those before it):

        * under a mode that keeps what it shares (``ShareMode.kept``), a candidate with pairs
          replaces one without, and TP pairs are kept so alone;
        * DP pairs: a lower score, the busiest DP index counting every piece's compute and
          exchanges and the waits between partners (``pairs.pair_waits``), plus under the
          ``step-time`` objective the bucket collectives and the optimizer state above its
          target (``StepTime``'s terms, converted at the problem's rate: under the ``flops``
          cost model a piece's load and a second are converted alike; other cost models
          convert a piece at its task's load per FLOP);
        * another set of TP-shared tasks: a lighter busiest GPU; against none under
          ``step-time``, a shorter modelled step (the busiest GPU and the bucket collectives,
          as the partition itself is judged);
        * TP pairs: a lighter busiest GPU and, under ``step-time``, a modelled step no
          longer;
        * rounds of TP sub-groups: the same; under ``sub-groups`` (kept) a candidate with
          rounds replaces one without."""
        if self.mode.kept and new.problem.pairs and not best.problem.pairs:
            return True
        if new.kind == SUB_GROUPS:
            if self.mode.kept:  # asked for: rounds replace none
                return bool(new.problem.rounds) and not best.problem.rounds
            return self._gpu(new) < self._gpu(best) and (
                not self.step or self._step(new) <= self._step(best))
        if new.kind == DP_PAIRS:
            return bool(new.problem.pairs) and self._pair_score(new) < self._pair_score(best)
        if new.kind == TP_PAIRS:
            return not self.mode.kept and self._gpu(new) < self._gpu(best) and (
                not self.step or self._step(new) <= self._step(best))
        if self.step and not new.problem.shared:  # sharing against none
            return self._step(new) < self._step(best)
        return self._gpu(new) < self._gpu(best)

    def _pair_score(self, c: Candidate) -> float:
        if "pairs" not in c.memo:
            load = max(pair_waits(c.problem, c.cuts))  # the busiest index, waits too
            if self.step:
                if self._terms is None:
                    self._terms = StepTime(self.problem, self.hw,
                                           state_cap=state_target(self.problem))
                load += self._terms.bucket_terms(c.problem, c.cuts) + self._terms.state_term(
                    max(evaluate(c.problem, c.cuts).state_bytes))
            c.memo["pairs"] = load
        return c.memo["pairs"]

    def _gpu(self, c: Candidate) -> float:
        """The busiest GPU of ``c``'s TP schedule."""
        return max(map(max, c.schedule.grid()))  # type: ignore[union-attr]

    def _step(self, c: Candidate) -> float:
        if "step" not in c.memo:
            c.memo["step"] = modelled_step(c.problem, c.cuts, self.hw)
        return c.memo["step"]

    def check_kept(self, best: Candidate, *, stacklevel: int = 2) -> None:
        """Warns where ``pairs`` was asked for and the kept plan has no TP pair, or
        ``sub-groups`` and it has no round."""
        if self.mode.name == "sub-groups" and not best.problem.rounds:
            why = ("the model has expert buffers, which the TP search does not lay out"
                   if any(buf.expert for buf in self.problem.layout.buffers) else
                   "a round needs tp/k alike Muon matrices the TP group shares, split along "
                   "their long dimension, for a k dividing tp below it")
            warnings.warn(f"TPOptions.share = 'sub-groups': no round of TP sub-groups here "
                          f"({why}); every eligible matrix is shared by its TP group (as "
                          f"'all-split').", CanzonaWarning, stacklevel=stacklevel + 1)
        if self.mode.pairs and self.tp_pairs and not best.problem.pairs:
            warnings.warn("TPOptions.share = 'pairs': no matrix is shared by two TP groups here "
                          "(a tall Muon matrix split along its rows, dp ≥ 2, two rows of every "
                          "shard or more); every eligible one is shared by its TP group (as "
                          "'all-split').", CanzonaWarning, stacklevel=stacklevel + 1)


def tp_pair_candidates(problem: DPProblem, hw: HardwareProfile, *, scratch_cap: int = 0,
                       force: bool = False) -> list[tuple[DPProblem, Cuts]]:
    """tp > 1, Muon, ``problem.shared`` set: placements with the tall column-parallel matrices
    shared by two TP groups (k = 2·tp) on fixed partner indices, for each candidate set of
    pairs (``decision.tp_pair_decision``: the bound's choice, and every eligible one with the
    polynomial split; with ``force``, every eligible one, each shared), laid out by
    :func:`tp_bundle_candidate`: (the problem with the pairs it uses, its cuts) each; empty
    where none applies or shares anything."""
    if not problem.settings.spec.gram_shared or problem.sizes.tp == 1 or not problem.shared:
        return []
    out = []
    seen: list[dict] = []
    for mode in ShareMode("pairs" if force else "auto").tries():
        pairs = tp_pair_decision(problem, hw, mode)
        if not pairs or pairs in seen:
            continue
        seen.append(pairs)
        _, got = tp_bundle_candidate(problem, pairs, hw, scratch_cap=scratch_cap, force=force)
        if got is not None:
            used, cuts = got
            # a paired task is its two TP groups' only: not also its first index's alone
            shared = {i: x for i, x in used.shared.items() if i not in used.pairs}
            out.append((dataclasses.replace(used, shared=shared), cuts))
    return out


def sub_group_candidates(problem: DPProblem, hw: HardwareProfile, mode: ShareMode, *,
                         scratch_cap: int = 0, pairs: bool = True, max_moves: int = 2000,
                         ceiling: float | None = None) -> list[tuple[DPProblem, Cuts]]:
    """tp ≥ 4, Muon, ``problem.shared`` set: a placement with rounds of TP sub-groups, each
    round whole on one DP index: under ``auto`` the pattern model's (``tp_start``: how many
    of each class go to rounds of which size, and (``pairs``) to the TP pairs of the bound's
    choice), searched from there; under ``sub-groups`` every class in rounds
    (``rounds.every_round``), placed by the search. Laid out as :func:`tp_bundle_candidate`
    does: (the problem with the rounds and pairs it uses, its cuts); empty where no round is
    placed. ``ceiling``: another candidate's busiest GPU (the start's patterns stay below
    it)."""
    if not problem.settings.spec.gram_shared or problem.sizes.tp < 4 or not problem.shared \
            or any(buf.expert for buf in problem.layout.buffers):
        return []
    if mode.auto:
        paired = tp_pair_decision(problem, hw, "auto") if pairs else {}
        got = tp_pattern_start(problem, paired, hw, scratch_cap=scratch_cap, ceiling=ceiling)
        if got is None or not got[0].rounds:
            return []
        start, chosen, search = got
        search.improve(max_moves)
        laid = lay_out(start, chosen, search, hw)
    else:
        rounds = every_round(problem, hw)
        if not rounds:
            return []
        _, laid = tp_bundle_candidate(with_rounds(problem, rounds), {}, hw,
                                      scratch_cap=scratch_cap, max_moves=max_moves)
    if laid is None:
        return []
    used, cuts = laid
    shared = {i: x for i, x in used.shared.items() if i not in used.pairs}
    return [(dataclasses.replace(used, shared=shared), cuts)]


def bundle_pairs(problem: DPProblem, pairs: Mapping[int, PairShare], hw: HardwareProfile, *,
                 scratch_cap: int = 0, max_moves: int = 5000,
                 pattern: bool = True) -> tuple[DPProblem, Cuts] | None:
    """A partition with DP pairs as bundles: (the reordered problem with the pairs it uses, its
    cuts), or None where it does not apply (not Muon, tp > 1, expert buffers, fewer than two DP
    indices, no candidate, partners (2s, 2s + 1) on two nodes) or shares nothing: of
    :func:`bundle_candidates`, the one whose busiest index is lightest (the heaviest-first start
    on a tie; None if that one shares nothing). ``scratch_cap``: bytes a pair's lockstep may
    hold (0: unbounded); ``pattern``: also start from the class-level ILP's patterns
    (``pattern_start``)."""
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
    """Both starts of the DP pair search (``dp_search.PairSearch``), each searched, made whole
    where it may and laid out (``layout.lay_out``): heaviest first where the busiest index it
    touches ends lightest, and (``pattern``) the patterns of a class-level ILP
    (``cpsat_start.pattern_start``). Per start (busiest index's load, (problem, cuts) or None
    where it shares nothing); an empty list where bundles do not apply (see
    :func:`bundle_pairs`). The caller judges them (:meth:`Candidates.better` by its objective:
    a start with a heavier busiest index may move fewer bytes)."""
    if not problem.settings.spec.gram_shared or problem.sizes.tp != 1 or problem.dp < 2 \
            or not pairs or any(buf.expert for buf in problem.layout.buffers) \
            or pair_link(hw, (0, 1)) is not hw.intra_node or hw.gpus_per_node % 2:
        return []
    search = PairSearch(problem, pairs, scratch_cap)
    search.start()
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
    ``pairs`` (``decision.tp_pair_decision``) shared by fixed partner indices
    (``tp_search.TPPairSearch``, heaviest first, then moves and exchanges off the busiest
    index; ``force``: every one of them shared, which needs a bucket per pair and task: more
    pairs than that are left whole), laid out by ``layout.lay_out`` (each bucket by DP index, a
    shared matrix's TP shards cut between its partners). Returns (the search's busiest index,
    (the reordered problem with the pairs used, its cuts) or None where it shares nothing);
    :func:`tp_pair_candidates` offers it to the plan."""
    if not problem.settings.spec.gram_shared or problem.sizes.tp == 1 \
            or (pairs and problem.dp < 2) or not (pairs or problem.rounds) \
            or any(buf.expert for buf in problem.layout.buffers):
        return 0.0, None
    search = TPPairSearch(problem, pairs, scratch_cap, force)
    search.start()
    search.improve(max_moves)
    return search.busiest(), lay_out(problem, pairs, search, hw)
