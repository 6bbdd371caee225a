"""The ``torch.optim`` parameter groups: a ``"matrix"`` group with every field of the matrix
kernel's config and an ``"adamw"`` group with ``torch.optim.AdamW``'s lr, betas, eps and
weight_decay. ``step()`` reads them at every step, so schedulers and changes by hand act on the
next step; a changed value is validated (ranges, plan-recorded settings, the state layout) before
any kernel is replaced."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.optim import AdamW

#: The ``"adamw"`` group's hyper-parameters (``torch.optim.AdamW``'s).
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def config_fields(config: Any) -> dict[str, Any]:
    """A kernel config's hyper-parameters (its init fields) as a dict."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def _tuplify(value: Any) -> Any:
    """Lists (e.g. betas set as a list) become the tuples the kernel configs hold."""
    return tuple(_tuplify(v) for v in value) if isinstance(value, (list, tuple)) else value


def build_param_groups(matrix_params: list[Tensor], adamw_params: list[Tensor], matrix: Any,
                       adamw: AdamW) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The groups (an empty one is left out, but for a pipeline stage without parameters, whose
    empty AdamW group keeps a scheduler working) and the ``defaults``: the matrix group's
    hyper-parameters, as ``torch.optim.Muon``'s, which is what a momentum-cycling scheduler reads
    to pick its convention (``betas`` if present, else ``momentum``)."""
    mhp = config_fields(matrix.config)
    ahp = {k: getattr(adamw.config, k) for k in ADAMW_KEYS}
    groups = []
    if matrix_params:
        groups.append({"params": matrix_params, "name": "matrix", **mhp})
    if adamw_params or not matrix_params:  # a pipeline stage without parameters keeps one
        groups.append({"params": adamw_params, "name": "adamw", **ahp})
    return groups, dict(mhp if matrix_params else ahp)


def synced_kernels(param_groups: list[dict[str, Any]], matrix: Any, adamw: AdamW, spec: Any,
                   recorded: dict[str, Any]) -> tuple[Any, AdamW]:
    """The kernels for the groups' current values (the same objects when nothing changed); both
    groups are validated before either kernel is replaced, so a bad value changes nothing."""
    new_matrix = new_adamw = None
    for g in param_groups:
        if g.get("name") == "matrix":
            new_matrix = kernel_from_group(matrix, spec, recorded, g)
        elif g.get("name") == "adamw":
            new_adamw = adamw_from_group(adamw, g)
    return new_matrix or matrix, new_adamw or adamw


def kernel_from_group(kernel: Any, spec: Any, recorded: dict[str, Any],
                      group: dict[str, Any]) -> Any:
    """A new matrix kernel if the ``"matrix"`` group's values changed, else None; raises (and
    changes nothing) for a value out of range, a plan-recorded setting or a state-layout change."""
    old = config_fields(kernel.config)
    new = {k: _tuplify(group.get(k, v)) for k, v in old.items()}
    if new == old:
        return None
    for key, value in recorded.items():
        if new[key] != value:
            raise PlanMismatchError(
                f"param group 'matrix': {key}={new[key]!r} disagrees with the plan, which was "
                f"made with {key}={value!r}; the plan fixes it (make a new plan to change it).")
    try:
        fresh = type(kernel)(dataclasses.replace(kernel.config, **new))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"param group 'matrix': {exc}") from None
    layout = spec.state_layout
    for (what, before), (_, after) in zip(layout(kernel.config), layout(fresh.config)):
        if before != after:
            raise ValueError(
                f"param group 'matrix': {kernel.name}'s state was allocated with {what} = "
                f"{before}; the group now asks for {after}, which needs another state layout "
                f"(build the optimizer with such a value to change it during training).")
    return fresh


def adamw_from_group(kernel: AdamW, group: dict[str, Any]) -> AdamW | None:
    """A new AdamW kernel if the ``"adamw"`` group's values changed, else None."""
    cfg = kernel.config
    new = {k: _tuplify(group.get(k, getattr(cfg, k))) for k in ADAMW_KEYS}
    if all(new[k] == getattr(cfg, k) for k in new):
        return None
    try:
        return AdamW(dataclasses.replace(cfg, **new))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"param group 'adamw': {exc}") from None
