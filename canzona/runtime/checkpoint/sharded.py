"""The sharded optimizer state dict: this rank's state under this plan.

``CanzonaOptimizer.state_dict()`` / ``load_state_dict()`` go through here. The state dict holds
only tensors, numbers, strings, None, tuples, lists, dicts and dtypes, so
``torch.load(..., weights_only=True)`` reads it. It loads back only under the same plan (sha256)
and DP rank; a checkpoint that loads under another plan or size is ``canzona.save_checkpoint`` /
``canzona.load_checkpoint`` (:mod:`canzona.runtime.checkpoint.files`: DCP with logical keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from canzona.runtime.errors import PlanMismatchError


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, Tensor) else {k: t.clone() for k, t in v.items()}


def build_state_dict(params: list[Tensor], state: Mapping[Tensor, dict[str, Any]],
                     param_groups: list[dict[str, Any]], *, digest: bytes, rank: int,
                     main: list[Tensor | None] | None) -> dict[str, Any]:
    """Per parameter index its owned task or slice state (cloned), the param groups'
    hyper-parameters with parameter indices, and ``"canzona"``: the plan's sha256, the DP rank
    and (``main``, under ``main_params``) the fp32 main copies."""
    index = {id(p): i for i, p in enumerate(params)}
    saved = {index[id(p)]: {k: _clone(v) for k, v in st.items()} for p, st in state.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index[id(p)] for p in g["params"]]} for g in param_groups]
    meta: dict[str, Any] = {"plan_sha256": digest.hex(), "dp_rank": rank}
    if main is not None:
        meta["main_params"] = [None if m is None else m.clone() for m in main]
    return {"state": saved, "param_groups": groups, "canzona": meta}


def check_owner(state_dict: Mapping[str, Any], *, digest: bytes, rank: int) -> None:
    """The state was saved by this rank under this plan."""
    meta = state_dict.get("canzona", {})
    if meta.get("plan_sha256") != digest.hex() or meta.get("dp_rank") != rank:
        raise PlanMismatchError(
            f"this optimizer state was saved by DP rank {meta.get('dp_rank')} under plan "
            f"{str(meta.get('plan_sha256'))[:12]}; this is rank {rank} under plan "
            f"{digest.hex()[:12]} (sharded state loads under the same plan and rank).")


@torch.no_grad()
def load_into(state_dict: Mapping[str, Any], params: list[Tensor],
              state: Mapping[Tensor, dict[str, Any]], param_groups: list[dict[str, Any]],
              main: list[Tensor | None]) -> bool:
    """Copy a checked state dict into the live state, groups and main copies. Returns False when
    it holds no main copies (the caller then takes them from the parameters)."""
    saved = state_dict["state"]
    for i, p in enumerate(params):
        if p not in state:
            continue
        mine, theirs = state[p], saved[i]
        for k, v in mine.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    vv.copy_(theirs[k][kk])
            else:
                v.copy_(theirs[k])
    for g, sg in zip(param_groups, state_dict["param_groups"]):
        for k, v in sg.items():
            if k != "params":
                g[k] = v
    saved_main = state_dict.get("canzona", {}).get("main_params")
    if saved_main is None:
        return False
    for m, sm in zip(main, saved_main):
        if m is not None and sm is not None:
            m.copy_(sm)
    return True
