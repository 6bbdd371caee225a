"""The planner's optimizer registry: one :class:`OptimizerSpec` per matrix optimizer (torch-free).

A spec says what the planner needs to know about a matrix optimizer: its name (the value of
``OptimizerSettings.name`` and of ``canzona plan --optimizer``), which
:class:`~canzona.planner.settings.OptimizerSettings` fields it reads, and its cost per m×n
matrix — matmul FLOPs of one (amortised) step and optimizer-state elements — from the public
formulas of :mod:`canzona.planner.formulas`, which the runtime kernels are tested against.

The runtime half of an optimizer (kernel class, config class, how the plan's settings become
kernel config fields) is registered under the same name in ``canzona.runtime.optim.registry``,
which imports torch; this module imports only the standard library, ``formulas`` and ``errors``,
so the plan schema and the planner stay torch-free. ``docs/adding-an-optimizer.md`` walks
through adding one.

A spec also says what the optimizer can do beyond one owner per matrix
(:attr:`OptimizerSpec.share`); the planner, the simulator, the plan checks and the runtime read
that capability, never the name.

AdamW, which updates every non-matrix parameter whatever the matrix optimizer, is not in the
registry: its costs are fixed (``formulas.adamw_flops``, ``formulas.adamw_state_numel``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import formulas
from .errors import CanzonaError

__all__ = ["SHARE_KINDS", "OptimizerSpec", "get", "names", "register"]

#: How several ranks can update one matrix (:attr:`OptimizerSpec.share`):
#:
#: * ``"gram"`` — shared Newton–Schulz: each rank holds some rows of the (oriented) matrix and
#:   the ranks all-reduce their Gram products, so the pieces exchange every iteration (they
#:   meet in phases and lockstep batches, and a matrix may be shared by two TP groups); the
#:   optimizer state splits with the rows;
#: * ``"blocks"`` — block-hosted: the matrix's preconditioner blocks are apart, so each rank
#:   updates its own block rows with no collective, and keeps the blocks' state;
#: * ``None`` — not shareable: every matrix is updated whole by one rank.
SHARE_KINDS = ("gram", "blocks", None)

#: ``(m, n, settings) -> int``: a cost of one m×n matrix under ``settings`` (an
#: ``OptimizerSettings``; not imported here, because ``settings`` imports this registry).
CostFormula = Callable[[int, int, Any], int]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """What the planner knows of one matrix optimizer.

    Attributes:
        name: registry key: ``OptimizerSettings.name``, ``--optimizer``, the plan file's
            ``inputs.optimizer.name``; lower case.
        summary: one line for help texts.
        settings: the ``OptimizerSettings`` fields ``flops`` and ``state_numel`` read (besides
            ``name``); the others do not change this optimizer's plan.
        flops: ``(m, n, settings)`` → FLOPs of one amortised step of an m×n matrix.
        state_numel: ``(m, n, settings)`` → optimizer-state elements the kernel keeps for it.
        share: how several ranks can update one matrix, one of :data:`SHARE_KINDS`.
        traffic: ``(m, n, settings)`` → bytes its element-wise passes move per step (what the
            roofline cost model charges at the memory bandwidth); None counts none.
        matmul_bytes: ``(m, n, settings)`` → bytes the kernels behind ``flops`` read and write
            (their roofline's memory side); None counts none (compute-bound).
        row_stats: after the orthogonalisation each row of the update is normalised by a
            running second moment of it (NorMuon), so a shared matrix's pieces sum their
            partial row statistics (``formulas.row_stats_numel``): one more all-reduce per
            matrix and step, which the sharing cost counts.
        local_state: its state is elementwise in the gradient's rows (Muon's momentum): under
            FSDP2 each rank keeps its own rows' state and sends the owner the Newton–Schulz
            inputs, in the Newton–Schulz dtype (the runtime kernel's ``local_state``).
    """

    name: str
    summary: str
    settings: tuple[str, ...]
    flops: CostFormula
    state_numel: CostFormula
    share: str | None = None
    traffic: CostFormula | None = None
    matmul_bytes: CostFormula | None = None
    row_stats: bool = False
    local_state: bool = False

    @property
    def title(self) -> str:
        """The name as prose writes it (the summary's head: ``Muon``, ``SOAP``)."""
        return self.summary.split(":", 1)[0]

    @property
    def gram_shared(self) -> bool:
        """Shared matrices run the shared Newton–Schulz (pieces exchange Gram products)."""
        return self.share == "gram"

    @property
    def block_hosted(self) -> bool:
        """Shared matrices are split into their preconditioner blocks (no collective)."""
        return self.share == "blocks"

    @property
    def shareable(self) -> bool:
        """Several ranks can update one matrix."""
        return self.share is not None


_REGISTRY: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add ``spec`` to the registry (once per name) and return it."""
    if not spec.name or spec.name != spec.name.lower() or not spec.name.isidentifier():
        raise ValueError(f"optimizer name {spec.name!r} must be a lower-case identifier")
    if spec.name in _REGISTRY:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
    if spec.share not in SHARE_KINDS:
        raise ValueError(f"optimizer {spec.name!r}: share must be one of {SHARE_KINDS}, "
                         f"not {spec.share!r}")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """The registered optimizer names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> OptimizerSpec:
    """The spec registered as ``name``.

    Raises:
        CanzonaError: no optimizer has that name (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise CanzonaError(f"unknown optimizer {name!r}; registered: "
                           f"{', '.join(_REGISTRY)}.") from None


# --- the built-in optimizers ----------------------------------------------------------------------

register(OptimizerSpec(
    name="muon",
    summary="Muon: momentum orthogonalised by Newton–Schulz.",
    settings=("ns_steps",),
    flops=lambda m, n, s: formulas.muon_flops(m, n, ns_steps=s.ns_steps),
    state_numel=lambda m, n, s: formulas.muon_state_numel(m, n),
    share="gram",
    traffic=lambda m, n, s: formulas.muon_traffic_bytes(m, n),
    matmul_bytes=lambda m, n, s: formulas.muon_matmul_bytes(m, n, ns_steps=s.ns_steps),
    local_state=True,
))

register(OptimizerSpec(
    name="shampoo",
    summary="Shampoo: blocked Kronecker-factored preconditioning, Adam grafting.",
    settings=("max_preconditioner_dim", "shampoo_precondition_frequency", "shampoo_grafting"),
    flops=lambda m, n, s: formulas.shampoo_flops(
        m, n, max_preconditioner_dim=s.max_preconditioner_dim,
        precondition_frequency=s.shampoo_precondition_frequency),
    state_numel=lambda m, n, s: formulas.shampoo_state_numel(
        m, n, max_preconditioner_dim=s.max_preconditioner_dim, grafting=s.shampoo_grafting),
    share="blocks",
    traffic=lambda m, n, s: formulas.shampoo_traffic_bytes(m, n),
))

register(OptimizerSpec(
    name="soap",
    summary="SOAP: Adam in Shampoo's eigenbasis.",
    settings=("soap_precondition_frequency", "soap_max_precond_dim"),
    flops=lambda m, n, s: formulas.soap_flops(
        m, n, max_precond_dim=s.soap_max_precond_dim,
        precondition_frequency=s.soap_precondition_frequency),
    state_numel=lambda m, n, s: formulas.soap_state_numel(
        m, n, max_precond_dim=s.soap_max_precond_dim),
    traffic=lambda m, n, s: formulas.soap_traffic_bytes(m, n),
))

register(OptimizerSpec(
    name="normuon",
    summary="NorMuon: Muon with each row of the update normalised by its running second moment.",
    settings=("ns_steps",),
    flops=lambda m, n, s: formulas.muon_flops(m, n, ns_steps=s.ns_steps),
    state_numel=lambda m, n, s: formulas.normuon_state_numel(m, n),
    share="gram",
    traffic=lambda m, n, s: formulas.normuon_traffic_bytes(m, n),
    matmul_bytes=lambda m, n, s: formulas.muon_matmul_bytes(m, n, ns_steps=s.ns_steps),
    row_stats=True,
))
