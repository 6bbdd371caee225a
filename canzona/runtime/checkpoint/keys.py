"""The logical keys of a checkpoint that survives a change of plan, and the entries one rank saves
or loads under them.

Every key names a parameter, never a rank, bucket or plan — by its global name
(:func:`~canzona.runtime.checkpoint.names.global_name`: global layer and expert indices, the same
under every pipeline and expert-parallel layout); every value is a canonical tensor
(:mod:`canzona.runtime.checkpoint.mapping`: what the single-device model holds, TP padding left
out), saved as the boxes each rank holds and read back as the boxes each rank needs under *its*
plan::

    model.<name>                   the weights (DP rank 0 of each TP rank saves its shard; an
                                   expert's first expert-DP rank; under FSDP2 every rank its
                                   block)
    optim.<name>.main              fp32 main copies (main_params="fp32"): each rank's own pieces
    optim.<name>.exp_avg|exp_avg_sq|step        AdamW: each rank's element ranges (+ its step)
    optim.<name>.momentum_buffer   Muon: each matrix task's rows, saved by its owner (a fused
                                   matrix and its split parts are rows of the same tensor, so
                                   Muon's momentum follows a change between them); under FSDP2
                                   every rank its block
    optim.<name>[#<part>].<key>    Shampoo/SOAP: per matrix task, its owner's whole state, rows
                                   (and left statistics' columns) in canonical order; Shampoo's
                                   blocks preconditioned shard by shard (tp > 1): each TP rank's
                                   blocks under the matrix's block indices
    optim.<name>[#<part>].rows     only where a state could not be put in canonical order
                                   (Shampoo with several row blocks): the order it is in
    optim.param_groups             the hyper-parameters (JSON)
    model_buffers.<name>           the model's non-parameter state (rotary tables, …)
    extra.<key>                    the caller's Stateful objects (scheduler, step, data position)

:func:`entries` builds one rank's DCP state dict under these keys (saving: the data; loading:
views to fill, and what must run once DCP has filled them). Under an FSDP2 plan the weights and
every state kept in the parameters' layout (AdamW's; Muon's momentum, ``local_state``) are each
rank's block of them (``formulas.fsdp2_block``: its ``Shard(0)`` rows, with TP the one rectangle
of TP's chunk it holds) as a box of the logical tensor, which DCP reshards to any other layout
(a block TP replicates is written by TP rank 0 and read by every copy); an owner's whole-matrix
state (Shampoo, SOAP, NorMuon) is written by its owner as ZeRO-1's owners write a whole
matrix's (a matrix an adjacent pair shares: each member its block's box of it): the keys are
the same, so a checkpoint of either storage loads into the other, at any dp and tp.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from canzona.planner.formulas import fsdp2_block
from canzona.planner.plan import FSDP2Plan
from canzona.runtime.checkpoint.mapping import RankLayout, logical_key_shape
from canzona.runtime.checkpoint.names import FORMAT, Placement, global_name
from canzona.runtime.checkpoint.pieces import Pieces
from canzona.runtime.errors import CheckpointError
from canzona.runtime.introspect import _is_dtensor, local_tensor

__all__ = ["FORMAT", "Entries", "entries"]

#: The runtime executes one pipeline stage, and names every expert by its global index already
#: (``runtime.experts``): every offset 0, the optimizer's names are the global ones.
PLACEMENT = Placement()


def _runs(rows: Tensor) -> list[tuple[int, int, int]]:
    """(task row, canonical row, length) of maximal runs of consecutive canonical rows."""
    if rows.numel() == 0:
        return []
    breaks = torch.nonzero(rows[1:] - rows[:-1] != 1).flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), rows.numel()]
    first = rows[starts].tolist()
    return [(a, c, b - a) for a, b, c in zip(starts, ends, first)]


def _permuted(x: Tensor, order: Tensor, role: str, inverse: bool = False) -> Tensor:
    """``x`` with its task rows put in ``order`` (task row order[k] becomes row k), or back."""
    if role == "fixed":
        return x
    idx = torch.argsort(order) if inverse else order
    y = x.index_select(0, idx.to(x.device))
    return y.index_select(1, idx.to(x.device)) if role == "both" else y


def _task_key(t: Any) -> str:
    return global_name(t.name, PLACEMENT)  # "param" or "param#part", its global name


def _key(name: str) -> str:
    return global_name(name, PLACEMENT)


class Entries:
    """The DCP state dict of this rank (save: the data; load: views to fill) and, for loading,
    what must happen after DCP has filled them."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {}
        self.after: list[Any] = []  # callables run after a load
        self.needs: dict[str, tuple[int, ...]] = {}  # key → logical shape (load checks)

    def add_pieces(self, key: str, shape: tuple[int, ...], boxes: list) -> None:
        if not boxes:
            return
        if key in self.sd:
            self.sd[key].boxes.extend((torch.Size(o), t) for o, t in boxes)
        else:
            self.sd[key] = Pieces(shape, boxes)
        self.needs[key] = tuple(shape)

    def add_tensor(self, key: str, t: Tensor) -> None:
        self.sd[key] = t
        self.needs[key] = tuple(t.shape)


