"""The logical state of a model and its optimizer as ``torch.distributed.checkpoint`` (DCP)
saves and loads it: :func:`dcp_state` for callers of DCP, and the checks every rank makes (and
agrees on) before DCP's load.

Loading checks everything it can before the one collective (every rank agrees, then DCP's load):
the key layout's format, the kernel, every key this rank needs
(:mod:`canzona.runtime.checkpoint.keys`) and its shape; a Shampoo/SOAP state across a change
between split and fused Q/K/V or gate/up is refused with the reason. ``canzona.json``
(:data:`META_FILE`) records the key layout's format, the kernel, the plan and the sizes a
checkpoint was saved under.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from canzona.planner.plan import FSDP2Plan
from canzona.runtime.checkpoint.keys import FORMAT, Entries, entries
from canzona.runtime.checkpoint.names import upgrade_key
from canzona.runtime.checkpoint.pieces import LoadPlanner, SavePlanner
from canzona.runtime.errors import CheckpointError
from canzona.runtime.introspect import named_params

__all__ = ["META_FILE", "DCPState", "dcp_state", "is_distributed", "rank_in"]

#: The file beside DCP's that records what a checkpoint was saved under.
META_FILE = "canzona.json"


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

    The keys are those of ``canzona.save_checkpoint`` (which adds crash-safe publishing and
    ``canzona.json``), the same under ZeRO-1 and FSDP2 plans (a checkpoint of either loads into
    the other). With ``load_from`` every rank checks the checkpoint's keys and shapes against
    what it needs and all agree (one all-reduce) before returning; a problem raises
    ``CheckpointError`` on every rank.
    """
    optimizer._check_open("dcp_state")
    _check_model(model, optimizer)
    if load_from is None:
        E = entries(optimizer, model, saving=True, group_rank=rank_in(process_group))
        for k, v in (extra or {}).items():
            E.sd[f"extra.{k}"] = v
        return DCPState(E.sd, SavePlanner(), [], _metadata(optimizer, sorted(extra or {}),
                                                            model is not None))
    where = Path(load_from)
    meta_file = where / META_FILE
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    problem, error = None, None
    try:
        saved = dcp.FileSystemReader(where).read_metadata()
        E = entries(optimizer, model, saving=False, saved=saved)
        problem = _format_problem(meta)
        if problem is None:
            _as_saved(E, saved, meta.get("format", FORMAT))
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


def _metadata(opt: Any, extra: list[str], weights: bool) -> dict[str, Any]:
    inputs = opt.plan.inputs
    return {
        "format": FORMAT,
        "kernel": opt._matrix.name,
        "optimizer": inputs.optimizer.model_dump(mode="json"),
        "model": inputs.model,
        "storage": getattr(opt.plan, "storage", "zero1"),
        "dp": inputs.dp,
        "tp": inputs.tp,
        "plan_sha256": opt._digest.hex(),
        "main_params": opt._main_params,
        "weights": weights,
        "extra": extra,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


#: Megatron's TEGroupedMLP expert weights (``linear_fc1.weight{j}``, ``linear_fc2.weight{j}``).
_TE_GROUPED = re.compile(r"\.experts\.linear_fc[12]\.weight\d+$")


def _check_model(model: nn.Module | None, opt: Any) -> None:
    grouped = [n for n in opt._names if _TE_GROUPED.search(n)]
    if grouped and opt.plan.inputs.etp > 1:
        raise CheckpointError(
            f"'{grouped[0]}' is a TEGroupedMLP expert weight split over expert TP = "
            f"{opt.plan.inputs.etp}, whose shard layout Transformer Engine's attributes do not "
            "describe: checkpoints of grouped experts need expert TP 1 "
            "(TransformerConfig.expert_tensor_parallel_size=1) or SequentialMLP experts "
            "(moe_grouped_gemm=False).")
    if model is None:
        return
    if isinstance(opt.plan, FSDP2Plan):
        opt._storage.reshard()  # the model's parameters are the sharded DTensors again
    names = [n for n, _ in named_params(model)]
    if names != list(getattr(opt, "_local_names", opt._names)):
        raise CheckpointError("the model is not the one the optimizer was built for (its "
                              "parameters differ): pass the same model.")


def _format_problem(meta: dict) -> str | None:
    """Why a checkpoint's key format cannot be read (a newer one, or not a format), or None."""
    version = meta.get("format", FORMAT) if meta else FORMAT
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return (f"canzona.json: format is {version!r}, not a key format (1 to {FORMAT}); the "
                "file is damaged or not canzona's: save the checkpoint again.")
    if version > FORMAT:
        return (f"canzona.json: the checkpoint's key format is {version}, newer than this "
                f"canzona's ({FORMAT}): upgrade canzona (python -m pip install -U canzona) to "
                "load it.")
    return None


def _as_saved(E: Entries, saved: Any, version: int) -> None:
    """A checkpoint of an older key format: this rank's entries under the names it was saved
    with (each saved key upgraded through ``names.KEY_UPGRADES`` finds its entry)."""
    if version == FORMAT:
        return
    old = {upgrade_key(k, version): k for k in saved.state_dict_metadata}
    E.sd = {old.get(k, k): v for k, v in E.sd.items()}
    E.needs = {old.get(k, k): v for k, v in E.needs.items()}


def _problem(meta: dict, saved: Any, E: Entries, opt: Any, model: Any,
             extra: Mapping[str, Any] | None) -> str | None:
    """The first reason this rank cannot load, or None."""
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
    if is_distributed():
        device = opt._params[0].device if opt._params else torch.device("cpu")
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if problem is None and int(flag.item()):
            problem = "another rank cannot load this checkpoint (see its error); nothing loaded"
    if problem is not None:
        raise CheckpointError(problem)


def is_distributed() -> bool:
    """A process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank_in(group: Any) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0
