"""Checkpoint directories that survive a change of plan: ``save_checkpoint`` /
``load_checkpoint`` (``canzona.save_checkpoint`` / ``canzona.load_checkpoint``).

They write and read :func:`canzona.runtime.checkpoint.dcp.dcp_state` with DCP's file system
storage, plus ``canzona.json``. A save writes into ``.<name>.partial`` beside the target, then
publishes it with renames: an interrupted save leaves the previous complete checkpoint loadable
(``load_checkpoint`` also finds it as ``.<name>.previous`` if the process died between the two
renames of a replacement).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from canzona.runtime.checkpoint.dcp import META_FILE, dcp_state, is_distributed, rank_in
from canzona.runtime.errors import CheckpointError

__all__ = ["load_checkpoint", "save_checkpoint"]


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
    rank = rank_in(process_group)
    state = dcp_state(model, optimizer, extra=extra, process_group=process_group)
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)  # what an interrupted save left behind
        partial.parent.mkdir(parents=True, exist_ok=True)
    _barrier(process_group)
    with _quiet():
        dcp.save(state.state_dict, storage_writer=dcp.FileSystemWriter(partial),
                 planner=state.planner, process_group=process_group,
                 no_dist=not is_distributed())
    if rank == 0:
        _write_meta(partial, state.meta)
        _publish(final, partial, previous)
    _barrier(process_group)
    return final


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
                 no_dist=not is_distributed())
    state.finish()
    return state.meta


def _resolve(path: str | os.PathLike) -> Path:
    final, _, previous = _paths(path)
    if (final / META_FILE).is_file():
        return final
    if not final.exists() and (previous / META_FILE).is_file():
        warnings.warn(f"{final} is missing but {previous.name} is complete (a save was "
                      f"interrupted while replacing it): loading {previous}.", stacklevel=3)
        return previous
    if final.exists():
        raise CheckpointError(f"{final} is not a complete canzona checkpoint (no {META_FILE}).")
    raise CheckpointError(f"no checkpoint at {final}.")


def _paths(path: str | os.PathLike) -> tuple[Path, Path, Path]:
    p = Path(path)
    return p, p.parent / f".{p.name}.partial", p.parent / f".{p.name}.previous"


def _write_meta(partial: Path, meta: dict[str, Any]) -> None:
    """``canzona.json``, the mark of a complete checkpoint: written last, atomically."""
    tmp = partial / f"{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, partial / META_FILE)
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


def _barrier(group: Any) -> None:
    if is_distributed():
        dist.barrier(group=group)
