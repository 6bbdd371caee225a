"""Shared Newton–Schulz: a matrix's Muon update computed by 2 gloo ranks, each
holding a row block of the long-dimension-oriented matrix, equals canzona's single-device Muon
(``Muon.direction``/``apply`` on the whole matrix) within 1e-5 relative over 10 steps, float32
Newton–Schulz, with and without the polynomial split: tall, wide (transposed), square, fused
gate/up (Megatron's stride-2 TP shards), a row-parallel TP shard, a DP row cut, uneven and empty
row blocks, the quintic schedule, overflowing and underflowing inputs; with k = 1 bitwise the
single-device result. One spawn of 2 ranks runs every case; the references run here. A spawn
of 4 ranks (two DP indices × two TP ranks) runs the k > tp cases: a TP-split weight whose shards
are each cut between a DP pair (``TPPair``), a lockstep of matrices with a group each, and the
four as TP sub-groups (``sub_groups.sub_group_newton_schulz``: one TP group of 4 with k = 1, 2,
4 strided ranks, 4/k matrices side by side; two TP groups of 2); a spawn of 6 ranks, one TP
group of 6 with sub-groups of 2 and 3.
Single-process tests cover the orientation helpers, the cost formulas and argument checks."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dp_helpers import results, run_world
from optim_helpers import rel_err

from canzona.runtime.optim import Muon, MuonConfig
from canzona.runtime.optim.muon import newton_schulz
from canzona.runtime.optim.orientation import dp_row_block, orientation, tp_row_blocks
from canzona.runtime.optim.shared_ns import shared_newton_schulz
from canzona.runtime.optim.transports import PeerPair, TPPair

STEPS = 10
TP = 2  # the TP group of the k > tp cases (4 ranks: two DP indices × two TP ranks)
LR, WD = 0.02, 0.1
TOL = 1e-5


# -- the Muon run, shared or whole -------------------------------------------------------------


def _config(spec: dict) -> MuonConfig:
    return MuonConfig(lr=LR, weight_decay=WD, ns_dtype=torch.float32,
                      ns_coefficients=spec.get("coefficients", (3.4445, -4.7750, 2.0315)),
                      eps=spec.get("eps", 1e-7))


def _param0(spec: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(spec["shape"], generator=g) * 0.1 * spec.get("theta_scale", 1.0)


def _grad(theta: torch.Tensor, step: int, spec: dict, index) -> torch.Tensor:
    """The step's gradient, elementwise in θ (so a rank computes its rows from its own rows):
    fresh noise (scaled by ``grad0_scale`` at step 0) plus a pull towards θ, which makes every
    step's input depend on the last."""
    g = torch.Generator().manual_seed(100 + step)
    noise = torch.randn(spec["shape"], generator=g) * (spec.get("grad0_scale", 1.0) if step == 0
                                                      else 1.0)
    return index(noise) + 0.5 * theta