def entries(opt: Any, model: nn.Module | None, *, saving: bool, saved: Any = None,
             group_rank: int = 0) -> Entries:
    """This rank's entries. ``saved``: the checkpoint's DCP metadata (loading);
    ``group_rank``: this rank in the saving group."""
    if isinstance(opt.plan, FSDP2Plan):
        return fsdp2_entries(opt, model, saving=saving, saved=saved, group_rank=group_rank)
    L = RankLayout(opt)
    E = Entries()
    opt.wait_params()
    weights = model is not None
    # -- weights: DP rank 0 (an expert's first expert-DP rank) writes its TP shard; every rank
    # reads its own
    if weights:
        for i, (view, local) in enumerate(zip(L.views, opt._params)):
            if saving and (not L.first_holder(i) or not L.writes(i)):
                continue
            flat = local.detach().view(-1)
            if not saving:
                covered = sum(n for _, n, _ in view.axis.blocks)
                if view.axis.dim is not None and covered < view.local[view.axis.dim]:
                    flat.zero_()  # the vocabulary's TP padding: not in the checkpoint
            E.add_pieces(f"model.{_key(view.name)}", view.logical,
                         view.pieces(flat, 0, flat.numel()))
        _add_buffers(E, model, opt._live, saving=saving, group_rank=group_rank)
    # -- fp32 main copies: each rank's own pieces -------------------------------------------------
    for i, view in enumerate(L.views):
        b, a, z = L.own(i)
        main = opt._storage.buffers[b].main
        if main is None or a >= z or (saving and not L.writes(i)):
            continue
        s = opt._schedule
        lo = s.param_range[i][0]
        c0 = s.own_range(b)[0]
        piece = main[lo + a - c0:lo + z - c0]
        E.add_pieces(f"optim.{_key(view.name)}.main", view.logical, view.pieces(piece, a, z))
    # -- AdamW: element ranges --------------------------------------------------------------------
    for slices in opt._schedule.mine.adamw:
        for sl in slices:
            if saving and not L.writes(sl.param):
                continue
            view = L.views[sl.param]
            st = opt.state[opt._params[sl.param]]
            a, z = sl.offset, sl.offset + sl.hi - sl.lo
            for key in ("exp_avg", "exp_avg_sq"):
                E.add_pieces(f"optim.{_key(view.name)}.{key}", view.logical,
                             view.pieces(st[key], a, z))
            E.add_tensor(f"optim.{_key(view.name)}.step", st["step"])
    # -- matrix tasks -----------------------------------------------------------------------------
    kernel = opt._matrix
    for t, st, writes in L.matrix_tasks():
        if saving and not writes:
            continue
        view = L.views[t.param]
        rows = L.task_rows(t)
        if kernel.row_state_only:
            for key, x in st.items():
                if x.dim() == 2 and x.shape[1] != view.logical[1]:  # per row (NorMuon's moments)
                    logical = (view.logical[0], x.shape[1])
                    boxes = [((c, 0), x[i:i + n]) for i, c, n in _runs(rows)]
                    E.add_pieces(f"optim.{_key(view.name)}.{key}", logical, boxes)
                    continue
                boxes = [((c, 0) if len(view.logical) == 2 else (c,),
                          x[i:i + n] if len(view.logical) == 2 else x[i:i + n].view(-1))
                         for i, c, n in _runs(rows)]
                E.add_pieces(f"optim.{_key(view.name)}.{key}", view.logical, boxes)
            continue
        if not hasattr(t, "segments") and t.part is None and len(view.logical) == 2 \
                and t.shape[0] < view.logical[0]:
            # Shampoo's blocks hosted apart (plan.dp_shared, tp = 1): this rank's block rows
            _add_block_rows(E, t, st, view.logical, kernel, saving=saving)
            continue
        _add_task_state(E, t, st, rows, kernel, saving=saving, saved=saved)
    # -- matrices the TP group shares: each TP rank holds Muon's momentum of its own shard,
    #    element for element beside the weights, so it maps as the weights do -------------------
    for x in opt._micro.shared:
        view = L.views[x.param]
        if x.blocks:  # Shampoo: this rank's shard's blocks are blocks of the matrix
            _add_shard_blocks(E, x, opt.state[opt._params[x.param]], L, opt, saving=saving)
            continue
        at = x.row0 * x.local_shape[1]  # its rows of the shard, where a partner holds the rest
        st = opt.state[opt._params[x.param]]
        for key, val in st.items():
            if val.dim() == 2 and val.shape[1] != x.local_shape[1]:  # per row (NorMuon's)
                _add_shard_rows(E, f"optim.{_key(view.name)}.{key}", val, x, view, at, L,
                                saving=saving)
                continue
            flat = val.view(-1)
            E.add_pieces(f"optim.{_key(view.name)}.{key}", view.logical,
                         view.pieces(flat, at, at + flat.numel()))
    _add_groups(E, opt, saving=saving)
    return E


