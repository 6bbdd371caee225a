"""Checkpoints that survive a change of plan: ``save_checkpoint`` / ``load_checkpoint`` on
``torch.distributed.checkpoint`` (DCP) with logical keys.

Every key names a parameter, never a rank, bucket or plan; every value is a canonical tensor
(``canzona.runtime.logical``: what the single-device model holds, TP padding left out), saved as
the boxes each rank holds and read back as the boxes each rank needs under *its* plan::

    model.<name>                   the weights (DP rank 0 of each TP rank saves its shard)
    optim.<name>.main              fp32 main copies (main_params="fp32"): each rank's own pieces
    optim.<name>.exp_avg|exp_avg_sq|step        AdamW: each rank's element ranges (+ its step)
    optim.<name>.momentum_buffer   Muon: each matrix task's rows, saved by its owner (a fused
                                   matrix and its split parts are rows of the same tensor, so
                                   Muon's momentum follows a change between them)
    optim.<name>[#<part>].<key>    Shampoo/SOAP: per matrix task, its owner's whole state, rows
                                   (and left statistics' columns) in canonical order; Shampoo's
                                   blocks preconditioned shard by shard (tp > 1): each TP rank's
                                   blocks under the matrix's block indices
    optim.<name>[#<part>].rows     only where a state could not be put in canonical order
                                   (Shampoo with several row blocks): the order it is in
    optim.param_groups             the hyper-parameters (JSON)
    model_buffers.<name>           the model's non-parameter state (rotary tables, …)
    extra.<key>                    the caller's Stateful objects (scheduler, step, data position)

A save writes into ``.<name>.partial`` beside the target, then publishes it with renames: an
interrupted save leaves the previous complete checkpoint loadable (``load_checkpoint`` also finds
it as ``.<name>.previous`` if the process died between the two renames of a replacement).
``canzona.json`` records the kernel, the plan and the sizes it was saved under.

Loading checks everything it can before the one collective (every rank agrees, then DCP's
load): the kernel, every key this rank needs and its shape; a Shampoo/SOAP state across a change
between split and fused Q/K/V or gate/up is refused with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from canzona.runtime.checks import plan_params
from canzona.runtime.errors import CheckpointError
from canzona.runtime.introspect import local_tensor, named_params
from canzona.runtime.logical import (
    Axis,
    LoadPlanner,
    ParamView,
    Pieces,
    SavePlanner,
    axis_of,
    logical_key_shape,
    view_2d,
)

__all__ = ["FORMAT", "DCPState", "dcp_state", "load_checkpoint", "save_checkpoint"]

#: Version of the key layout; ``canzona.json`` records it.
FORMAT = 1
_META = "canzona.json"


# -- where this rank's pieces sit ---------------------------------------------------------------


class _Layout:
    """Per parameter, this rank's view of it in the canonical tensor (and, for TP-gathered
    tasks, every TP rank's), and what this rank writes."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.tp, self.tp_rank, self.dp_rank = opt._tp, opt._tp_rank, opt._rank
        self.logical = {n: s for n, s, _ in plan_params(opt.plan)}
        self.views: list[ParamView] = []
        for name, live, local in zip(opt._names, opt._live, opt._params):
            shape = self.logical.get(name, tuple(live.shape))
            axis = axis_of(live, shape, self.tp, self.tp_rank)
            self.views.append(ParamView(name, logical_key_shape(shape), view_2d(local.shape), axis))

    def axis(self, i: int, rank: int) -> Axis:
        name = self.opt._names[i]
        return axis_of(self.opt._live[i], self.logical.get(name, tuple(self.opt._live[i].shape)),
                       self.tp, rank)

    def writes(self, i: int) -> bool:
        """This TP rank writes parameter i's pieces (TP rank 0 for what TP replicates)."""
        return self.views[i].axis.dim is not None or self.tp_rank == 0

    def own(self, i: int) -> tuple[int, int, int]:
        """(bucket, a, z): parameter i's elements [a, z) of its local shard in this rank's own
        slice (a == z: none)."""
        s = self.opt._schedule
        b = s.param_bucket[i]
        lo, hi = s.param_range[i]
        c0, c1 = s.own_range(b)
        a, z = max(lo, c0), min(hi, c1)
        return b, a - lo, max(a, z) - lo

    def task_rows(self, t: Any) -> Tensor:
        """Canonical rows (of the parameter's 2-D view) of a matrix task's rows."""
        if hasattr(t, "segments"):  # a TP-gathered task: rows from every TP rank's shard
            rows = []
            if t.dim != 0:  # a row-parallel matrix: the rows are not split
                off = t.segments[0][1] if t.dim is None else 0
                return torch.arange(off, off + t.full_shape[0])
            for r, ls, _, n in t.segments:
                ax = self.axis(t.param, r)
                if ax.dim is None:
                    rows.append(torch.arange(ls, ls + n))
                    continue
                covered = 0
                for bs, bn, cs in ax.blocks:  # the segment's rows, block by block
                    x0, x1 = max(ls, bs), min(ls + n, bs + bn)
                    if x0 < x1:
                        rows.append(torch.arange(cs + x0 - bs, cs + x1 - bs))
                        covered += x1 - x0
                if covered != n:
                    raise CheckpointError(f"'{t.name}': rows of TP rank {r}'s shard are padding "
                                          "in the plan's layout; the plan is inconsistent.")
            return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        ax = self.views[t.param].axis
        if ax.dim is not None:
            raise CheckpointError(f"'{t.name}' is a TP shard updated without its TP group; the "
                                  "plan is inconsistent.")
        return torch.arange(t.row0, t.row0 + t.shape[0])

    def matrix_tasks(self) -> list[tuple[Any, dict[str, Tensor], bool]]:
        """(task, its state, this rank writes it) of every task whose state this rank holds."""
        from canzona.runtime.update import task_state

        opt = self.opt
        out = []
        for ts in opt._schedule.mine.matrix:
            for t in ts:
                out.append((t, task_state(t, opt._params, opt.state), self.tp_rank == 0))
        for t in opt._micro.hosted:
            st = opt.state[opt._params[t.param]]
            out.append((t, st if t.part is None else st[t.part], True))
        return out


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
    return t.name  # "param" or "param#part"


