"""``canzona compare``: every strategy of the registry simulated alike.

Torch-free. Every strategy (:mod:`canzona.planner.strategies.registry`) becomes a
:class:`~canzona.planner.simulate.Workload` of the same model, sizes and hardware
(:mod:`canzona.planner.strategies.workloads`), and :func:`compare` simulates them all with the
same backward and forward times, so their optimizer-step and iteration times compare like with
like. Deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..comm import PER_ROOT
from ..errors import CanzonaError
from ..hardware import HardwareProfile, load_hardware
from ..layout import ParallelSizes
from ..options import MIB, DPOptions, TPOptions
from ..pipeline import inventory_of
from ..plan import PipelinePlan, Plan
from ..planning import DPProblem, make_problem
from ..plan.inverse import read_problem
from ..settings import OptimizerSettings
from ..simulate import (MICROBATCHES_PER_STAGE, PipelineSim, StepSim, Workload, active_params,
                        forward_backward_seconds, one_f_one_b, plan_forward_backward,
                        plan_hardware, simulate, split_forward_backward)
from ..simulate.stages import microbatch_times
from ..stages import StageSplit, split_model
from .registry import CANZONA, CANZONA_GREEDY, REGISTRY, STRATEGIES
from .workloads import WorkloadInputs

__all__ = ["StrategyRun", "Comparison", "PipelineComparison", "compare", "compare_pipeline",
           "compare_plan", "compare_problem"]


# --- the comparison -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StrategyRun:
    """One strategy's simulated step and iteration."""

    name: str
    exact: bool
    sim: StepSim
    forward_backward_s: float
    sent_bytes: int  # the most DP bytes any rank sends per iteration (reduce + gather)
    dp_flops: tuple[int, ...] = ()  # logical optimizer FLOPs per DP index
    dp_state: tuple[int, ...] = ()  # optimizer state bytes per DP index

    @staticmethod
    def _ratio(xs: Sequence[int]) -> float:
        mean = sum(xs) / len(xs) if xs else 0.0
        return max(xs) / mean if mean else 1.0

    @property
    def flops_balance(self) -> float:
        """DP FLOPs max/mean."""
        return self._ratio(self.dp_flops)

    @property
    def state_balance(self) -> float:
        """DP optimizer-state bytes max/mean."""
        return self._ratio(self.dp_state)

    @property
    def step_s(self) -> float:
        return self.sim.step_s

    @property
    def iteration_s(self) -> float:
        return self.forward_backward_s + self.sim.step_s


@dataclass(frozen=True, slots=True)
class Comparison:
    """Every strategy's run on one model, sizes and hardware profile."""

    model: str
    dp: int
    tp: int
    ep: int
    hardware: str
    tokens: int
    mfu: float
    forward_backward_s: float
    overlap_param_gather: bool
    runs: tuple[StrategyRun, ...]
    plan: Plan | None = None  # canzona's
    forward_backward_given: bool = False  # True: a given time, not 6·N·tokens at the MFU

    def run(self, name: str) -> StrategyRun:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def canzona_share(self) -> str:
        """What the canzona row's plan shares: ``off`` (nothing, whatever it was asked), the
        ``share`` mode of a plan whose TP groups share matrices, ``dp-pairs`` (tp 1: matrices
        split over two DP indices) or ``tp-pairs`` (tp > 1: some shared by two TP groups)."""
        if self.plan is None:
            return "off"
        if self.plan.dp_shared:
            return "dp-pairs" if self.plan.inputs.tp == 1 else "tp-pairs"
        tp = self.plan.tp
        shares = tp is not None and any(ix.shared for ix in tp.indices)
        return tp.share if shares and tp.share else "off"

    def to_dict(self, *, stages: bool = False) -> dict:
        def row(r: StrategyRun) -> dict:
            d = r.sim.to_dict(stages=stages)
            if not stages:
                d.pop("ranks")
            return {"strategy": r.name, "exact": r.exact,
                    "step_s": round(r.step_s, 9),
                    "reduced_step_s": round(r.sim.reduced_step_s, 9),
                    "iteration_s": round(r.iteration_s, 9),
                    "sent_bytes": r.sent_bytes,
                    "dp_flops_max_over_mean": round(r.flops_balance, 6),
                    "dp_state_max_over_mean": round(r.state_balance, 6), "simulation": d}
        return {"model": self.model, "dp": self.dp, "tp": self.tp, "ep": self.ep,
                "hardware": self.hardware, "tokens": self.tokens, "mfu": self.mfu,
                "forward_backward_s": round(self.forward_backward_s, 9),
                "forward_backward_given": self.forward_backward_given,
                "overlap_param_gather": self.overlap_param_gather,
                "canzona_share": self.canzona_share,
                "strategies": [row(r) for r in self.runs]}


