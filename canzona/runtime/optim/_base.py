"""The interface every optimizer kernel of ``canzona.runtime.optim`` shares.

A matrix optimizer's step is split in two phases so the runtime can compute a matrix's update on
whichever rank hosts it and apply it wherever the parameter's shards live::

    updates = opt.direction(grads, states, names=names)   # whole logical matrices, stateful,
                                                           # batched over same-shape matrices
    opt.apply(param_shard, update_shard, full_shape=...)   # elementwise: works on a TP shard

``direction`` validates everything (shapes, state, finiteness) before it mutates anything, so an
exception leaves parameters and state untouched. An entry of ``None`` in its result means "leave
this parameter alone this step": a non-finite gradient under ``nonfinite="skip"``, or SOAP's first
step (which only initialises its preconditioner, as the reference implementation does).

Per-task state is a plain ``dict[str, Tensor]`` made by ``init_state`` (so the runtime owns it and
can save or move it); the kernels update it in place and never replace its tensors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "MatrixOptimizer",
    "NonFiniteGradientError",
    "NonFinitePolicy",
    "SettingError",
    "check_finite",
    "check_range",
]

NonFinitePolicy = Literal["raise", "skip"]


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf. ``names`` lists the offending parameters."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        super().__init__(
            f"non-finite gradient (NaN or Inf) in {len(self.names)} parameter(s): "
            + ", ".join(self.names)
            + "; nothing was updated (set nonfinite='skip' to skip such parameters instead)"
        )


class SettingError(ValueError):
    """A kernel config field out of its range or choices: ``owner`` (the config class), ``field``
    (``lr``, ``betas[0]``, …) and ``detail`` (the value and what is allowed), so that a caller
    can name its own argument instead of the field."""

    def __init__(self, owner: str, field: str, detail: str) -> None:
        self.owner, self.field, self.detail = owner, field, detail
        super().__init__(f"{owner}.{field} = {detail}")


def check_range(
    owner: str,
    field: str,
    value: object,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``owner.field``, its value and the allowed range."""
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    allowed = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
    if integer:
        ok_type = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok_type or (not integer and not math.isfinite(value)):  # type: ignore[arg-type]
        kind = "an int" if integer else "a finite number"
        raise SettingError(owner, field, f"{value!r} must be {kind} in {allowed}")
    v = float(value)  # type: ignore[arg-type]
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise SettingError(owner, field, f"{value!r} is out of range; allowed {allowed}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise SettingError(owner, field, f"{value!r} is out of range; allowed {allowed}")


def check_choice(owner: str, field: str, value: object, choices: Sequence[object]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise SettingError(owner, field,
                           f"{value!r} is not allowed; choose one of {list(choices)}")


def param_names(names: Sequence[str] | None, count: int) -> list[str]:
    """Names to report in errors: the given ones, or ``"#i"`` by position."""
    if names is None:
        return [f"#{i}" for i in range(count)]
    if len(names) != count:
        raise ValueError(f"got {len(names)} names for {count} gradients")
    return list(names)


def check_finite(grads: Sequence[Tensor]) -> list[bool]:
    """Whether each gradient is all-finite, with a single device synchronisation.

    A norm is NaN or Inf whenever an element is, and is one fused pass (``isfinite().all()`` is
    ~20x slower on the CPU). A norm can also overflow for finite elements (above ~1e19 in fp32);
    only those gradients get the exact elementwise check.
    """
    if not grads:
        return []
    norms = torch._foreach_norm(list(grads))
    flags = torch.stack([n.to(device=grads[0].device) for n in norms]).isfinite().tolist()
    return [ok or bool(torch.isfinite(g).all()) for ok, g in zip(flags, grads)]


def nonfinite_mask(
    grads: Sequence[Tensor], names: list[str], policy: NonFinitePolicy
) -> list[bool]:
    """Per gradient, whether to skip it. Raises ``NonFiniteGradientError`` under ``"raise"``."""
    finite = check_finite(grads)
    bad = [names[i] for i, ok in enumerate(finite) if not ok]
    if bad and policy == "raise":
        raise NonFiniteGradientError(bad)
    return [not ok for ok in finite]


def check_state(
    owner: str,
    name: str,
    state: Mapping[str, Tensor],
    expected: Mapping[str, tuple[int, ...]],
    device: torch.device | None = None,
) -> None:
    """Check that ``state`` holds tensors of the expected shapes (raises ``ValueError``).

    With ``device``, every tensor but the CPU ``step`` counter must live there.
    """
    for key, shape in expected.items():
        t = state.get(key)
        if t is None:
            raise ValueError(
                f"{owner}: state of parameter {name} lacks {key!r} (was it made by init_state "
                f"for this shape and config?)"
            )
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{owner}: state {key!r} of parameter {name} has shape {tuple(t.shape)}, "
                f"expected {tuple(shape)}"
            )
        if device is not None and key != "step" and t.device != device:
            raise ValueError(
                f"{owner}: state {key!r} of parameter {name} is on {t.device}, "
                f"its gradient on {device}"
            )


def check_matrix_grads(owner: str, grads: Sequence[Tensor], names: list[str]) -> None:
    """Matrix optimizers take 2-D floating-point gradients."""
    for g, name in zip(grads, names):
        if g.ndim != 2:
            raise ValueError(
                f"{owner}: gradient of {name} has shape {tuple(g.shape)}; expected 2-D"
            )
        if not g.is_floating_point():
            raise ValueError(f"{owner}: gradient of {name} has dtype {g.dtype}; expected floating")
        if g.is_sparse:
            raise ValueError(f"{owner}: gradient of {name} is sparse; dense gradients only")


def read_step(state: Mapping[str, Tensor]) -> int:
    """The number of steps already taken, from the state's 0-d ``step`` counter."""
    return int(state["step"].item())


def new_step_counter() -> Tensor:
    """A 0-d float32 step counter on the CPU, as ``torch.optim`` keeps it."""
    return torch.zeros((), dtype=torch.float32)


def zero_state(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
               device: torch.device | str | None) -> dict[str, Tensor]:
    """Zero tensors of ``shapes`` (every key but ``"step"``) plus a fresh step counter."""
    state = {key: torch.zeros(s, dtype=dtype, device=device)
             for key, s in shapes.items() if key != "step"}
    state["step"] = new_step_counter()
    return state


class MatrixOptimizer(ABC):
    """A matrix optimizer split into a stateful ``direction`` and an elementwise ``apply``.

    Subclasses hold a frozen, validated config in ``self.config`` with at least ``lr``,
    ``weight_decay`` and ``nonfinite``.
    """

    name: str = "matrix optimizer"

    #: The state survives a change of plan as one param-level tensor per key, row blocks saved
    #: by each task's owner (only Muon: its state is elementwise in the matrix's rows).
    row_state_only: bool = False

    #: The state is elementwise in the matrix's rows and the whole matrix is needed only for
    #: the orthogonalisation: a rank holding some rows of a matrix keeps their state
    #: (:meth:`init_row_state`), makes their inputs (:meth:`momentum_inputs`) and the matrix's
    #: owner orthogonalises the whole inputs (:meth:`orthogonalise`); ``direction`` is the two
    #: composed. Muon; not NorMuon, whose row statistics read the whole orthogonalised update.
    local_state: bool = False

    def state_roles(self, shape: Sequence[int]) -> dict[str, str] | None:
        """How each state key of an m×n task follows a permutation P of the matrix's rows (the
        rows of a TP-gathered matrix in canonical order): ``"rows"`` (X → P X), ``"both"``
        (X → P X Pᵀ, a left statistic), ``"fixed"`` (unchanged). None: the state cannot follow
        a row permutation (blocks that would mix rows)."""
        return None

    @abstractmethod
    def init_state(
        self,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> dict[str, Tensor]:
        """Fresh state of one m×n task: a plain dict of zero-initialised tensors."""

    @abstractmethod
    def direction(
        self,
        grads: Sequence[Tensor],
        states: Sequence[dict[str, Tensor]],
        *,
        names: Sequence[str] | None = None,
    ) -> list[Tensor | None]:
        """Updates of whole matrices (to be scaled by the learning rate in ``apply``).

        Args:
            grads: Gradients of whole logical matrices.
            states: Their states (updated in place).
            names: Parameter names for error messages.

        Returns:
            One update per gradient, or ``None`` where the parameter must be left untouched.
        """

    def init_row_state(self, rows: int, shape: Sequence[int],
                       dtype: torch.dtype = torch.float32,
                       device: torch.device | str | None = None) -> dict[str, Tensor]:
        """Fresh state of ``rows`` rows (0 allowed) of an m×n task (kernels with
        :attr:`local_state`)."""
        raise NotImplementedError(f"{self.name} keeps whole-matrix state (local_state is False)")

    def momentum_inputs(self, grads: Sequence[Tensor], states: Sequence[dict[str, Tensor]], *,
                        names: Sequence[str] | None = None) -> list[Tensor | None]:
        """The state step of blocks of rows (kernels with :attr:`local_state`): per gradient
        block, its state (from :meth:`init_row_state`) updated in place and the rows of the
        input to :meth:`orthogonalise`, or None where the parameter is left alone."""
        raise NotImplementedError(f"{self.name} keeps whole-matrix state (local_state is False)")

    def orthogonalise(self, inputs: Sequence[Tensor | None], *,
                      names: Sequence[str] | None = None) -> list[Tensor | None]:
        """The updates of whole matrices from their whole :meth:`momentum_inputs` (kernels with
        :attr:`local_state`); None stays None."""
        raise NotImplementedError(f"{self.name} keeps whole-matrix state (local_state is False)")

    @abstractmethod
    def apply(
        self,
        param: Tensor,
        update: Tensor,
        *,
        lr: float | None = None,
        weight_decay: float | None = None,
        full_shape: Sequence[int] | None = None,
    ) -> None:
        """Apply ``update`` (or a shard of it) to ``param`` (or the matching shard), in place.

        Args:
            param: The parameter or its tensor-parallel shard.
            update: The matching part of ``direction``'s result.
            lr: Learning rate; the config's when ``None``.
            weight_decay: Decoupled weight decay; the config's when ``None``.
            full_shape: Shape of the logical matrix; ``param.shape`` when ``None``.
        """

    @abstractmethod
    def flops(self, shape: Sequence[int], *, amortised: bool = True) -> int:
        """FLOPs of one step of an m×n task (``canzona.planner.formulas``)."""

    @abstractmethod
    def state_numel(self, shape: Sequence[int]) -> int:
        """Elements of the state ``init_state`` allocates for an m×n task."""

    def step(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Sequence[dict[str, Tensor]],
        *,
        names: Sequence[str] | None = None,
        lr: float | None = None,
        weight_decay: float | None = None,
    ) -> list[int]:
        """``direction`` then ``apply`` on whole matrices.

        Returns:
            Indices of the parameters left untouched (see ``direction``).
        """
        if len(params) != len(grads):
            raise ValueError(f"got {len(params)} params for {len(grads)} gradients")
        updates = self.direction(grads, states, names=names)
        untouched = []
        for i, (p, u) in enumerate(zip(params, updates)):
            if u is None:
                untouched.append(i)
                continue
            self.apply(p, u, lr=lr, weight_decay=weight_decay, full_shape=tuple(p.shape))
        return untouched


def matrix_shape(owner: str, shape: Sequence[int]) -> tuple[int, int]:
    """Validate an m×n shape."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) <= 0:
        raise ValueError(f"{owner}: expected a 2-D shape with positive sizes, got {shape}")
    return shape  # type: ignore[return-value]


def common_length(owner: str, grads: Sequence[Tensor], states: Sequence[Mapping]) -> None:
    if len(grads) != len(states):
        raise ValueError(f"{owner}: got {len(grads)} gradients for {len(states)} states")