def fsdp2_entries(opt: Any, model: nn.Module | None, *, saving: bool, saved: Any = None,
                  group_rank: int = 0) -> Entries:
    """This rank's entries under an FSDP2 plan (see the module docstring): the weights and the
    states in the parameters' layout as this rank's block of them (:func:`_add_block`), each
    owned matrix's whole state by its owner, each block's of a matrix a pair shares by its
    member (:func:`_add_block_state`)."""
    E = Entries()
    storage = opt._storage
    storage.reshard()  # the model holds its sharded parameters, the DTensors below
    if model is not None:
        for name, p in zip(opt._names, opt._live):
            _add_block(E, f"model.{_key(name)}", p, name, opt, saving=saving)
        _add_buffers(E, model, opt._live, saving=saving, group_rank=group_rank)
    kernel = opt._matrix
    in_rows = list(opt._adamw_ids) + (list(opt._matrix_ids) if kernel.local_state else [])
    for i in in_rows:
        base = f"optim.{_key(opt._names[i])}"
        for key, x in opt.state[opt._params[i]].items():
            if _is_dtensor(x):
                _add_block(E, f"{base}.{key}", x, opt._names[i], opt, saving=saving)
            else:  # the step counter, the same on every rank
                E.add_tensor(f"{base}.{key}", x)
    if not kernel.local_state:
        for rnd in storage.rounds:
            for t in rnd.owned:
                _add_task_state(E, t, opt.state[opt._params[t.param]], torch.arange(t.shape[0]),
                                kernel, saving=saving, saved=saved)
            for b in rnd.mine:
                if b.task.shared:
                    _add_block_state(E, b, opt.state[opt._params[b.task.param]], kernel)
    _add_groups(E, opt, saving=saving)
    return E


