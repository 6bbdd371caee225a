"""The plan adapter of the step simulator: :func:`workload_from_plan` turns a plan and a hardware
profile into a :class:`~canzona.planner.simulate.engine.Workload` (:mod:`canzona.planner.simulate`
describes how), :func:`simulate_plan` simulates it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..alike import Kept
from ..comm import ELEMENT_BYTES, all_to_all_busiest, bucket_comm, buffer_slices, plan_link
from ..cost import Roofline, TaskCost, work_of
from ..errors import CanzonaError
from ..formulas import (ADAMW_BYTES_PER_ELEMENT, LOCKSTEP_CMAX, lockstep_batches, lockstep_bytes,
                        sub_round_bytes)
from ..hardware import HardwareProfile, LinkProfile, hardware_names, load_hardware
from ..heads import head_places
from ..inventory import ModelSpec
from ..settings import expert_place
from ..plan import Plan
from ..plan.inverse import rebuild_model
from ..planning import coupled
from ..sharing import pair_link, pair_timeline, shared_piece, tp_pair_piece, tp_sub_piece
from ..tp.context import Run, lockstep_seconds
from .engine import (BucketWork, GroupWork, RankWork, StepSim, Workload,
                     forward_backward_seconds, simulate, split_forward_backward)


def _a2a(matrix: Sequence[Sequence[int]], elem_bytes: int,
         link: LinkProfile) -> tuple[float, int]:
    """All-to-all time and busiest rank's off-rank bytes for ``matrix[src][dst]`` elements."""
    b = all_to_all_busiest(matrix) * elem_bytes
    return (link.seconds(b) if b else 0.0), b


def _pinned_ranks(plan: Plan) -> dict[str, int]:
    """Parameter → the one TP rank of its owner that computes it: expert matrices at expert TP
    1 under tp > 1, whole on the GPU whose expert-DP rank the cuts give them."""
    inp = plan.inputs
    if inp.etp == inp.tp:
        return {}
    out = {}
    for buf in plan.buffers:
        if not buf.expert:
            continue
        for b in buf.buckets:
            for s in b.slots:
                r = max(i for i, c in enumerate(b.cuts[:-1]) if c <= s.start)
                t = expert_place(r, buf.ep_rank, ep=inp.ep, tp=inp.tp, etp=inp.etp)[1]
                if t is not None:
                    out[s.name] = t
    return out


def _head_ranks(plan: Plan) -> dict[int, int]:
    """Task id → the TP rank that computes it, for the heads of an attention weight split per
    head (``heads``): each is whole in one TP rank's shard."""
    if plan.inputs.tp == 1 or not plan.inputs.optimizer.records_heads:
        return {}
    return {i: r for i, (r, _) in head_places(plan.tasks, plan.inputs.tp).items()}


def workload_from_plan(plan: Plan, hw: HardwareProfile, *, matrix_dtype: str = "bf16",
                       adamw_dtype: str = "bf16") -> Workload:
    """The workload of ``plan`` on ``hw`` (the bucket methods the plan records)."""
    key = (matrix_dtype, adamw_dtype)
    got = _WORKLOADS.get((plan, hw), key)
    if got is None:
        got = _WORKLOADS.put((plan, hw), key, _workload(plan, hw, matrix_dtype, adamw_dtype))
    return got  # type: ignore[return-value]


#: The last workloads made, by plan and profile (both frozen): the planner simulates the plan
#: it keeps, and ``canzona plan``'s summary simulates it again.
_WORKLOADS = Kept(4)