# -- the entries of one save or load ------------------------------------------------------------


class _Entries:
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


def _entries(opt: Any, model: nn.Module | None, *, saving: bool, saved: Any = None,
             group_rank: int = 0) -> _Entries:
    """This rank's entries. ``saved``: the checkpoint's DCP metadata (loading);
    ``group_rank``: this rank in the saving group."""
    L = _Layout(opt)
    E = _Entries()
    opt.wait_params()
    weights = model is not None
    # -- weights: DP rank 0 writes its TP shard; every rank reads its own -----------------------
    if weights:
        for i, (view, local) in enumerate(zip(L.views, opt._params)):
            if saving and (L.dp_rank != 0 or not L.writes(i)):
                continue
            flat = local.detach().view(-1)
            if not saving:
                covered = sum(n for _, n, _ in view.axis.blocks)
                if view.axis.dim is not None and covered < view.local[view.axis.dim]:
                    flat.zero_()  # the vocabulary's TP padding: not in the checkpoint
            E.add_pieces(f"model.{view.name}", view.logical, view.pieces(flat, 0, flat.numel()))
        params = {id(p) for p in opt._live}
        for key, value in model.state_dict(keep_vars=True).items():
            if id(value) in params or not isinstance(value, Tensor):
                continue
            if saving and group_rank != 0:
                continue  # replicated: the saving group's rank 0 writes it
            E.add_tensor(f"model_buffers.{key}", local_tensor(value))
    # -- fp32 main copies: each rank's own pieces -------------------------------------------------
    for i, view in enumerate(L.views):
        b, a, z = L.own(i)
        main = opt._buffers[b].main
        if main is None or a >= z or (saving and not L.writes(i)):
            continue
        s = opt._schedule
        lo = s.param_range[i][0]
        c0 = s.own_range(b)[0]
        piece = main[lo + a - c0:lo + z - c0]
        E.add_pieces(f"optim.{view.name}.main", view.logical, view.pieces(piece, a, z))
    # -- AdamW: element ranges --------------------------------------------------------------------
    for slices in opt._schedule.mine.adamw:
        for sl in slices:
            if saving and not L.writes(sl.param):
                continue
            view = L.views[sl.param]
            st = opt.state[opt._params[sl.param]]
            a, z = sl.offset, sl.offset + sl.hi - sl.lo
            for key in ("exp_avg", "exp_avg_sq"):
                E.add_pieces(f"optim.{view.name}.{key}", view.logical,
                             view.pieces(st[key], a, z))
            E.add_tensor(f"optim.{view.name}.step", st["step"])
    # -- matrix tasks -----------------------------------------------------------------------------
    kernel = opt._matrix
    for t, st, writes in L.matrix_tasks():
        if saving and not writes:
            continue
        view = L.views[t.param]
        rows = L.task_rows(t)
        if kernel.row_state_only:
            for key, x in st.items():
                boxes = [((c, 0) if len(view.logical) == 2 else (c,),
                          x[i:i + n] if len(view.logical) == 2 else x[i:i + n].view(-1))
                         for i, c, n in _runs(rows)]
                E.add_pieces(f"optim.{view.name}.{key}", view.logical, boxes)
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
        for key, val in opt.state[opt._params[x.param]].items():
            flat = val.view(-1)
            E.add_pieces(f"optim.{view.name}.{key}", view.logical,
                         view.pieces(flat, at, at + flat.numel()))
    # -- hyper-parameters -------------------------------------------------------------------------
    if saving:
        groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"}
                  for g in opt.param_groups]
        E.sd["optim.param_groups"] = json.dumps(groups, sort_keys=True)
    else:
        E.sd["optim.param_groups"] = ""
        E.after.append(lambda: _load_groups(opt, E.sd["optim.param_groups"]))
    return E