def _add_block_state(E: Entries, b: Any, st: dict[str, Tensor], kernel: Any) -> None:
    """A member's state of its block of a matrix a pair shares under an FSDP2 plan (NorMuon's),
    under the whole matrix's keys: each tensor as the box it is of the whole matrix's state
    (rows [r0, r1) of a tall matrix's, columns [c0, c1) of a wide one's; per-row statistics of
    a tall block at its rows), and one of the whole state's shape as itself (a wide block's
    row statistics, the same on both members)."""
    base = f"optim.{_task_key(b.task)}"
    whole = kernel.init_state(b.task.shape, torch.float32, torch.device("meta"))
    for key, x in st.items():
        shape = tuple(whole[key].shape)
        if tuple(x.shape) == shape:
            E.add_tensor(f"{base}.{key}", x)
            continue
        cols = b.c0 if len(shape) > 1 and shape[1] == b.task.shape[1] else 0
        E.add_pieces(f"{base}.{key}", shape, [((b.r0, cols), x)])


def _add_block(E: Entries, key: str, x: Any, name: str, opt: Any, *, saving: bool) -> None:
    """A DTensor in parameter ``name``'s FSDP2 layout (the parameter, or a state of its shape)
    under its logical key: this rank's block of it (``formulas.fsdp2_block`` of the parameter's
    TP split dim; rows of the 2-D view beyond two dims) as a box of the logical tensor, none
    where the block is empty. A block TP replicates is written by TP rank 0 alone and read by
    every copy. The box is computed here rather than read off the DTensor, whose offsets under
    ``_StridedShard`` (TP, then ``fully_shard``) do not always say where its rows lie."""
    shape = tuple(x.shape)
    logical = logical_key_shape(shape)
    E.needs[key] = logical
    split = opt._splits.get(name)
    if split == 1 and len(shape) != 2:
        raise CheckpointError(f"'{name}' ({list(shape)}) is split by TP along dim 1 of more "
                              "or fewer than two dims, which is no box of its logical tensor.")
    d, t = divmod(opt._rank, opt._tp)
    r0, r1, c0, c1 = fsdp2_block(shape, split, opt._dp, opt._tp, d, t)
    local = local_tensor(x).detach()
    if local.numel() != (r1 - r0) * (c1 - c0):
        raise CheckpointError(f"'{name}' holds {list(local.shape)} on mesh rank {opt._rank}, "
                              f"not its block [{r0}:{r1}, {c0}:{c1}] of {list(shape)}; the "
                              "model is not laid out as the plan says.")
    if r0 == r1 or c0 == c1 or (saving and split is None and t):
        return
    if len(logical) == 1:
        E.add_pieces(key, logical, [((r0,), local.view(-1))])
        return
    per = math.prod(shape[1:-1])  # rows of the 2-D view per row of dim 0
    cols = c1 - c0 if split == 1 else logical[1]
    E.add_pieces(key, logical, [((r0 * per, c0), local.view(-1, cols))])


def _add_buffers(E: Entries, model: nn.Module, params: list[Tensor], *, saving: bool,
                 group_rank: int) -> None:
    """The model's non-parameter tensors (replicated: the saving group's rank 0 writes them)."""
    ids = {id(p) for p in params}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in ids or not isinstance(value, Tensor):
            continue
        if saving and group_rank != 0:
            continue
        E.add_tensor(f"model_buffers.{key}", local_tensor(value))


def _add_groups(E: Entries, opt: Any, *, saving: bool) -> None:
    """The param groups' hyper-parameters as JSON (loaded into the live groups after DCP)."""
    if saving:
        groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"}
                  for g in opt.param_groups]
        E.sd["optim.param_groups"] = json.dumps(groups, sort_keys=True)
    else:
        E.sd["optim.param_groups"] = ""
        E.after.append(lambda: _load_groups(opt, E.sd["optim.param_groups"]))


