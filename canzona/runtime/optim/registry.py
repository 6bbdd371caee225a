"""The runtime's optimizer registry: one :class:`KernelSpec` per matrix optimizer.

It is the torch half of an optimizer; the planner's half (settings read, FLOP and state formulas)
is the :class:`~canzona.planner.optimizers.OptimizerSpec` registered under the same name in
``canzona.planner.optimizers``. A kernel spec says which kernel executes a plan made for that
name, and how the plan's recorded settings become the kernel's config:

* ``recorded(settings)`` maps the plan's ``inputs.optimizer`` (an ``OptimizerSettings``) to the
  config fields it fixes (the plan's costs and task shapes depend on them, so the optimizer
  refuses a different value, at construction and in its param group);
* ``CanzonaOptimizer``'s own arguments ``lr``, ``weight_decay``, ``momentum``, ``ns_steps`` and
  ``ns_dtype`` set the config field of the same name, when the config has one (``ns_dtype`` only
  as a default under ``matrix_options``); given for a config without that field they raise,
  with ``hints[argument]`` appended to the message;
* ``state_layout(config)`` names the config values, besides the recorded ones, that decide which
  state tensors a task holds; a param-group change of one of them is refused during training.

``docs/adding-an-optimizer.md`` walks through adding an optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from canzona.planner.settings import OptimizerSettings, ns_schedule
from canzona.runtime.optim._base import MatrixOptimizer
from canzona.runtime.optim.muon import Muon, MuonConfig
from canzona.runtime.optim.normuon import NorMuon, NorMuonConfig
from canzona.runtime.optim.shampoo import Shampoo, ShampooConfig
from canzona.runtime.optim.soap import SOAP, SOAPConfig

__all__ = ["KernelSpec", "get", "names", "register"]


def _no_layout(config: Any) -> tuple[tuple[str, Any], ...]:
    return ()


def _equal(key: str, given: Any, recorded: Any, config: Mapping[str, Any]) -> bool:
    return bool(given == recorded)


def _same_schedule(key: str, given: Any, recorded: Any, config: Mapping[str, Any]) -> bool:
    """Muon's recorded settings agree: a Newton–Schulz schedule by the steps it runs (a name,
    its triples, or the one triple of ``simple`` are the same schedule)."""
    if key != "ns_coefficients":
        return bool(given == recorded)
    steps = int(config.get("ns_steps", 5))
    try:
        return ns_schedule(given, steps) == ns_schedule(recorded, steps)
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """How the runtime executes one registered matrix optimizer.

    Attributes:
        name: the planner's registry name (``canzona.planner.optimizers``).
        kernel: the :class:`MatrixOptimizer` subclass, built as ``kernel(config)``.
        config: its frozen config dataclass.
        recorded: plan settings → the config fields the plan fixes (plan keys ↔ kernel config).
        state_layout: config → ``((what, value), …)``: further values that decide the state
            tensors of a task (``()`` when only the recorded fields do).
        hints: per ``CanzonaOptimizer`` argument the config lacks, what to use instead.
        agrees: ``(key, given, recorded, config)`` → whether a given value of a recorded
            field is the plan's (equality unless one value has several spellings).
    """

    name: str
    kernel: type[MatrixOptimizer]
    config: type
    recorded: Callable[[OptimizerSettings], dict[str, Any]]
    state_layout: Callable[[Any], tuple[tuple[str, Any], ...]] = _no_layout
    hints: Mapping[str, str] = field(default_factory=dict)
    agrees: Callable[[str, Any, Any, Mapping[str, Any]], bool] = _equal

    def build(self, config: Any) -> MatrixOptimizer:
        """The kernel for ``config`` (an instance of :attr:`config`)."""
        return self.kernel(config)


_REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    """Add ``spec`` to the registry (once per name) and return it."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a kernel for optimizer {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """The optimizer names with a registered kernel, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> KernelSpec | None:
    """The kernel spec registered for ``name``, or None."""
    return _REGISTRY.get(name)


# --- the built-in optimizers ----------------------------------------------------------------------

register(KernelSpec(
    name="muon", kernel=Muon, config=MuonConfig,
    recorded=lambda s: {"ns_steps": s.ns_steps, "ns_coefficients": s.ns_coefficients},
    agrees=_same_schedule,
))

register(KernelSpec(
    name="shampoo", kernel=Shampoo, config=ShampooConfig,
    recorded=lambda s: {"max_preconditioner_dim": s.max_preconditioner_dim,
                        "precondition_frequency": s.shampoo_precondition_frequency,
                        "grafting": "adam" if s.shampoo_grafting else None},
    # exp_avg only for β1 > 0, momentum_buffer only for momentum > 0
    state_layout=lambda c: (("betas[0] > 0", c.betas[0] > 0), ("momentum > 0", c.momentum > 0)),
))

register(KernelSpec(
    name="soap", kernel=SOAP, config=SOAPConfig,
    recorded=lambda s: {"precondition_frequency": s.soap_precondition_frequency,
                        "max_precond_dim": s.soap_max_precond_dim},
    hints={"momentum": "use matrix_options={'betas': …}"},
))

register(KernelSpec(
    name="normuon", kernel=NorMuon, config=NorMuonConfig,
    recorded=lambda s: {"ns_steps": s.ns_steps, "ns_coefficients": s.ns_coefficients},
    agrees=_same_schedule,
))