def _sent(w: Workload) -> int:
    per = [0] * w.dp
    for b in w.buckets:
        for d in b.dp_indices:
            per[d] += b.reduce_bytes + b.gather_bytes
    return max(per, default=0)


def compare_problem(problem: DPProblem, hardware: str | HardwareProfile = "h100", *,
                    strategies: Sequence[str] = STRATEGIES, plan: Plan | None = None,
                    greedy_plan: Plan | None = None, dp_options: DPOptions | None = None,
                    tp_options: TPOptions | None = None, tokens: int | None = None,
                    seq: int = 4096, mfu: float = 0.4, forward_backward_s: float | None = None,
                    overlap_param_gather: bool = False, matrix_dtype: str = "bf16",
                    adamw_dtype: str = "bf16", gather_method: str = PER_ROOT,
                    progress: Callable[[str], None] | None = None) -> Comparison:
    """Simulate ``strategies`` on ``problem`` with one forward/backward time.

    Args:
        hardware: a built-in profile's name, a profile file's path, or a profile. Given a name or
            a path, the canzona plans pick their bucket methods for it; given a profile object,
            for ``tp_options.hardware`` (default ``h100``).
        plan, greedy_plan: the canzona / canzona-greedy plans of this problem (made here with
            ``dp_options`` / ``tp_options`` when absent; canzona-greedy is the DP and TP greedy).
        tokens: the global batch in tokens (default ``dp · seq``: one sequence per DP rank); at
            ``mfu`` it gives forward + backward
            (:func:`~canzona.planner.simulate.forward_backward_seconds`) unless
            ``forward_backward_s`` is given. Backward is two thirds of it.
        gather_method: the layer-wise all-gather's collective (``per_root`` on NCCL).
    """
    say = progress or (lambda _msg: None)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if isinstance(hardware, HardwareProfile):
        hw = hardware
        t = tp_options or TPOptions(comm_dtype=problem.comm_dtype)
    else:
        hw = load_hardware(hardware)
        t = tp_options or TPOptions(comm_dtype=problem.comm_dtype, hardware=str(hardware))
    o = dp_options or DPOptions()
    sizes = problem.sizes
    tokens = tokens if tokens is not None else sizes.dp * seq
    given = forward_backward_s is not None
    if forward_backward_s is None:
        forward_backward_s = forward_backward_seconds(active_params(problem.spec), tokens, hw,
                                                      world=sizes.dp * sizes.tp, mfu=mfu)
    fwd, bwd = split_forward_backward(forward_backward_s)
    plans: dict[str, Plan | None] = {CANZONA: plan, CANZONA_GREEDY: greedy_plan}
    runs = []
    for name in strategies:
        s = REGISTRY[name]
        p = None
        if s.plan is not None:
            p = plans.get(name)
            if p is None:
                say(f"planning {name}")
                p = plans[name] = s.plan(problem, o, t,
                                         (forward_backward_s, overlap_param_gather))
        say(f"simulating {name}")
        w, fl, st = s.workload(s, WorkloadInputs(problem, hw, p, matrix_dtype,  # type: ignore[misc]
                                                 adamw_dtype, gather_method))
        sim = simulate(w, backward_s=bwd, forward_s=fwd, overlap_param_gather=overlap_param_gather)
        runs.append(StrategyRun(name, s.exact, sim, forward_backward_s, _sent(w), fl, st))
    return Comparison(problem.spec.name, sizes.dp, sizes.tp, sizes.ep, f"{hw.name} v{hw.version}",
                      tokens, mfu, forward_backward_s, overlap_param_gather, tuple(runs),
                      plans[CANZONA], given)