def _add_shard_rows(E: Entries, key: str, val: Tensor, x: Any, view: Any, at: int,
                    L: RankLayout, *, saving: bool) -> None:
    """A per-row state (NorMuon's second moments, ``val`` rows × 1) of a matrix the TP group
    shares: a column-parallel shard's rows lie where the shard's weights do (read off the
    weights' pieces of the same range); a row-parallel shard holds every row's, the same on
    every TP rank, so TP rank 0 writes them and every rank reads them."""
    rows = view.logical[0]
    if x.dim != 0:
        if not saving or L.tp_rank == 0:
            E.add_pieces(key, (rows, val.shape[1]), [((0, 0), val)])
        return
    cols = x.local_shape[1]
    probe = torch.empty(val.shape[0] * cols, device="meta")
    boxes, k = [], 0
    for origin, piece in view.pieces(probe, at, at + probe.numel()):
        n = piece.shape[0]
        boxes.append(((origin[0], 0), val[k:k + n]))
        k += n
    E.add_pieces(key, (rows, val.shape[1]), boxes)


def _add_shard_blocks(E: Entries, x: Any, st: dict[str, Tensor], L: RankLayout, opt: Any, *,
                      saving: bool) -> None:
    """The Shampoo state of one TP rank's shard of a matrix its TP group preconditions shard by
    shard, as the rank hosting the whole matrix would hold it (``_add_task_state``: the
    planner's row order of the matrix, with that order's canonical rows under ``.rows`` where
    it is not the canonical one): the shard's block (i, j) is the matrix's block whose rows
    (columns, for a split along columns) the shard's segment there holds; its element-shaped
    tensors (moments, momentum) are boxes of the matrix's; ``step`` is the same on every
    shard."""
    plan = opt.plan
    block = opt._matrix.config.max_preconditioner_dim
    lay = next(plan.tp.layouts[s.layout] for ix in plan.tp.indices for s in ix.shared
               if s.id == x.id)
    segs = [s for s in lay.segments if s[0] == opt._tp_rank]

    def whole(i: int) -> int:  # the shard's block index along the split dim → the matrix's
        at = i * block
        for _, local, full, n in segs:
            if local <= at < local + n and not (at - local) % block and not full % block:
                return (full + at - local) // block
        raise CheckpointError(f"'{x.name}': block {i} of TP rank {opt._tp_rank}'s shard is not "
                              f"a block of the matrix (blocks of {block}); the plan is "
                              f"inconsistent.")

    base = f"optim.{_task_key(x)}"
    whole_task = SimpleNamespace(name=x.name, param=x.param, dim=x.dim, full_shape=x.full_shape,
                                 segments=tuple(sorted(lay.segments, key=lambda s: s[2])))
    rows = L.task_rows(whole_task)
    if not torch.equal(rows, torch.arange(len(rows))):
        if saving:
            E.sd[f"{base}.rows"] = rows
        else:  # the saved state must be in this order (checked before the collective)
            E.needs[f"{base}.rows"] = tuple(rows.shape)
            E.sd[f"{base}.rows"] = torch.empty_like(rows)
            E.after.append(_RowsCheck(x.name, E.sd, f"{base}.rows", rows, opt._matrix.name))
    for key, val in st.items():
        parts = key.split(".")
        if key == "step":
            E.add_tensor(f"{base}.step", val)
        elif len(parts) == 3:  # L.i.j, R.i.j, L_root.i.j, R_root.i.j
            i, j = int(parts[1]), int(parts[2])
            i, j = (whole(i), j) if x.dim == 0 else (i, whole(j))
            E.add_tensor(f"{base}.{parts[0]}.{i}.{j}", val)
        else:  # the shard's segments, where they lie in the matrix
            E.add_pieces(f"{base}.{key}", tuple(x.full_shape),
                         [((full, 0), val[local:local + n]) if x.dim == 0
                          else ((0, full), val[:, local:local + n]) for _, local, full, n in segs])