def _workload(plan: Plan, hw: HardwareProfile, matrix_dtype: str, adamw_dtype: str) -> Workload:
    inp = plan.inputs
    dp, tp, ep = inp.dp, inp.tp, inp.ep
    _, dp_link = plan_link(hw, dp, tp)
    tp_link = hw.link(tp)
    roof, adam_roof = Roofline.of(hw, matrix_dtype), Roofline.of(hw, adamw_dtype)
    mat_rate = roof.rate
    settings = inp.optimizer
    work = {t.id: work_of(t.shape, t.optimizer, settings) for t in plan.tasks}

    def seconds(i: int, share: float = 1.0, flops: float | None = None) -> float:
        """Task ``i``'s roofline seconds; a piece: ``flops`` at the rate, ``share`` of the
        task's memory time."""
        if flops is None:
            return roof.seconds(work[i]) * share
        return flops / mat_rate + roof.memory_s(work[i]) * share
    if tp > 1 and plan.tp is None:
        raise ValueError("plan has tp > 1 but no TP schedule")

    # Buckets: collectives under the recorded method; ready at their end's share of the buffer.
    buckets: list[BucketWork] = []
    slices = buffer_slices(plan.buffers, ep, tp=tp, etp=inp.etp)
    k = 0
    for bi, buf in enumerate(plan.buffers):
        total = max((b.end for b in buf.buckets), default=0) or 1
        for b in buf.buckets:
            s = slices[k]
            k += 1
            c = bucket_comm(b.method, s.sizes, grad_bytes=s.grad_bytes,
                            param_bytes=s.param_bytes, link=dp_link)
            buckets.append(BucketWork(f"{bi}.{b.index}", b.end / total, s.dp_indices,
                                      c.reduce.seconds(dp_link), c.gather.seconds(dp_link),
                                      b.method, c.reduce.busiest, c.gather.busiest))

    # Element-wise (unowned) tasks: FLOPs per element of the logical parameter.
    per_elem: dict[str, list[int]] = {}
    for task in plan.tasks:
        if task.owner is None:
            acc = per_elem.setdefault(task.param, [0, 0])
            acc[0] += task.flops
            acc[1] += math.prod(task.shape) if task.shape else 1
    adam_flops = [0.0] * (dp * tp)
    adam_elems = [0] * (dp * tp)  # their roofline: ADAMW_BYTES_PER_ELEMENT each
    for buf in plan.buffers:
        for b in buf.buckets:
            for slot in b.slots:
                acc = per_elem.get(slot.name)
                if acc is None or acc[1] == 0:
                    continue
                for r in range(len(b.cuts) - 1):
                    lo, hi = max(slot.start, b.cuts[r]), min(slot.end, b.cuts[r + 1])
                    if hi <= lo:
                        continue
                    d, pin = (expert_place(r, buf.ep_rank, ep=ep, tp=tp, etp=inp.etp)
                              if buf.expert else (r, None))
                    f = acc[0] * (hi - lo) / acc[1]  # the slot is this TP rank's shard
                    for t in range(tp) if pin is None else (pin,):
                        adam_flops[d * tp + t] += f
                        adam_elems[d * tp + t] += hi - lo

    # Matrix tasks outside the micro-groups: whole on every TP rank of the owner (replicated or
    # tp = 1). Tasks in micro-groups: on their host, in their group.
    grouped = set()
    if plan.tp is not None:
        for ix in plan.tp.indices:
            for g in ix.groups:
                grouped.update(gt.id for gt in g.tasks)
            grouped.update(x.id for x in ix.shared)
    # DP pairs at tp = 1 (at tp > 1 a pair's halves are in its two TP groups' shared phases)
    pairs = {x.id: x for x in plan.dp_shared} if tp == 1 else {}
    mat_flops = [0] * (dp * tp)
    mat_s = [0.0] * (dp * tp)
    waits = [0.0] * (dp * tp)  # DP pairs: their runs' time beyond the pieces' own compute
    pinned = _pinned_ranks(plan)
    heads = _head_ranks(plan)
    for task in plan.tasks:
        if task.owner is not None and task.id not in grouped and task.id not in pairs:
            pin = heads.get(task.id, pinned.get(task.param))
            secs = seconds(task.id)
            for t in range(tp) if pin is None else (pin,):
                mat_flops[task.owner * tp + t] += task.flops
                mat_s[task.owner * tp + t] += secs
    runs: dict[tuple[int, tuple[int, int]], list[Run]] = {}
    for x in pairs.values():  # tp = 1: each of the two ranks computes its piece
        rows, cols = plan.tasks[x.id].shape
        for d, f in zip(x.owners, x.flops):
            mat_flops[d] += f
            mat_s[d] += seconds(x.id, 0.5, f)
        if inp.optimizer.spec.gram_shared:  # shared Newton–Schulz: exchanges with the partner
            o = shared_piece("dp", 2, x.split_poly, max(rows, cols), min(rows, cols),
                             inp.optimizer.ns_steps, ELEMENT_BYTES[matrix_dtype],
                             pair_link(hw, x.owners), rate=mat_rate, exchange=rows < cols)
            runs.setdefault((x.phase, tuple(x.owners)), []).append(
                (seconds(x.id, 0.5, o.piece_flops), o.comm_s, o.hidden_s))
    # The runtime runs the pairs first, phase by phase, each pair's matrices in lockstep: a pair
    # starts when both partners are free, so waits chain along pairs of later phases.
    free = pair_timeline(runs, inp.optimizer.ns_steps, dp * tp)
    for (_, pair), pieces in runs.items():
        for d in pair:
            waits[d] -= sum(c for c, _, _ in pieces)
    waits = [w + f for w, f in zip(waits, free)]

    flops_of = {task.id: task.flops for task in plan.tasks}
    groups: list[tuple[GroupWork, ...]] = []
    if plan.tp is not None:
        eb = ELEMENT_BYTES[plan.tp.comm_dtype]
        by_index = {ix.dp_index: ix for ix in plan.tp.indices}
        steps = inp.optimizer.ns_steps
        # d → (FLOPs, seconds of the halves' part, of the own part, compute)
        phases: dict[int, tuple[int, float, float, float]] = {}
        partners: list[set[int]] = [set() for _ in range(dp)]
        for d in range(dp):
            ix = by_index.get(d)
            if ix is not None and ix.shared:
                # The shared tasks first, every TP rank alike, in lockstep: each rank's
                # Newton–Schulz FLOPs, the Gram all-reduces (and split-polynomial all-gathers)
                # of each matrix running while the others compute (``lockstep_seconds``); a
                # half shared with a partner index over k = 2·tp (``tp_pair_piece``).
                fl, pieces, sizes, half = 0, [], [], []
                cap = LOCKSTEP_CMAX * plan.tp.cmax_bytes
                for x in ix.shared:
                    if inp.optimizer.spec.block_hosted:  # its shard's blocks, no collective
                        local = work_of(plan.tp.layouts[x.layout].local_shape, "matrix",
                                        settings)
                        fl += local.flops
                        pieces.append((roof.seconds(local), 0.0, 0.0))
                        sizes.append(0)
                        half.append(False)
                        continue
                    rows, cols = plan.tasks[x.id].shape
                    m, n = max(rows, cols), min(rows, cols)
                    if x.sub is not None:  # a round of TP sub-groups: one piece per rank
                        if x.sub.slot:
                            continue  # its round's first task stands for it
                        k = x.sub.k
                        o = tp_sub_piece(tp, k, x.split_poly, m, n, steps,
                                         ELEMENT_BYTES[matrix_dtype], tp_link, rate=mat_rate)
                        fl += o.piece_flops
                        pieces.append((seconds(x.id, 1 / k, o.piece_flops) + o.moved_s,
                                       o.comm_s, o.hidden_s))
                        sizes.append(sub_round_bytes(m, n, tp, k, x.split_poly,
                                                     ELEMENT_BYTES[matrix_dtype]))
                        half.append(False)
                        continue
                    if x.partner is None:
                        k = tp
                        o = shared_piece("tp", tp, x.split_poly, m, n, steps,
                                         ELEMENT_BYTES[matrix_dtype], tp_link, rate=mat_rate)
                    else:
                        k = 2 * tp
                        partners[d].add(x.partner)
                        o = tp_pair_piece(tp, x.split_poly, m, n, steps,
                                          ELEMENT_BYTES[matrix_dtype], tp_link, hw.link(2 * tp),
                                          rate=mat_rate)
                    fl += o.piece_flops
                    pieces.append((seconds(x.id, 1 / k, o.piece_flops), o.comm_s, o.hidden_s))
                    sizes.append(lockstep_bytes(-(-m // k), n, k, x.split_poly,
                                                ELEMENT_BYTES[matrix_dtype]))
                    half.append(x.partner is not None)
                # the runtime runs the halves first, then the own matrices (``runtime.tp_shared``):
                # the batches holding a half end together on both partners
                order = sorted(range(len(pieces)), key=lambda j: not half[j])
                secs = [0.0, 0.0]
                for b in lockstep_batches(order, [sizes[j] for j in order], cap):
                    secs[0 if any(half[j] for j in b) else 1] += \
                        lockstep_seconds([pieces[j] for j in b], steps)
                phases[d] = (fl, secs[0], secs[1], sum(c for c, _, _ in pieces))
        # partners exchange every iteration: they end their halves' part together
        ends = coupled([phases[d][1] if d in phases else 0.0 for d in range(dp)], partners)
        for d in range(dp):
            ix = by_index.get(d)
            gs = []
            if d in phases:
                fl, _, own, comp = phases[d]
                # compute as compute; what the lockstep does not hide of the collectives as TP
                gs.append(GroupWork(0.0, max(0.0, ends[d] + own - comp), (comp,) * tp, 0,
                                    (fl,) * tp, barrier=True))
            for g in (ix.groups if ix else ()):
                fl, secs = [0] * tp, [0.0] * tp
                for gt in g.tasks:
                    fl[gt.host] += flops_of[gt.id]
                    secs[gt.host] += seconds(gt.id)
                gs_s, gb = _a2a(g.gather_send, eb, tp_link)
                sc_s, _ = _a2a(g.scatter_send, eb, tp_link)
                gs.append(GroupWork(gs_s, sc_s, tuple(secs), gb, tuple(fl)))
            groups.append(tuple(gs))

    ranks = tuple(RankWork(mat_s[r] + waits[r],
                           adam_roof.seconds(TaskCost(round(adam_flops[r]), 0, 0,
                                                      adam_elems[r] * ADAMW_BYTES_PER_ELEMENT)),
                           mat_flops[r], int(round(adam_flops[r]))) for r in range(dp * tp))
    notes = (f"hardware {hw.name} v{hw.version}; each task at its roofline: matrix work in "
             f"{matrix_dtype} at {hw.compute_efficiency:g} of peak, AdamW in {adamw_dtype}, "
             f"memory-bound passes over {hw.memory_bandwidth / 1e12:g} TB/s",
             f"DP link {'intra' if dp_link is hw.intra_node else 'inter'}-node "
             f"({dp_link.busbw / 1e9:g} GB/s, α {dp_link.latency_s * 1e6:g} µs); TP link "
             f"{'intra' if tp_link is hw.intra_node else 'inter'}-node")
    if (plan.comm.hardware, plan.comm.hardware_version) != (hw.name, hw.version):
        notes += (f"the plan's bucket methods were chosen for {plan.comm.hardware} "
                  f"v{plan.comm.hardware_version}; simulated as recorded on {hw.name}",)
    label = f"{inp.model} dp{dp} tp{tp}" + (f" ep{ep}" if ep > 1 else "") + \
        f" {inp.solver.strategy}"
    return Workload(dp, tp, ranks, tuple(buckets), tuple(groups) if plan.tp is not None else (),
                    label, notes)


def plan_hardware(plan: Plan, name: str | None = None) -> HardwareProfile:
    """The profile to simulate ``plan`` on: ``name`` (a built-in profile or a file), else the one
    the plan records (``plan.comm.hardware``).

    Raises:
        CanzonaError: an unknown name or a bad file, or a recorded profile that is not built in.
    """
    if name is not None:
        return load_hardware(name)
    rec = plan.comm.hardware
    if rec.lower() not in hardware_names():
        raise CanzonaError(f"the plan was made with hardware profile '{rec}', which is not "
                           f"built in; give --hardware {'|'.join(hardware_names())} or a "
                           f"profile file (.json).")
    return load_hardware(rec)


def simulate_plan(plan: Plan, hw: HardwareProfile, *, backward_s: float = 0.0,
                  overlap_param_gather: bool = False, forward_s: float = 0.0,
                  matrix_dtype: str = "bf16", adamw_dtype: str = "bf16") -> StepSim:
    """:func:`simulate` of :func:`workload_from_plan`."""
    work = workload_from_plan(plan, hw, matrix_dtype=matrix_dtype, adamw_dtype=adamw_dtype)
    return simulate(work, backward_s=backward_s, overlap_param_gather=overlap_param_gather,
                    forward_s=forward_s)


def active_params(spec: ModelSpec) -> float:
    """Parameters one token's forward and backward multiply by: every parameter but the input
    embedding's lookup table (when untied, or on a pipeline's first stage, whose tied output
    product runs on the last stage's copy), MoE experts scaled by top-k / experts."""
    cfg = spec.config
    frac = (cfg.experts_per_token / cfg.num_experts) if cfg is not None and cfg.is_moe else 1.0
    tied = cfg.tied_embeddings if cfg is not None else False
    if spec.stage is not None and spec.stage.pp > 1:
        tied = False  # the output layer's product runs on the last stage, on its copy
    n = 0.0
    for p in spec.params:
        if p.kind == "embedding" and not tied:
            continue
        n += p.numel * (frac if p.is_expert else 1.0)
    return n


#: One sequence of this many tokens per DP rank: the forward/backward model's default batch.
DEFAULT_SEQ = 4096
#: The model FLOP utilisation of forward and backward the step is simulated behind.
DEFAULT_MFU = 0.4


def plan_forward_backward(plan: Plan, hw: HardwareProfile, *, tokens: int | None = None,
                          seq: int = DEFAULT_SEQ, mfu: float = DEFAULT_MFU) -> tuple[float, str]:
    """Forward + backward of one iteration of ``plan``'s model, as ``canzona compare`` takes it:
    ``6 · N_active · tokens`` at ``mfu`` of the profile's bf16 peak over ``dp · tp`` GPUs
    (``tokens`` default ``dp · seq``). Returns the seconds and one line saying how they were
    found; a live module's plan (its model not rebuildable) counts all its parameters active."""
    key = (tokens, seq, mfu)
    got = _FORWARD_BACKWARD.get((plan, hw), key)
    if got is None:
        got = _FORWARD_BACKWARD.put((plan, hw), key,
                                    _forward_backward(plan, hw, tokens, seq, mfu))
    return got  # type: ignore[return-value]


#: The last forward/backward models, by plan and profile (both frozen).
_FORWARD_BACKWARD = Kept(4)


def _forward_backward(plan: Plan, hw: HardwareProfile, tokens: int | None, seq: int,
                      mfu: float) -> tuple[float, str]:
    inp = plan.inputs
    tokens = tokens if tokens is not None else inp.dp * seq
    spec = rebuild_model(plan) if inp.model_source != "hf_config" else None
    n = active_params(spec) if spec is not None else float(plan.total_params)
    what = "active" if spec is not None else "all (the model is not rebuilt from the plan)"
    seconds = forward_backward_seconds(n, tokens, hw, world=inp.dp * inp.tp, mfu=mfu)
    return seconds, (f"6 · {n / 1e9:.2f} B parameters ({what}) · {tokens:,} tokens at MFU "
                     f"{mfu:g} of {hw.name}'s bf16 peak")


def simulate_plan_behind(plan: Plan, hw: HardwareProfile, *, forward_backward_s: float,
                         overlap_param_gather: bool = False) -> StepSim:
    """:func:`simulate_plan` behind one iteration's forward/backward (backward two thirds of it,
    as ``canzona compare`` runs every strategy)."""
    fwd, bwd = split_forward_backward(forward_backward_s)
    return simulate_plan(plan, hw, backward_s=bwd, forward_s=fwd,
                         overlap_param_gather=overlap_param_gather)