def compare(source, sizes: ParallelSizes, optimizer: OptimizerSettings | str = "muon", *,
            hardware: str | HardwareProfile = "h100", dp_options: DPOptions | None = None,
            tp_options: TPOptions | None = None, **kwargs) -> Comparison:
    """:func:`compare_problem` of a model source (a preset name, a ``config.json`` path, a
    config or an inventory) at ``sizes``; ``dp_options`` / ``tp_options`` shape the layout (bucket
    size, cost model, comm dtype) and the canzona plans."""
    o = dp_options or DPOptions()
    comm_dtype = tp_options.comm_dtype if tp_options is not None else "bf16"
    settings = (OptimizerSettings(name=optimizer)  # type: ignore[arg-type]
                if isinstance(optimizer, str) else optimizer)
    spec, _ = inventory_of(source)
    problem = make_problem(spec, sizes, settings, cost=o.cost, bucket_size=o.bucket_size,
                           overlap_grad_reduce=o.overlap_grad_reduce, comm_dtype=comm_dtype,
                           hardware=hardware)
    return compare_problem(problem, hardware, dp_options=o, tp_options=tp_options, **kwargs)


def compare_plan(plan: Plan, hardware: str | HardwareProfile | None = None, *,
                 config=None, **kwargs) -> Comparison:
    """:func:`compare_problem` with ``plan`` as the canzona row: the problem is rebuilt from the
    plan's inputs (``config``: the ``config.json`` of a plan made from one), canzona-greedy is
    planned with the plan's C_max and comm dtype.

    ``hardware`` defaults to the profile the plan records (it must then be built in).

    Raises:
        CanzonaError: the problem cannot be rebuilt (a plan of a live module, a custom cost
            model, or a fingerprint that does not match).
    """
    problem = read_problem(plan, model=True, config=config).problem
    if problem is None:
        raise CanzonaError("this plan was made from a live module or with a custom cost model: "
                           "its problem cannot be rebuilt for the other strategies; compare "
                           "with --model (or simulate the plan alone).")
    ref = hardware if hardware is not None else plan_hardware(plan).name
    tp = kwargs.pop("tp_options", None)
    if tp is None and plan.tp is not None:
        tp = TPOptions(cmax_mib=plan.tp.cmax_bytes / MIB, comm_dtype=plan.tp.comm_dtype,
                       **({} if isinstance(ref, HardwareProfile) else {"hardware": str(ref)}))
    return compare_problem(problem, ref, plan=plan, tp_options=tp, **kwargs)


# --- pipelines ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PipelineComparison:
    """Every strategy on every stage of a pipeline, and each strategy's 1F1B iteration: the
    same stages, forwards and backwards, each stage's step as that strategy takes it."""

    stages: tuple[Comparison, ...]  # per stage, each simulated behind one microbatch
    forward_backward_s: tuple[float, ...]  # per stage, the whole batch
    microbatches: int
    runs: tuple[tuple[str, PipelineSim], ...]  # per strategy, in the table's order

    @property
    def pp(self) -> int:
        return len(self.stages)

    def run(self, name: str) -> PipelineSim:
        for n, sim in self.runs:
            if n == name:
                return sim
        raise KeyError(name)

    def to_dict(self) -> dict:
        first = self.stages[0]
        return {"model": first.model, "pp": self.pp, "dp": first.dp, "tp": first.tp,
                "ep": first.ep, "hardware": first.hardware, "microbatches": self.microbatches,
                "forward_backward_s": [round(x, 9) for x in self.forward_backward_s],
                "strategies": [{"strategy": n, "exact": first.run(n).exact, **sim.to_dict()}
                               for n, sim in self.runs]}