def _add_block_rows(E: Entries, t: Any, st: dict[str, Tensor], logical: tuple[int, ...],
                    kernel: Any, *, saving: bool) -> None:
    """The state of a run of whole block rows of a Shampoo matrix (rows [row0, row0 + rows)),
    under the keys the whole matrix's state has: block (i, j) of the run is block
    (i + row0 / block, j) of the matrix, its row-shaped tensors (moments, momentum) are boxes
    of the whole ones, and ``step`` (the same on every piece) is written by the first."""
    block = kernel.config.max_preconditioner_dim
    if t.row0 % block:
        raise CheckpointError(f"'{t.name}': rows from {t.row0} are not whole block rows of "
                              f"{block}; the plan is inconsistent.")
    base, b0 = f"optim.{_task_key(t)}", t.row0 // block
    for key, x in st.items():
        parts = key.split(".")
        if key == "step":
            if saving and t.row0:
                continue
            E.add_tensor(f"{base}.step", x)
        elif len(parts) == 3:  # L.i.j, R.i.j, L_root.i.j, R_root.i.j
            E.add_tensor(f"{base}.{parts[0]}.{int(parts[1]) + b0}.{parts[2]}", x)
        else:  # rows × cols, beside the weights' rows
            E.add_pieces(f"{base}.{key}", logical, [((t.row0, 0), x)])


def _add_task_state(E: Entries, t: Any, st: dict[str, Tensor], rows: Tensor, kernel: Any, *,
                    saving: bool, saved: Any) -> None:
    """A Shampoo/SOAP task's state: in canonical row order where the kernel's state can follow
    a row permutation, else as it is with its row order recorded."""
    base = f"optim.{_task_key(t)}"
    order = torch.argsort(rows)
    identity = bool(torch.equal(order, torch.arange(len(rows))))
    roles = kernel.state_roles(tuple(t.full_shape if hasattr(t, "full_shape") else t.shape))
    as_is = identity or roles is None
    if saving:
        for key, x in st.items():
            E.sd[f"{base}.{key}"] = x if as_is else _permuted(x, order, roles[key]).contiguous()
        if not identity and roles is None:
            E.sd[f"{base}.rows"] = rows.clone()
        return
    has_rows = saved is not None and f"{base}.rows" in saved.state_dict_metadata
    if as_is and not has_rows and (identity or roles is not None):
        for key, x in st.items():
            E.add_tensor(f"{base}.{key}", x)
        return
    if has_rows or roles is None:
        # The saved order must be this task's (it is checked before the collective).
        E.needs[f"{base}.rows"] = tuple(rows.shape)
        E.sd[f"{base}.rows"] = torch.empty_like(rows)
        E.after.append(_RowsCheck(t.name, E.sd, f"{base}.rows", rows, kernel.name))
        for key, x in st.items():
            E.add_tensor(f"{base}.{key}", x)
        return
    temps = {key: torch.empty_like(x) for key, x in st.items()}
    for key, x in temps.items():
        E.add_tensor(f"{base}.{key}", x)

    def restore() -> None:
        for key, x in st.items():
            x.copy_(_permuted(temps[key], order, roles[key], inverse=True))

    E.after.insert(0, restore)


class _RowsCheck:
    """After a load: the state's recorded row order is this task's (else nothing may run)."""

    def __init__(self, name: str, sd: dict, key: str, rows: Tensor, kernel: str) -> None:
        self.name, self.sd, self.key, self.rows, self.kernel = name, sd, key, rows, kernel

    def __call__(self) -> None:
        if not torch.equal(self.sd[self.key], self.rows):
            raise CheckpointError(
                f"{self.kernel} state of '{self.name}' was saved with its rows in another order "
                "(another TP layout) and has several row blocks, which a permutation would mix: "
                "resume with the TP size it was saved under, or a max_preconditioner_dim of at "
                "least its rows.")


def _jsonable(v: Any) -> Any:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Tensor) and v.numel() == 1:
        return v.item()
    return str(v)


def _load_groups(opt: Any, text: str) -> None:
    groups = json.loads(text)
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"the checkpoint has {len(groups)} parameter groups, the optimizer "
                              f"{len(opt.param_groups)}.")
    for g, saved in zip(opt.param_groups, groups):
        for k, v in saved.items():
            if k == "params" or k not in g:
                continue
            live = g[k]
            if isinstance(live, bool) or not isinstance(live, (int, float, tuple, list)):
                continue  # strings and objects are the optimizer's construction, not its state
            g[k] = tuple(v) if isinstance(live, tuple) else type(live)(v) if isinstance(
                live, (int, float)) else v