def _add_shard_blocks(E: _Entries, x: Any, st: dict[str, Tensor], L: _Layout, opt: Any, *,
                      saving: bool) -> None:
    """The Shampoo state of one TP rank's shard of a matrix its TP group preconditions shard by
    shard, as the rank hosting the whole matrix would hold it (``_add_task_state``: the
    planner's row order of the matrix, with that order's canonical rows under ``.rows`` where
    it is not the canonical one): the shard's block (i, j) is the matrix's block whose rows
    (columns, for a split along columns) the shard's segment there holds; its element-shaped
    tensors (moments, momentum) are boxes of the matrix's; ``step`` is the same on every
    shard."""
    from types import SimpleNamespace

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


def _add_block_rows(E: _Entries, t: Any, st: dict[str, Tensor], logical: tuple[int, ...],
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


def _add_task_state(E: _Entries, t: Any, st: dict[str, Tensor], rows: Tensor, kernel: Any, *,
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


# -- files --------------------------------------------------------------------------------------


def _paths(path: str | os.PathLike) -> tuple[Path, Path, Path]:
    p = Path(path)
    return p, p.parent / f".{p.name}.partial", p.parent / f".{p.name}.previous"


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what we ask."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group: Any) -> None:
    if _distributed():
        dist.barrier(group=group)


def _rank(group: Any) -> int:
    return dist.get_rank(group) if _distributed() else 0


def save_checkpoint(path: str | os.PathLike, model: nn.Module | None, optimizer: Any, *,
                    extra: Mapping[str, Any] | None = None, process_group: Any = None) -> Path:
    """Save the model's weights, the optimizer's state and ``extra`` under logical keys.

    Every rank of ``process_group`` (default: the world, every DP and TP rank) calls it with the
    same ``path`` on a file system they share. The checkpoint loads under any other plan of the
    same model (another dp, tp, solver or reorder) with :func:`load_checkpoint`.

    Args:
        path: the checkpoint's directory; an existing checkpoint there is replaced only once the
            new one is complete.
        model: the model whose parameters the optimizer updates (None: optimizer state only).
        optimizer: a ``CanzonaOptimizer``.
        extra: ``{name: object}``: objects with ``state_dict()``/``load_state_dict()`` (an LR
            scheduler, a data loader's position) or plain values, saved once.
        process_group: the group that saves (all ranks holding the model).

    Returns:
        The published directory.
    """
    final, partial, previous = _paths(path)
    rank = _rank(process_group)
    state = dcp_state(model, optimizer, extra=extra, process_group=process_group)
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)  # what an interrupted save left behind
        partial.parent.mkdir(parents=True, exist_ok=True)
    _barrier(process_group)
    with _quiet():
        dcp.save(state.state_dict, storage_writer=dcp.FileSystemWriter(partial),
                 planner=state.planner, process_group=process_group,
                 no_dist=not _distributed())
    if rank == 0:
        _write_meta(partial, state.meta)
        _publish(final, partial, previous)
    _barrier(process_group)
    return final


def _write_meta(partial: Path, meta: dict[str, Any]) -> None:
    """``canzona.json``, the mark of a complete checkpoint: written last, atomically."""
    tmp = partial / f"{_META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, partial / _META)
    _fsync_dir(partial)


def _publish(final: Path, partial: Path, previous: Path) -> None:
    """``partial`` becomes ``final``; an existing ``final`` is kept as ``previous`` until then."""
    if previous.exists():
        if final.exists():
            shutil.rmtree(previous)
        else:  # the last replacement died between its renames: previous is the good one
            os.replace(previous, final)
    if final.exists():
        os.replace(final, previous)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    if previous.exists():
        shutil.rmtree(previous)


def _metadata(opt: Any, extra: list[str], weights: bool) -> dict[str, Any]:
    inputs = opt.plan.inputs
    return {
        "format": FORMAT,
        "kernel": opt._matrix.name,
        "optimizer": inputs.optimizer.model_dump(mode="json"),
        "model": inputs.model,
        "dp": inputs.dp,
        "tp": inputs.tp,
        "plan_sha256": opt._digest.hex(),
        "main_params": opt._main_params,
        "weights": weights,
        "extra": extra,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _check_model(model: nn.Module | None, opt: Any) -> None:
    if model is None:
        return
    names = [n for n, _ in named_params(model)]
    if names != list(opt._names):
        raise CheckpointError("the model is not the one the optimizer was built for (its "
                              "parameters differ): pass the same model.")


def _resolve(path: str | os.PathLike) -> Path:
    final, _, previous = _paths(path)
    if (final / _META).is_file():
        return final
    if not final.exists() and (previous / _META).is_file():
        warnings.warn(f"{final} is missing but {previous.name} is complete (a save was "
                      f"interrupted while replacing it): loading {previous}.", stacklevel=3)
        return previous
    if final.exists():
        raise CheckpointError(f"{final} is not a complete canzona checkpoint (no {_META}).")
    raise CheckpointError(f"no checkpoint at {final}.")


def load_checkpoint(path: str | os.PathLike, model: nn.Module | None, optimizer: Any, *,
                    extra: Mapping[str, Any] | None = None,
                    process_group: Any = None) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_checkpoint` under this or any other plan of the
    same model into the model's parameters and the optimizer (and ``extra``'s objects).

    Every rank checks what it needs before the one collective; a problem on any rank raises
    ``CheckpointError`` on every rank (naming the parameter and the fix) and changes nothing.

    Returns:
        The checkpoint's ``canzona.json`` (kernel, plan hash and sizes it was saved under).
    """
    where = _resolve(path)
    state = dcp_state(model, optimizer, load_from=where, extra=extra, process_group=process_group)
    with _quiet():
        dcp.load(state.state_dict, storage_reader=dcp.FileSystemReader(where),
                 planner=state.planner, process_group=process_group,
                 no_dist=not _distributed())
    state.finish()
    return state.meta


class DCPState:
    """What :func:`dcp_state` hands a caller of DCP: the ``state_dict`` to save or to load into
    (add your own keys to it), the ``planner`` to pass, and ``finish()`` to call after a load."""

    def __init__(self, state_dict: dict[str, Any], planner: Any, after: list[Any],
                 meta: dict[str, Any]) -> None:
        self.state_dict, self.planner, self.meta = state_dict, planner, meta
        self._after = after

    def finish(self) -> None:
        """After ``dcp.load``: put permuted state in place, take the main copies from the
        weights if the checkpoint has none, and reset the gradient buckets."""
        for fn in self._after:
            fn()


def dcp_state(model: nn.Module | None, optimizer: Any, *,
              load_from: str | os.PathLike | None = None,
              extra: Mapping[str, Any] | None = None, process_group: Any = None) -> DCPState:
    """The logical state of the model and optimizer for people who call DCP themselves::

        st = canzona.dcp_state(model, opt)                      # save
        st.state_dict["trainer"] = my_stateful
        dcp.save(st.state_dict, checkpoint_id=path, planner=st.planner)

        st = canzona.dcp_state(model, opt, load_from=path)      # load (checks, agrees)
        st.state_dict["trainer"] = my_stateful
        dcp.load(st.state_dict, checkpoint_id=path, planner=st.planner)
        st.finish()

    The keys are those of :func:`save_checkpoint` (which adds crash-safe publishing and
    ``canzona.json``). With ``load_from`` every rank checks the checkpoint's keys and shapes
    against what it needs and all agree (one all-reduce) before returning; a problem raises
    ``CheckpointError`` on every rank.
    """
    optimizer._check_open("dcp_state")
    _check_model(model, optimizer)
    if load_from is None:
        E = _entries(optimizer, model, saving=True, group_rank=_rank(process_group))
        for k, v in (extra or {}).items():
            E.sd[f"extra.{k}"] = v
        return DCPState(E.sd, SavePlanner(), [], _metadata(optimizer, sorted(extra or {}),
                                                            model is not None))
    where = Path(load_from)
    meta_file = where / _META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    problem, error = None, None
    try:
        saved = dcp.FileSystemReader(where).read_metadata()
        E = _entries(optimizer, model, saving=False, saved=saved)
        problem = _problem(meta, saved, E, optimizer, model, extra)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the collective
        problem, error = f"cannot load {where}: {exc}", exc
    try:
        _agree(problem, process_group, optimizer)
    except CheckpointError:
        if error is not None and not isinstance(error, (CheckpointError, OSError)):
            raise error from None
        raise
    for k, v in (extra or {}).items():
        E.sd[f"extra.{k}"] = v
    main_saved = any(k.endswith(".main") for k in saved.state_dict_metadata)
    if not main_saved:
        for k in [k for k in E.sd if k.endswith(".main")]:
            del E.sd[k]
    after = list(E.after)
    if optimizer._main_params and not main_saved:
        after.append(optimizer.reload_main_params)
    after.append(optimizer._start_next_iteration)
    return DCPState(E.sd, LoadPlanner(), after, meta)


def _problem(meta: dict, saved: Any, E: _Entries, opt: Any, model: Any,
             extra: Mapping[str, Any] | None) -> str | None:
    """The first reason this rank cannot load, or None."""
    if meta and meta.get("format") != FORMAT:
        return (f"checkpoint format {meta.get('format')} is not this canzona's ({FORMAT}); "
                "load it with the version that wrote it.")
    if meta and meta.get("kernel") != opt._matrix.name:
        return (f"the checkpoint holds {meta.get('kernel')} state; this optimizer runs "
                f"{opt._matrix.name}. Build the optimizer with the plan's kernel it was saved "
                "with.")
    have = saved.state_dict_metadata
    for key, shape in E.needs.items():
        if key.endswith(".main") and key not in have:
            continue  # saved without main copies: taken from the weights
        if key not in have:
            return _missing(key, have, meta, opt)
        md = have[key]
        size = tuple(getattr(md, "size", ()))
        if hasattr(md, "size") and size != tuple(shape):
            return (f"'{key}' is {list(size)} in the checkpoint but {list(shape)} here: the "
                    "checkpoint is of another model (or another vocabulary).")
    for k in extra or {}:
        if not any(x == f"extra.{k}" or x.startswith(f"extra.{k}.") for x in have):
            return f"the checkpoint has no extra '{k}' (it has {meta.get('extra')})."
    return None


def _missing(key: str, have: Mapping[str, Any], meta: dict, opt: Any) -> str:
    if key.startswith("optim."):
        rest = key[len("optim."):]
        param = max((n for n in opt._names if rest.startswith(n)), key=len, default=None)
        if param is not None:
            split_saved = any(k.startswith(f"optim.{param}#") for k in have)
            wants_part = rest.startswith(f"{param}#")
            if split_saved != wants_part:
                saved_as, here = ("split", "fuses") if split_saved else ("fused", "splits")
                return (f"{opt._matrix.name} state of '{param}' was saved with the matrix "
                        f"{saved_as} (Q/K/V or gate/up) and this plan {here} it: statistics of "
                        "one matrix do not carry over to its parts or back. Plan with the "
                        "split_qkv/split_gate_up settings it was saved with "
                        f"({json.dumps(meta.get('optimizer'), sort_keys=True)}).")
    return (f"the checkpoint has no '{key}': it was saved for another model or optimizer "
            f"({meta.get('model')}, {meta.get('kernel')}).")


def _agree(problem: str | None, group: Any, opt: Any) -> None:
    """Every rank raises if any rank found a problem (one all-reduce before DCP's collective)."""
    if _distributed():
        device = opt._params[0].device if opt._params else torch.device("cpu")
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if problem is None and int(flag.item()):
            problem = "another rank cannot load this checkpoint (see its error); nothing loaded"
    if problem is not None:
        raise CheckpointError(problem)