def compare_pipeline(source, sizes: ParallelSizes, optimizer: OptimizerSettings | str = "muon",
                     *, stages: StageSplit, microbatches: int | None = None,
                     hardware: str | HardwareProfile = "h100", plan: PipelinePlan | None = None,
                     dp_options: DPOptions | None = None, tp_options: TPOptions | None = None,
                     tokens: int | None = None, seq: int = 4096, mfu: float = 0.4,
                     forward_backward_s: float | None = None,
                     progress: Callable[[str], None] | None = None,
                     **kwargs) -> PipelineComparison:
    """Every strategy on each stage of ``source`` split by ``stages`` (or of ``plan``'s stages,
    its plans the canzona rows), and each strategy's iteration in 1F1B over ``microbatches``
    (default :data:`~canzona.planner.simulate.MICROBATCHES_PER_STAGE` · pp). A stage's
    forward and backward are 6 · its active parameters · ``tokens`` over its dp · tp GPUs
    (``forward_backward_s``: each stage's, given); its step is simulated behind one
    microbatch's backward, as :func:`~canzona.planner.simulate.simulate_pipeline` does."""
    say = progress or (lambda _msg: None)
    m = microbatches or MICROBATCHES_PER_STAGE * stages.pp
    if plan is not None:
        hw = hardware if isinstance(hardware, HardwareProfile) else \
            plan_hardware(plan.stages[0], None if hardware is None else str(hardware))
        fbs = tuple(forward_backward_s if forward_backward_s is not None else
                    plan_forward_backward(p, hw, tokens=tokens, seq=seq, mfu=mfu)[0]
                    for p in plan.stages)
        comps = []
        for s, p in enumerate(plan.stages):
            say(f"stage {s + 1}/{plan.pp}")
            comps.append(compare_plan(p, hw, forward_backward_s=fbs[s] / m, **kwargs))
    else:
        hw = hardware if isinstance(hardware, HardwareProfile) else load_hardware(hardware)
        o = dp_options or DPOptions()
        comm_dtype = tp_options.comm_dtype if tp_options is not None else "bf16"
        settings = (OptimizerSettings(name=optimizer)  # type: ignore[arg-type]
                    if isinstance(optimizer, str) else optimizer)
        spec, _ = inventory_of(source)
        parts = split_model(spec, stages)
        n_tokens = tokens if tokens is not None else sizes.dp * seq
        fbs = tuple(forward_backward_s if forward_backward_s is not None else
                    forward_backward_seconds(active_params(part), n_tokens, hw,
                                             world=sizes.dp * sizes.tp, mfu=mfu)
                    for part in parts)
        comps = []
        for s, part in enumerate(parts):
            tell = None if progress is None else \
                (lambda msg, s=s: say(f"stage {s + 1}/{stages.pp}: {msg}"))
            problem = make_problem(part, sizes, settings, cost=o.cost, bucket_size=o.bucket_size,
                                   overlap_grad_reduce=o.overlap_grad_reduce,
                                   comm_dtype=comm_dtype, hardware=hardware)
            comps.append(compare_problem(problem, hardware, dp_options=o, tp_options=tp_options,
                                         forward_backward_s=fbs[s] / m, progress=tell, **kwargs))
    fwd, bwd = microbatch_times(fbs, m)
    ends = one_f_one_b(fwd, bwd, m)
    runs = tuple((r.name, PipelineSim(m, fwd, bwd, ends, tuple(c.run(r.name).sim for c in comps)))
                 for r in comps[0].runs)
    return PipelineComparison(tuple(comps), fbs, m, runs)