def reference(spec: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Single-device: canzona's Muon on the whole stored matrix; per step the orthogonalised
    update and the final parameter."""
    shape = spec["shape"]
    opt = Muon(_config(spec))
    theta = _param0(spec)
    state = opt.init_state(shape)
    ortho = []
    for step in range(STEPS):
        g = _grad(theta, step, spec, lambda t: t)
        (o,) = opt.direction([g], [state])
        ortho.append(o.clone())
        opt.apply(theta, o)
    return ortho, theta


def _rows_of(spec: dict, world: int, rank: int):
    """The orientation and this rank's oriented rows (ranges), from the spec's partition."""
    shape = spec["shape"]
    if spec.get("group") == "tp_pair":  # TP rank t's shard, its first `cut` rows on DP index 0
        d, t = divmod(rank, TP)
        o, blocks = tp_row_blocks(shape, spec["tp_split_dim"], TP, stride=spec.get("stride", 1))
        rows = [i for a, b in blocks[t] for i in range(a, b)]
        rows = rows[:spec["cut"]] if d == 0 else rows[spec["cut"]:]
        return o, [(i, i + 1) for i in rows]
    if "tp_split_dim" in spec:
        o, blocks = tp_row_blocks(shape, spec["tp_split_dim"], world, stride=spec.get("stride", 1))
        return o, blocks[rank]
    o = orientation(shape)
    m = o.oriented_shape[0]
    counts = spec.get("counts") or [m // world + (r < m % world) for r in range(world)]
    start = sum(counts[:rank])
    if spec.get("dp"):  # a ZeRO-1 element range moved to row boundaries
        cols = shape[1]
        return o, [dp_row_block(shape, start * cols, (start + counts[rank]) * cols)]
    return o, [(start, start + counts[rank])]


def _stored_shard(full: torch.Tensor, spec: dict, ranges) -> torch.Tensor:
    """What a TP rank stores: Megatron's shard of the canonical matrix along its split dim."""
    d = spec["tp_split_dim"]
    return torch.cat([full.narrow(d, a, b - a) for a, b in ranges], dim=d)


def shared_case(rank: int, world: int, spec: dict) -> dict:
    """This rank's part of the Muon run: momentum and parameter of its rows only, the update
    orthogonalised by ``shared_newton_schulz`` over the spec's group."""
    import torch.distributed as dist

    shape = spec["shape"]
    cfg = _config(spec)
    kind = spec.get("group", "world")
    if kind == "pair":  # a sub-group, created once (here: both ranks)
        group = dist.new_group([0, 1])
    elif kind == "tp_pair":  # ranks d·TP + t: TP groups per DP index d, pairs (t, TP + t)
        d, t = divmod(rank, TP)
        tp_groups = [dist.new_group([e * TP + u for u in range(TP)]) for e in range(world // TP)]
        group = TPPair(tp_groups[d], PeerPair((t, TP + t), d))
    elif kind == "self":  # k = 1: every rank alone
        groups = [dist.new_group([r]) for r in range(world)]
        group = groups[rank]
    else:
        group = None
    if kind == "self":
        o, ranges = orientation(shape), [(0, orientation(shape).oriented_shape[0])]
    else:
        o, ranges = _rows_of(spec, world, rank)
    idx = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.arange(0)

    def mine(full: torch.Tensor) -> torch.Tensor:
        if kind == "self":  # the whole matrix, oriented as a view (the reference's layout)
            return o.orient(full)
        return o.orient(full)[idx]

    theta = mine(_param0(spec))
    if "tp_split_dim" in spec and kind != "tp_pair":  # the shard, oriented, is these rows
        shard = _stored_shard(_param0(spec), spec, ranges)
        assert torch.equal(o.orient(shard), theta)
    buf = torch.zeros_like(theta)
    kernel = Muon(cfg)
    ortho = []
    for step in range(STEPS):
        g = _grad(theta, step, spec, mine)
        buf.lerp_(g, 1 - cfg.momentum)
        update = g.lerp(buf, cfg.momentum) if cfg.nesterov else buf
        out = shared_newton_schulz(
            update, group=group, coefficients=cfg.ns_coefficients, steps=cfg.ns_steps,
            eps=cfg.eps, dtype=cfg.ns_dtype, split_polynomial=spec.get("split", False),
            timeout_s=20, what=spec["name"])
        assert out.shape == update.shape and out.dtype == cfg.ns_dtype
        ortho.append(out.clone())
        kernel.apply(theta, out, full_shape=shape)
    return {"idx": idx, "ortho": ortho, "theta": theta, "transpose": o.transpose}


def _spec(name: str, shape, **kw) -> dict:
    return {"name": name, "shape": shape, **kw}


BASE = [
    _spec("tall", (96, 32)),
    _spec("wide", (40, 112)),
    _spec("square", (48, 48)),
    _spec("odd", (77, 29)),
    # fused gate/up [gate; up] (2·ffn × hidden), Megatron's stride-2 TP shards [gate_r; up_r]
    _spec("gate_up_tp", (2 * 64, 40), tp_split_dim=0, stride=2),
    # a row-parallel weight (down_proj, hidden × ffn): TP shards along its long dim, transposed
    _spec("row_parallel_tp", (40, 96), tp_split_dim=1),
    # a square row-parallel weight (o_proj with heads·head_dim = hidden): transposed as well
    _spec("square_row_parallel_tp", (48, 48), tp_split_dim=1),
    # a tall weight cut by ZeRO-1 at a row boundary, unevenly (DP pair)
    _spec("dp_cut", (90, 36), dp=True, counts=[61, 29], group="pair"),
    _spec("uneven", (64, 48), counts=[3, 61]),
    _spec("one_row", (50, 20), counts=[49, 1]),
    _spec("empty_rank", (60, 24), counts=[0, 60]),
    _spec("quintic", (72, 40), coefficients="quintic"),
    # ‖X‖²_F overflows float32 (the momentum keeps it there): the guard's slow path; on one
    # device the norm is inf and the update zero, every step
    _spec("huge", (64, 24), grad0_scale=1e20),
    # the unnormalised Gram underflows (subnormal squares; a norm above a smaller eps): step 0
    # takes the slow path, the norm rounded as on one device
    _spec("tiny", (64, 24), theta_scale=1e-22, grad0_scale=1e-22, eps=1e-30),
    # ‖X‖_F < eps at step 0: divided by eps, as on one device
    _spec("below_eps", (64, 24), theta_scale=1e-11, grad0_scale=1e-11),
]
SHARED = [dict(s, name=f"{s['name']}-{'split' if split else 'full'}", split=split)
          for s in BASE for split in (False, True)]
ALONE = [_spec("k1-tall", (96, 32), group="self"), _spec("k1-wide", (40, 112), group="self"),
         _spec("k1-split", (64, 48), group="self", split=True)]
SPECS = {s["name"]: s for s in SHARED + ALONE}


# k = 2·tp = 4: a TP-split weight whose shards are each cut at a row boundary between two DP
# indices (TPPair: the Gram all-reduced over the TP group, then summed with the partner's)
TP_PAIR = [dict(s, name=f"{s['name']}-{'split' if split else 'full'}", split=split,
                group="tp_pair")
           for s in [
               # fused gate/up, Megatron's stride-2 shards [gate_t; up_t], cut inside each
               _spec("tp_pair_gate_up", (2 * 64, 40), tp_split_dim=0, stride=2, cut=41),
               _spec("tp_pair_column", (96, 32), tp_split_dim=0, cut=30),
               # a row-parallel weight: its shard's oriented rows are stored columns
               _spec("tp_pair_row_parallel", (40, 96), tp_split_dim=1, cut=17),
               # DP index 0 holds none of the rows (a cut at the shard's start)
               _spec("tp_pair_empty", (64, 24), tp_split_dim=0, cut=0),
               # n = 11: chunks of 30, 21, 15 and 3 packed elements, padded to even sizes for
               # the TP group's reduce-scatter (gaps between chunks)
               _spec("tp_pair_odd_n", (48, 11), tp_split_dim=0, cut=10),
               # ‖X‖²_F overflows float32: the guard's scalar and Gram all-reduces over k ranks
               _spec("tp_pair_huge", (64, 24), tp_split_dim=0, cut=21, grad0_scale=1e20)]
           for split in (False, True)]
SPECS.update({s["name"]: s for s in TP_PAIR})


def bf16_case(rank: int, world: int) -> dict:
    """bfloat16 iteration (Muon's default dtype): the Gram is all-reduced in bfloat16."""
    full = _param0({"shape": (80, 32)})
    rows = slice(0, 50) if rank == 0 else slice(50, 80)
    out = {}
    for split in (False, True):
        out[split] = shared_newton_schulz(full[rows], dtype=torch.bfloat16,
                                          split_polynomial=split, what="bf16")
    return out


def many_case(rank: int, world: int) -> dict:
    """Three matrices in lockstep (``shared_newton_schulz_many``: tall, square and one whose
    Gram overflows float32 before normalising, split and not) against each alone, in float32 and
    bfloat16: the results must be the same bits."""
    from canzona.runtime.optim.shared_ns import shared_newton_schulz_many

    g = torch.Generator().manual_seed(7)
    fulls = [torch.randn(96, 24, generator=g), torch.randn(40, 40, generator=g),
             torch.randn(64, 16, generator=g) * 1e30]
    parts = [f[:f.shape[0] // 3] if rank == 0 else f[f.shape[0] // 3:] for f in fulls]
    splits = [False, True, False]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        many = shared_newton_schulz_many(parts, dtype=dtype, split_polynomial=splits,
                                         what=["a", "b", "c"])
        alone = [shared_newton_schulz(b, dtype=dtype, split_polynomial=sp)
                 for b, sp in zip(parts, splits)]
        out[str(dtype)] = [torch.equal(x, y) for x, y in zip(many, alone)]
        out[str(dtype) + "/finite"] = [bool(torch.isfinite(x).all()) for x in many]
    return out


def chunks_case(rank: int, world: int) -> dict:
    """Every collective a lockstep launches, in order (a flight recorder's view): per step each
    matrix's Gram all-reduced in ``formulas.gram_chunks`` chunks, each launched once its rows
    are computed, then the split polynomial's all-gather; over the world and over a
    :class:`PeerPair` (point-to-point), with the results equal to the single-device kernel."""
    from canzona.runtime.optim import shared_ns
    from canzona.runtime.optim.shared_ns import shared_newton_schulz_many

    # each launch at step 0 (the packed buffer starts as zeros): its own chunk written, the
    # chunks after it not yet, and how many products (torch.mm: the Gram's chunks) ran before
    launches: list[tuple[int, bool, bool, int]] = []
    plain, mm = shared_ns.all_reduce, torch.mm
    products = [0]

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        products[0] += 1
        return mm(*args, **kwargs)

    def spy(t, group):  # noqa: ANN001, ANN202
        base = t._base
        if base is not None and t.dim() == 1:
            at = t.storage_offset() - base.storage_offset()
            launches.append((base.data_ptr(), bool(t.ne(0).any()),
                             bool(base[at + t.numel():].eq(0).all()), products[0]))
        return plain(t, group)

    shared_ns.all_reduce, torch.mm = spy, counted

    class Recorder:
        def __init__(self) -> None:
            self.names: list[str] = []

        def add(self, name: str, work) -> None:  # noqa: ANN001
            self.names.append(name)

    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(80, 64, generator=g), torch.randn(30, 17, generator=g)]
    parts = [f[:f.shape[0] // 2] if rank == 0 else f[f.shape[0] // 2:] for f in fulls]
    out = {}
    for kind, group in (("world", None), ("peer", PeerPair((0, 1), rank))):
        rec = Recorder()
        got = shared_newton_schulz_many(parts, group=group, dtype=torch.float32, steps=2,
                                        split_polynomial=[True, False], what=["a", "b"],
                                        flight=rec)
        out[kind] = (rec.names, [x.clone() for x in got])
        step0 = {}
        for ptr, mine, later, before in launches:
            step0.setdefault(ptr, []).append((mine, later, before))
        out[kind + "/step0"] = [v for v in step0.values()]
        launches.clear()
        products[0] = 0
    shared_ns.all_reduce, torch.mm = plain, mm
    return out


def mismatch_case(rank: int, world: int) -> str:
    """A rank outside the group cannot take part."""
    import torch.distributed as dist

    only0 = dist.new_group([0])
    if rank == 1:
        try:
            shared_newton_schulz(torch.ones(4, 2), group=only0)
        except (ValueError, RuntimeError) as exc:
            return type(exc).__name__
        return "no error"
    return "skipped"


def timeout_case(rank: int, world: int):
    """Rank 1 never joins: rank 0's wait ends in CollectiveTimeoutError naming the matrix (on a
    group of its own, so the rest of the world is unaffected; last case of the spawn)."""
    import time

    import torch.distributed as dist

    from canzona.runtime.errors import CollectiveTimeoutError

    lonely = dist.new_group([0, 1])
    if rank == 1:
        return None
    t0 = time.perf_counter()
    try:
        shared_newton_schulz(torch.ones(6, 3), group=lonely, timeout_s=0.5, what="layers.0.w")
    except CollectiveTimeoutError as exc:
        return str(exc), time.perf_counter() - t0
    return "no timeout"


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cases = [(s["name"], partial(shared_case, spec=s)) for s in SHARED + ALONE]
    cases += [("bf16", bf16_case), ("many", many_case), ("chunks", chunks_case),
              ("outsider", mismatch_case),
              ("timeout", timeout_case)]
    return run_world(2, cases, str(tmp_path_factory.mktemp("shared_ns")))


def mixed_case(rank: int, world: int) -> dict:
    """One lockstep of matrices shared by different ranks (a group per matrix): one by this DP
    index's TP group, one by the TP group and the partner DP index (TPPair, split and not), one
    by this rank alone — each the same bits as computed alone."""
    import torch.distributed as dist

    from canzona.runtime.optim.shared_ns import shared_newton_schulz_many

    d, t = divmod(rank, TP)
    tp_groups = [dist.new_group([e * TP + u for u in range(TP)]) for e in range(world // TP)]
    self_groups = [dist.new_group([r]) for r in range(world)]
    pair = TPPair(tp_groups[d], PeerPair((t, TP + t), d))
    g = torch.Generator().manual_seed(11 + d)  # each DP index's own TP-shared matrix
    own = torch.randn(2 * TP * 12, 20, generator=g)[rank % TP::TP]
    g = torch.Generator().manual_seed(5)  # the same matrix on all four ranks
    both = torch.randn(4 * 15, 24, generator=g)[rank::world]
    alone = torch.randn(30, 16, generator=g)
    blocks = [own, both, both, alone]
    groups = [tp_groups[d], pair, pair, self_groups[rank]]
    splits = [False, False, True, False]
    many = shared_newton_schulz_many(blocks, group=groups, dtype=torch.float32,
                                     split_polynomial=splits)
    each = [shared_newton_schulz(b, group=gr, dtype=torch.float32, split_polynomial=sp)
            for b, gr, sp in zip(blocks, groups, splits)]
    return {"same": [torch.equal(x, y) for x, y in zip(many, each)], "both": many[1]}


# TP sub-groups: per layout, the TP groups' ranks and, per k, the matrices side by side (one per
# sub-group); each TP group its own matrices (a sum across groups would not go unnoticed)
SUB_LAYOUTS = {
    "one4": ([[0, 1, 2, 3]], {
        4: [_spec("sub_tall", (96, 32), tp_split_dim=0)],
        2: [_spec("sub_gate_up", (2 * 64, 40), tp_split_dim=0, stride=2),
            _spec("sub_row_parallel", (40, 96), tp_split_dim=1)],
        1: [_spec("sub_column", (64, 24), tp_split_dim=0),
            _spec("sub_square_row_parallel", (48, 48), tp_split_dim=1),
            _spec("sub_gate_up1", (2 * 32, 20), tp_split_dim=0, stride=2),
            _spec("sub_wide", (24, 80), tp_split_dim=1)]}),
    # two TP groups of 2, each passed as its process group
    "two2": ([[0, 1], [2, 3]], {
        2: [_spec("sub2_tall", (64, 24), tp_split_dim=0)],
        1: [_spec("sub2_gate_up", (2 * 32, 20), tp_split_dim=0, stride=2),
            _spec("sub2_row_parallel", (24, 64), tp_split_dim=1)]}),
    # tp = 6: sub-groups of 2 (3 side by side) and of 3 (2 side by side), s ≠ k
    "one6": ([[0, 1, 2, 3, 4, 5]], {
        2: [_spec("sub6_tall", (96, 32), tp_split_dim=0),
            _spec("sub6_gate_up", (2 * 48, 40), tp_split_dim=0, stride=2),
            _spec("sub6_wide", (24, 72), tp_split_dim=1)],
        3: [_spec("sub6_row_parallel", (40, 96), tp_split_dim=1),
            _spec("sub6_square", (48, 48), tp_split_dim=1)]}),
}


def _sub_full(spec: dict, call: int, group: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + 100 * group + sum(spec["shape"]))
    return torch.randn(spec["shape"], generator=g)


def sub_group_case(rank: int, world: int, layout: str) -> dict:
    """Per k and call, this TP rank's rows of each slot's orthogonalised matrix
    (``sub_group_newton_schulz``), split and not; sub-groups created once per k."""
    import torch.distributed as dist

    from canzona.runtime.optim.sub_groups import sub_group_newton_schulz, tp_sub_groups

    tp_ranks, by_k = SUB_LAYOUTS[layout]
    pgs = [dist.new_group(g) for g in tp_ranks] if len(tp_ranks) > 1 else [None]
    g = next(i for i, ranks in enumerate(tp_ranks) if rank in ranks)
    t, tp = tp_ranks[g].index(rank), len(tp_ranks[g])
    out = {}
    for k, slots in by_k.items():
        subs = tp_sub_groups(tp_ranks, k, tp_group=pgs[g])
        assert (subs.rank, subs.slots, subs.slot) == (t, len(slots), t % len(slots))
        for call in range(2):
            shards = []
            for spec in slots:
                o, blocks = tp_row_blocks(spec["shape"], spec["tp_split_dim"], tp,
                                          stride=spec.get("stride", 1))
                shards.append(o.orient(_stored_shard(_sub_full(spec, call, g), spec, blocks[t])))
            for split in (False, True):
                got = sub_group_newton_schulz(shards, subs, dtype=torch.float32, steps=5,
                                              split_polynomial=split, timeout_s=20,
                                              what=[sp["name"] for sp in slots])
                assert [x.shape for x in got] == [x.shape for x in shards]
                out[(k, call, split)] = [x.clone() for x in got]
    return out


def sub_group_lockstep_case(rank: int, world: int) -> dict:
    """A sub-group's matrix in one lockstep with a matrix its whole TP group shares, as a
    runtime would run it: the gather started asynchronously, the lockstep (a group per
    matrix), then the return — each the same bits as alone."""
    from canzona.runtime.optim.shared_ns import shared_newton_schulz_many
    from canzona.runtime.optim.sub_groups import (sub_group_newton_schulz, sub_group_return,
                                                  sub_group_rows, tp_sub_groups)

    subs = tp_sub_groups([list(range(world))], 2)
    g = torch.Generator().manual_seed(21)
    whole = torch.randn(4 * 10, 24, generator=g)[rank::world]  # the TP group's own matrix
    shards = [torch.randn(4 * 9, 16, generator=g)[rank::world],
              torch.randn(4 * 6, 12, generator=g)[rank::world]]
    block, work = sub_group_rows(shards, subs, dtype=torch.float32, async_op=True)
    work.wait()
    got = shared_newton_schulz_many([whole, block], group=[None, subs.group],
                                    dtype=torch.float32, split_polynomial=[True, False])
    back, work = sub_group_return(got[1], shards, subs, async_op=True)
    work.wait()
    alone = shared_newton_schulz_many([whole], dtype=torch.float32, split_polynomial=True)[0]
    each = sub_group_newton_schulz(shards, subs, dtype=torch.float32)
    return {"same": [torch.equal(got[0], alone)] + [torch.equal(x, y) for x, y in
                                                     zip(back, each)]}


def sub_group_errors_case(rank: int, world: int) -> list[str]:
    """Bad sub-group arguments fail on every rank alike, before any collective (else the
    others would hang): a tp_group that is not the rank's TP group, TP ranks not ascending, a
    k that does not divide tp, groups that miss a rank."""
    import torch.distributed as dist

    from canzona.runtime.optim.sub_groups import tp_sub_groups

    pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = []
    for args, kw in ((([[0, 1], [2, 3]], 1), {}),  # tp_group left out: the world
                     (([[1, 0], [2, 3]], 1), {"tp_group": pgs[rank // 2]}),
                     (([[0, 1, 2, 3]], 3), {}),
                     (([[0, 1], [2, 2]], 1), {"tp_group": pgs[rank // 2]})):
        try:
            tp_sub_groups(*args, **kw)
        except ValueError as exc:
            out.append(str(exc))
        else:
            out.append("no error")
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    cases = [(s["name"], partial(shared_case, spec=s)) for s in TP_PAIR]
    cases.append(("mixed", mixed_case))
    cases += [(f"sub_{layout}", partial(sub_group_case, layout=layout))
              for layout in ("one4", "two2")]
    cases.append(("sub_errors", sub_group_errors_case))
    cases.append(("sub_lockstep", sub_group_lockstep_case))
    return run_world(2 * TP, cases, str(tmp_path_factory.mktemp("shared_ns4")))


THREE = [(96, 40), (150, 37), (61, 61)]  # n = 37, 61: not a multiple of 2k, uneven blocks


def three_case(rank: int, world: int) -> dict:
    """k = 3 (odd: the polynomial's 6 block rows pair up unevenly, and 37 and 61 do not split
    in them evenly): each rank's rows of each matrix, in lockstep, split and not."""
    from canzona.runtime.optim.shared_ns import shared_newton_schulz_many

    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(shape, generator=g) for shape in THREE]
    parts = [f[f.shape[0] * rank // world:f.shape[0] * (rank + 1) // world] for f in fulls]
    return {str(split): shared_newton_schulz_many(parts, dtype=torch.float32,
                                                  split_polynomial=split)
            for split in (False, True)}


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return run_world(3, [("three", three_case)], str(tmp_path_factory.mktemp("shared_ns3")))


def test_three_ranks_equal_single_device(world3):
    from canzona.runtime.optim.muon import _coefficient_schedule

    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(shape, generator=g) for shape in THREE]
    schedule = _coefficient_schedule((3.4445, -4.7750, 2.0315), 5)
    ranks = results(world3, "three")
    for split in ("False", "True"):
        for j, full in enumerate(fulls):
            got = torch.cat([r[split][j] for r in ranks])
            ref = newton_schulz(full, schedule, dtype=torch.float32)
            assert rel_err(got, ref) < TOL, (split, THREE[j], rel_err(got, ref))


def _assemble(parts: list[dict], m: int, n: int, key, step=None) -> torch.Tensor:
    full = torch.full((m, n), float("nan"))
    for p in parts:
        t = p[key] if step is None else p[key][step]
        full[p["idx"]] = t
    return full


@pytest.mark.slow
@pytest.mark.parametrize("name", [s["name"] for s in SHARED])
def test_shared_equals_single_device_muon(world2, name):
    spec = SPECS[name]
    parts = results(world2, name)
    idx = torch.cat([p["idx"] for p in parts])
    o = orientation(spec["shape"], spec.get("tp_split_dim"))
    m, n = o.oriented_shape
    assert sorted(idx.tolist()) == list(range(m)), "the ranks' rows partition the matrix"
    ortho_ref, theta_ref = reference(spec)
    errors = [rel_err(o.restore(_assemble(parts, m, n, "ortho", step)), ortho_ref[step])
              for step in range(STEPS)]
    errors.append(rel_err(o.restore(_assemble(parts, m, n, "theta")), theta_ref))
    assert all(e <= TOL for e in errors), f"{name}: {['%.1e' % e for e in errors]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [s["name"] for s in TP_PAIR])
def test_tp_group_and_dp_pair_equal_single_device_muon(world4, name):
    """k > tp: two TP ranks × two DP indices share one matrix, each rank a row block of its TP
    shard — the single-device Muon update within 1e-5, every step."""
    test_shared_equals_single_device_muon(world4, name)


@pytest.mark.slow
def test_a_lockstep_of_matrices_with_their_own_groups(world4):
    """Per-matrix groups in one lockstep: each result the bits it gets alone, and the TPPair
    matrix (rows dealt round-robin to the four ranks) the single-device orthogonalisation."""
    parts = results(world4, "mixed")
    assert all(all(p["same"]) for p in parts), [p["same"] for p in parts]
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4 * 15, 24, generator=g)
    got = torch.empty_like(full)
    for r, p in enumerate(parts):
        got[r::4] = p["both"]
    ref = newton_schulz(full, MuonConfig().schedule, dtype=torch.float32)
    assert rel_err(got, ref) < TOL


@pytest.fixture(scope="module")
def world6(tmp_path_factory):
    return run_world(6, [("sub_one6", partial(sub_group_case, layout="one6"))],
                     str(tmp_path_factory.mktemp("shared_ns6")))


def _check_sub_groups(ranks: list[dict], layout: str, k: int) -> None:
    from canzona.runtime.optim.muon import _coefficient_schedule

    schedule = _coefficient_schedule((3.4445, -4.7750, 2.0315), 5)
    tp_ranks, by_k = SUB_LAYOUTS[layout]
    for g, members in enumerate(tp_ranks):
        for call in range(2):
            for j, spec in enumerate(by_k[k]):
                full = _sub_full(spec, call, g)
                o, blocks = tp_row_blocks(spec["shape"], spec["tp_split_dim"], len(members),
                                          stride=spec.get("stride", 1))
                ref = o.orient(newton_schulz(full, schedule, dtype=torch.float32))
                for split in (False, True):
                    got = torch.full_like(ref, float("nan"))
                    for t, r in enumerate(members):
                        rows = torch.cat([torch.arange(a, b) for a, b in blocks[t]])
                        got[rows] = ranks[r][(k, call, split)][j]
                    assert rel_err(got, ref) < TOL, (layout, spec["name"], call, split,
                                                  rel_err(got, ref))


@pytest.mark.slow
@pytest.mark.parametrize("layout,k", [("one4", 4), ("one4", 2), ("one4", 1), ("two2", 2),
                                      ("two2", 1)])
def test_tp_sub_groups_equal_single_device(world4, layout, k):
    """A TP group as sub-groups of k strided ranks, tp/k matrices side by side (fused gate/up,
    row-parallel, square and wide ones): every TP rank gets back its shard's rows of its
    matrix's single-device orthogonalisation, split and not, within 1e-5 — one TP group of 4,
    and two of 2 (each passed as its process group; k = tp runs over the TP group's ranks, not
    the world's)."""
    _check_sub_groups(results(world4, f"sub_{layout}"), layout, k)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_tp_sub_groups_of_a_tp_group_of_6(world6, k):
    """tp = 6: sub-groups of 2 (three matrices side by side) and of 3 (two), so a rank's block
    (tp/k ranks) and its sub-group (k ranks) differ in size."""
    _check_sub_groups(results(world6, "sub_one6"), "one6", k)


@pytest.mark.slow
def test_a_sub_groups_matrix_runs_in_a_lockstep_with_its_gather_started_first(world4):
    assert all(all(p["same"]) for p in results(world4, "sub_lockstep"))


@pytest.mark.slow
def test_bad_tp_sub_group_arguments_fail_on_every_rank(world4):
    for messages in results(world4, "sub_errors"):
        assert "tp_group holds ranks [0, 1, 2, 3]" in messages[0], messages[0]
        assert "ascending" in messages[1] and "must divide" in messages[2], messages
        assert "every rank of the world" in messages[3], messages[3]


def test_tp_sub_group_arguments_are_checked():
    from canzona.runtime.optim.sub_groups import SubGroups, sub_group_newton_schulz

    subs = SubGroups(None, 4, 2, 1, None)
    with pytest.raises(ValueError, match="pass dtype"):
        sub_group_newton_schulz([torch.ones(3, 2), torch.ones(3, 2, dtype=torch.float64)], subs,
                                dtype=None)
    assert (subs.slots, subs.slot, list(subs.block)) == (2, 1, [0, 1])
    assert list(SubGroups(None, 8, 2, 6, None).block) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="one per sub-group"):
        sub_group_newton_schulz([torch.ones(3, 2)], subs)
    with pytest.raises(ValueError, match="row block"):
        sub_group_newton_schulz([torch.ones(3, 2), torch.ones(2, 3, 4)], subs)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s["name"] for s in ALONE])
def test_k1_is_the_single_device_kernel_bitwise(world2, name):
    spec = SPECS[name]
    ortho_ref, theta_ref = reference(spec)
    o = orientation(spec["shape"])
    for p in results(world2, name):  # each rank alone computed the whole matrix
        for step in range(STEPS):
            assert torch.equal(o.restore(p["ortho"][step]), ortho_ref[step]), (name, step)
        assert torch.equal(o.restore(p["theta"]), theta_ref)


@pytest.mark.slow
def test_bf16_close_to_single_device(world2):
    full = _param0({"shape": (80, 32)})
    ref = newton_schulz(full, MuonConfig().schedule, dtype=torch.bfloat16).float()
    for split in (False, True):
        got = torch.cat([p[split] for p in results(world2, "bf16")]).float()
        assert got.dtype == torch.float32 and rel_err(got, ref) < 3e-2, split


@pytest.mark.slow
def test_a_rank_outside_the_group_is_refused(world2):
    assert results(world2, "outsider")[1] in ("ValueError", "RuntimeError")


@pytest.mark.slow
def test_a_missing_peer_times_out_naming_the_matrix(world2):
    message, seconds = results(world2, "timeout")[0]
    assert "layers.0.w" in message and "Gram all-reduce (step 0)" in message, message
    assert seconds < 10


# -- single process ------------------------------------------------------------------------------


def test_without_a_process_group_it_is_the_single_device_kernel():
    x = torch.randn(30, 12)
    sched = MuonConfig().schedule
    assert torch.equal(shared_newton_schulz(x), newton_schulz(x, sched))
    assert torch.equal(shared_newton_schulz(x, coefficients="quintic", dtype=torch.float32),
                       newton_schulz(x, MuonConfig(ns_coefficients="quintic").schedule,
                                     dtype=torch.float32))


def test_argument_checks():
    with pytest.raises(ValueError, match="row block"):
        shared_newton_schulz(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="steps"):
        shared_newton_schulz(torch.ones(3, 2), steps=0)
    with pytest.raises(ValueError, match="eps"):
        shared_newton_schulz(torch.ones(3, 2), eps=0.0)
    with pytest.raises(ValueError, match="unknown schedule 'cubic'"):
        shared_newton_schulz(torch.ones(3, 2), coefficients="cubic", steps=3)


def test_orientation_by_shape():
    tall, wide, sq = orientation((96, 32)), orientation((32, 96)), orientation((48, 48))
    assert (tall.transpose, tall.oriented_shape, tall.row_dim) == (False, (96, 32), 0)
    assert (wide.transpose, wide.oriented_shape, wide.row_dim) == (True, (96, 32), 1)
    assert not sq.transpose
    x = torch.randn(32, 96)
    assert wide.orient(x).shape == (96, 32) and torch.equal(wide.restore(wide.orient(x)), x)
    with pytest.raises(ValueError, match="not a matrix"):
        orientation((3,))


def test_orientation_by_split_dim():
    # column-parallel (dim 0, tall: QKV, gate/up): no transpose
    assert orientation((10240, 5120), 0).transpose is False
    # row-parallel (dim 1, wide: down_proj 5120 × 25600, o_proj 5120 × 8192): transposed
    assert orientation((5120, 25600), 1).transpose is True
    assert orientation((5120, 8192), 1).oriented_shape == (8192, 5120)
    # square row-parallel (o_proj with heads·head_dim = hidden): transposed, its split dim → rows
    assert orientation((4096, 4096), 1).transpose is True
    assert orientation((4096, 4096), 0).transpose is False
    # a split along the short dimension is refused
    with pytest.raises(ValueError, match="short dimension"):
        orientation((1024, 4096), 0)
    with pytest.raises(ValueError, match="short dimension"):
        orientation((4096, 1024), 1)
    with pytest.raises(ValueError, match="split_dim"):
        orientation((4, 4), 2)


def test_tp_row_blocks():
    # fused gate/up [gate; up] of 2·ffn = 16 rows at tp 2, stride 2: rank r holds [gate_r; up_r]
    o, blocks = tp_row_blocks((16, 4), 0, 2, stride=2)
    assert not o.transpose and blocks == [[(0, 4), (8, 12)], [(4, 8), (12, 16)]]
    # row-parallel 4 × 12 at tp 3: transposed, shard r = columns 4r…4r+4 = oriented rows
    o, blocks = tp_row_blocks((4, 12), 1, 3)
    assert o.transpose and blocks == [[(0, 4)], [(4, 8)], [(8, 12)]]
    full = torch.arange(48.0).reshape(4, 12)
    for r, ((a, b),) in enumerate(blocks):
        shard = full[:, 4 * r:4 * r + 4]
        assert torch.equal(o.orient(shard), o.orient(full)[a:b])
    with pytest.raises(ValueError, match="sub-blocks"):
        tp_row_blocks((10, 4), 0, 3)
    with pytest.raises(ValueError, match="short dimension"):
        tp_row_blocks((4, 12), 0, 2)


def test_dp_row_block():
    assert dp_row_block((10, 4), 8, 28) == (2, 7)
    assert dp_row_block((10, 4), 0, 0) == (0, 0)
    assert dp_row_block((6, 6), 12, 36) == (2, 6)  # square: rows, no transpose
    with pytest.raises(ValueError, match="whole rows"):
        dp_row_block((10, 4), 6, 28)
    with pytest.raises(ValueError, match="whole rows"):
        dp_row_block((10, 4), 8, 44)
    with pytest.raises(ValueError, match="short dimension"):  # a wide matrix's flat range
        dp_row_block((4, 10), 0, 20)


def test_cost_formulas():
    from canzona.planner import formulas
    from canzona.planner.formulas import shared_ns_bytes, shared_ns_flops

    m, n = 4096, 1024
    assert shared_ns_flops(m, n, 1) == formulas.muon_flops(m, n)
    assert shared_ns_flops(m // 2, n, 2, steps=1) == 4 * n * n * m // 2 + 2 * n ** 3
    # the split: blocks [0, 256) + [768, 1024) on rank 0, [256, 768) on rank 1 — the upper
    # parts of P hold 256·1024 + 256·256 = 256·768 + 256·512 elements on either rank
    q = formulas.poly_packed_numel(n, 2)
    assert q == 256 * (n + 256) == 256 * (768 + 512)
    assert shared_ns_flops(m // 2, n, 2, steps=1, split_polynomial=True) == \
        4 * n * n * m // 2 + 2 * n * q
    assert shared_ns_bytes(n, 1) == 0
    # the Gram's 16 upper block rows of 64 rows: Σ 64·(1024 − 64·i) = 17/32 of n²
    g = formulas.gram_packed_numel(n)
    assert g == sum(64 * (n - 64 * i) for i in range(16)) == 17 * n * n // 32
    assert shared_ns_bytes(n, 2, steps=1) == g * 4
    assert shared_ns_bytes(n, 2, steps=1, split_polynomial=True, element_size=2) == \
        (g + q) * 2
    # a TP group of 4 and its DP partner (k = 8): reduce-scatter and all-gather over TP, 2·3/4·g,
    # and a quarter of g to the partner; the split's q8 to the partner, then 3·(2·q8) over TP
    q8 = formulas.poly_packed_numel(n, 8)
    assert shared_ns_bytes(n, 8, steps=1, tp_pair=True) == round((1.5 * g + g / 4) * 4)
    assert shared_ns_bytes(n, 8, steps=1, split_polynomial=True, tp_pair=True) == \
        round((1.5 * g + g / 4 + q8 + 6 * q8) * 4)
    with pytest.raises(ValueError, match="k = 2·tp"):
        shared_ns_bytes(n, 3, tp_pair=True)


@pytest.mark.parametrize("n", [1, 5, 17, 64, 100])
def test_gram_packing_round_trip(n):
    """The all-reduce carries the Gram's upper block rows; unpacked, a symmetric Gram is back
    bit for bit, and an asymmetric one keeps its diagonal blocks and mirrors the rest."""
    from canzona.planner.formulas import gram_blocks, gram_packed_numel
    from canzona.runtime.optim.gram_packing import pack_gram, unpack_gram

    x = torch.randn(3 * n, n, generator=torch.Generator().manual_seed(n))
    g = x.mT @ x
    sym = torch.triu(g) + torch.triu(g, 1).mT
    packed = torch.empty(gram_packed_numel(n))
    pack_gram(sym, packed)
    back = torch.full((n, n), float("nan"))
    unpack_gram(packed, back)
    assert torch.equal(back, sym)
    asym = torch.randn(n, n)
    pack_gram(asym, packed)
    unpack_gram(packed, back)
    for r0, r1 in gram_blocks(n):
        assert torch.equal(back[r0:r1, r0:], asym[r0:r1, r0:])
        assert torch.equal(back[r1:, r0:r1], asym[r0:r1, r1:].mT)


@pytest.mark.parametrize("n,k", [(1, 2), (5, 2), (17, 3), (64, 4), (100, 8)])
def test_split_polynomial_upper_parts_cover_p(n, k):
    """Each rank's packed upper parts of P (two block rows), gathered and unpacked, are
    bG + cG² (to float64 rounding of the same products), every element computed once."""
    from canzona.planner.formulas import poly_blocks, poly_packed_numel
    from canzona.runtime.optim.gram_packing import poly_views, unpack_poly

    x = torch.randn(2 * n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    g = x.mT @ x
    g = torch.triu(g) + torch.triu(g, 1).mT
    b, c = -4.7750, 2.0315
    size = poly_packed_numel(n, k)
    gathered = torch.zeros(k * size, dtype=torch.float64)
    rows = []
    for r in range(k):
        for r0, r1, v in poly_views(gathered[r * size:(r + 1) * size], n, k, r):
            torch.addmm(g[r0:r1, r0:], g[r0:r1], g[:, r0:], beta=b, alpha=c, out=v)
            rows += range(r0, r1)
    assert sorted(rows) == list(range(n))  # every block row on exactly one rank
    assert all(sum((r1 - r0) * (n - r0) for r0, r1 in mine) <= size for mine in poly_blocks(n, k))
    poly = torch.full((n, n), float("nan"), dtype=torch.float64)
    unpack_poly(gathered, poly, k)
    torch.testing.assert_close(poly, b * g + c * g @ g, rtol=1e-12, atol=1e-9)


def test_many_in_lockstep_is_each_alone_bitwise(world2):
    for res in results(world2, "many"):
        for key, same in res.items():
            assert all(same), (key, same)


def test_the_gram_is_all_reduced_chunk_by_chunk(world2):
    """Per step, each matrix's Gram goes out in ``formulas.gram_chunks`` pieces (n = 64: 4
    chunks of 4 block rows; n = 17: 3 chunks of 3), all of a matrix's before the next one's
    rows, then the polynomial's all-gather; the rows still equal the single-device kernel."""
    from canzona.planner.formulas import gram_chunks

    for rank, res in enumerate(results(world2, "chunks")):
        for kind in ("world", "peer"):
            # per matrix (a: 4 chunks, b: 3), at step 0 each chunk went out with its own rows
            # of G packed, the rows after it not yet computed: the j-th launch after the j-th
            # product
            first = [calls[:c] for calls, c in zip(res[kind + "/step0"], (4, 3))]
            assert [len(x) for x in first] == [4, 3], res[kind + "/step0"]
            assert all(mine and later for calls in first for mine, later, _ in calls), first
            assert [before for calls in first for _, _, before in calls] == list(range(1, 8))
            names, got = res[kind]
            want = []
            for step in range(2):
                for label, n in (("a", 64), ("b", 17)):
                    c = len(gram_chunks(n))
                    want += [f"the Gram all-reduce (step {step}, chunk {j + 1} of {c}) of {label}"
                             for j in range(c)]
                want.append(f"the polynomial all-gather (step {step}) of a")
            assert names == want, (kind, names)
            g = torch.Generator().manual_seed(3)
            fulls = [torch.randn(80, 64, generator=g), torch.randn(30, 17, generator=g)]
            for full, mine in zip(fulls, got):
                whole = newton_schulz(full, ((3.4445, -4.7750, 2.0315),) * 2, eps=1e-7,
                                      dtype=torch.float32)
                half = full.shape[0] // 2
                ref = whole[:half] if rank == 0 else whole[half:]
                torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    assert [len(gram_chunks(n)) for n in (64, 17)] == [4, 3]
