"""Muon: momentum followed by Newton–Schulz orthogonalisation, batched over same-shape matrices.

Semantics and defaults are those of ``torch.optim.Muon`` (torch ≥ 2.9, ``torch/optim/_muon.py``),
after Keller Jordan's post (https://kellerjordan.github.io/posts/muon/) and Moonshot's "Muon is
Scalable for LLM Training" (arXiv 2502.16982) for ``adjust_lr_fn="match_rms_adamw"``:

* momentum ``B ← lerp(B, G, 1 − μ)``; Nesterov uses ``lerp(G, B, μ)``;
* the update is cast to ``ns_dtype`` (bfloat16 by default, as torch does), tall matrices are
  transposed, ``X ← X / max(‖X‖_F, eps)``, then per step ``A = X Xᵀ; B = bA + cA²; X = aX + BX``;
* ``apply``: ``θ ← θ·(1 − lr·wd) − adjusted_lr · O`` with ``adjusted_lr`` from the *logical*
  matrix shape, so it can be applied shard by shard.

With the default ``ns_dtype`` the result is bitwise equal to ``torch.optim.Muon`` on the CPU
(``tests/runtime/optim/test_muon_kernel.py``).

Coefficient schedules (``ns_coefficients``, :data:`NS_SCHEDULES`; the table and the rule below
live in ``canzona.planner.settings``, because a plan records the schedule), by name:

* ``"simple"``: Keller Jordan's (a, b, c) = (3.4445, −4.7750, 2.0315) at every step (torch's
  default; the default here too);
* ``"quintic"``: the 5 per-step triples of modded-nanogpt and Cesista's coefficient search
  (https://leloykun.github.io/ponder/muon-opt-coeffs/), Megatron-LM's ``coefficient_type=
  "quintic"``;
* ``"polar_express"``: the 8 per-step triples of Polar Express (Amsel et al., arXiv 2505.16932,
  safety 1e-2), as ``pytorch-optimizer`` ships them;

or one (a, b, c), or a per-step list of triples. A run has ``ns_steps`` steps: step i takes
entry min(i, len − 1) of the list, so a shorter list repeats its last step (Polar Express's
rule) and a longer one is cut. Megatron-LM cycles its ``quintic`` list instead and refuses
``polar_express`` below 8 steps; at its default 5 steps ``quintic`` agrees.

Update scalings (``adjust_lr_fn``, :data:`LR_SCALINGS`), the factor the learning rate of an
m × n matrix (m rows: its output dimension) is multiplied by:

* ``"original"`` (default): max(1, m/n)^½ (``torch.optim.Muon``);
* ``"match_rms_adamw"``: 0.2·max(m, n)^½ (``torch.optim.Muon``; Moonlight);
* ``"spectral"``: max(m, n)^½ (Megatron-LM / Emerging-Optimizers ``scale_mode``);
* ``"shape_scaling"``: max(1, m/n)^½ (Megatron-LM; equals ``original``);
* ``"unit_rms_norm"``: (m/n)^½ (Megatron-LM; Scion).

Batching: ``direction`` groups the matrices by shape, stacks each group and runs Newton–Schulz
with ``bmm``/``baddbmm`` in one call per group — one kernel per product instead of one per
matrix, which pays for small matrices (see ``benchmarks/bench_kernels.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from canzona.planner import formulas
from canzona.planner.settings import NS_SCHEDULES, Coefficients, ns_schedule
from canzona.runtime.optim._base import (
    MatrixOptimizer,
    NonFinitePolicy,
    check_choice,
    check_matrix_grads,
    check_range,
    check_state,
    common_length,
    matrix_shape,
    nonfinite_mask,
    param_names,
)

__all__ = ["LR_SCALINGS", "NS_SCHEDULES", "POLAR_EXPRESS_COEFFICIENTS", "QUINTIC_COEFFICIENTS",
           "Muon", "MuonConfig", "adjust_lr", "newton_schulz"]

#: torch.optim.Muon's (and Keller Jordan's) fixed quintic coefficients (a, b, c).
DEFAULT_COEFFICIENTS: Coefficients = NS_SCHEDULES["simple"][0]

#: Per-step coefficients of the "quintic" schedule (Megatron-LM / Emerging-Optimizers).
QUINTIC_COEFFICIENTS: tuple[Coefficients, ...] = NS_SCHEDULES["quintic"]

#: Per-step coefficients of Polar Express (arXiv 2505.16932, safety 1e-2); its last step is the
#: one that repeats.
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = NS_SCHEDULES["polar_express"]

#: The update scalings (``MuonConfig.adjust_lr_fn``): the factor an m × n matrix's learning rate
#: is multiplied by, from (m, n).
LR_SCALINGS: dict[str, Callable[[int, int], float]] = {
    "original": lambda m, n: math.sqrt(max(1.0, m / n)),
    "match_rms_adamw": lambda m, n: 0.2 * math.sqrt(max(m, n)),
    "spectral": lambda m, n: math.sqrt(max(m, n)),
    "shape_scaling": lambda m, n: math.sqrt(max(1.0, m / n)),
    "unit_rms_norm": lambda m, n: math.sqrt(m / n),
}

AdjustLrFn = Literal["original", "match_rms_adamw", "spectral", "shape_scaling",
                     "unit_rms_norm"] | None
ScheduleName = Literal["simple", "quintic", "polar_express"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonConfig:
    """Hyper-parameters of Muon; defaults equal ``torch.optim.Muon``'s."""

    lr: float = 1e-3
    """Learning rate, ≥ 0 (``apply`` may override it per call)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, ≥ 0: ``θ ← θ·(1 − lr·wd)`` before the update."""
    momentum: float = 0.95
    """Momentum μ in [0, 1)."""
    nesterov: bool = True
    """Nesterov momentum (``lerp(G, B, μ)``) instead of the buffer itself."""
    ns_coefficients: Coefficients | tuple[Coefficients, ...] | ScheduleName = (
        DEFAULT_COEFFICIENTS
    )
    """A schedule's name ("simple", "quintic", "polar_express"), one (a, b, c) used at every
    step, or a per-step tuple of triples (a shorter one repeats its last step)."""
    eps: float = 1e-7
    """Floor of the Frobenius norm the update is divided by, > 0."""
    ns_steps: int = 5
    """Newton–Schulz steps in [1, 99], whatever the schedule's length."""
    adjust_lr_fn: AdjustLrFn = None
    """The update scaling, a name of :data:`LR_SCALINGS` (None: "original",
    lr·max(1, rows/cols)^½)."""
    ns_dtype: torch.dtype = torch.bfloat16
    """dtype of the Newton–Schulz iteration: bfloat16 (torch's) or float32/float64."""
    nonfinite: NonFinitePolicy = "raise"
    """On a NaN/Inf gradient: "raise" NonFiniteGradientError, or "skip" that parameter."""
    _schedule: tuple[Coefficients, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        owner = "MuonConfig"
        check_range(owner, "lr", self.lr, 0.0)
        check_range(owner, "weight_decay", self.weight_decay, 0.0)
        check_range(owner, "momentum", self.momentum, 0.0, 1.0, hi_open=True)
        check_range(owner, "eps", self.eps, 0.0, lo_open=True)
        check_range(owner, "ns_steps", self.ns_steps, 1, 99, integer=True)
        check_choice(owner, "nesterov", self.nesterov, (True, False))
        check_choice(owner, "adjust_lr_fn", self.adjust_lr_fn, (None, *LR_SCALINGS))
        check_choice(
            owner, "ns_dtype", self.ns_dtype, (torch.bfloat16, torch.float32, torch.float64)
        )
        check_choice(owner, "nonfinite", self.nonfinite, ("raise", "skip"))
        object.__setattr__(
            self, "_schedule", _coefficient_schedule(self.ns_coefficients, self.ns_steps)
        )

    @property
    def schedule(self) -> tuple[Coefficients, ...]:
        """The (a, b, c) of each Newton–Schulz step, ``ns_steps`` long."""
        return self._schedule


def _coefficient_schedule(spec: object, ns_steps: int) -> tuple[Coefficients, ...]:
    return ns_schedule(spec, ns_steps, "MuonConfig.ns_coefficients")


def adjust_lr(lr: float, adjust_lr_fn: AdjustLrFn, shape: Sequence[int]) -> float:
    """Muon's shape-dependent learning rate: ``lr`` times the :data:`LR_SCALINGS` factor of the
    logical matrix shape (rows, cols); None is ``"original"`` (``torch.optim.Muon``'s
    ``_adjust_lr``)."""
    rows, cols = int(shape[0]), int(shape[1])
    return lr * LR_SCALINGS[adjust_lr_fn or "original"](rows, cols)


def newton_schulz(
    x: Tensor,
    schedule: Sequence[Coefficients],
    *,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    """Orthogonalise a matrix ``[m, n]`` or a stack of same-shape matrices ``[batch, m, n]``.

    Follows ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` operation for operation, so a
    single matrix gives bitwise the same result; a stack runs each product as one batched call.

    Args:
        x: The matrix ``[m, n]`` or stack ``[batch, m, n]``; not modified.
        schedule: (a, b, c) per step.
        eps: Floor of the Frobenius norm.
        dtype: dtype to iterate in (a copy is made); ``None`` keeps ``x.dtype`` (still copies).

    Returns:
        The orthogonalised matrices in ``dtype``, same shape as ``x``.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects [m, n] or [batch, m, n], got {tuple(x.shape)}")
    X = x.to(dtype=dtype, copy=True) if dtype is not None else x.clone()
    return _newton_schulz_(X, schedule, eps)


def _newton_schulz_(X: Tensor, schedule: Sequence[Coefficients], eps: float) -> Tensor:
    """``newton_schulz`` on a tensor it may overwrite (normalised in place)."""
    tall = X.size(-2) > X.size(-1)
    if tall:
        # Iterate on the short side: the Gram matrix is min(m, n)².
        X = X.mT
    batched = X.ndim == 3
    if batched:
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    else:
        norm = X.norm()
    X.div_(norm.clamp(min=eps))
    mm, addmm = (torch.bmm, torch.baddbmm) if batched else (torch.mm, torch.addmm)
    # Preallocated Gram, polynomial and two ping-pong iterates: no allocation per step (on the
    # CPU, tensors above glibc's mmap threshold are fresh, page-faulting memory every time).
    short = (*X.shape[:-1], X.size(-2))
    gram = torch.empty(short, dtype=X.dtype, device=X.device)
    poly = torch.empty_like(gram)
    spare = torch.empty(X.shape, dtype=X.dtype, device=X.device)
    for a, b, c in schedule:
        mm(X, X.mT, out=gram)
        addmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        # X ← aX + poly·X into the buffer X does not occupy (out= must not alias an input).
        addmm(X, poly, X, beta=a, out=spare)
        X, spare = spare, X if X.is_contiguous() else torch.empty_like(spare)
    return X.mT if tall else X


class Muon(MatrixOptimizer):
    """Muon kernels: batched ``direction`` on whole matrices, elementwise ``apply`` on shards.

    State per m×n task: ``{"momentum_buffer": m×n}``. ``direction`` is
    :meth:`momentum_inputs` (elementwise in the rows: a rank may run it on its own rows, with
    the state of those rows, :meth:`init_row_state`) then :meth:`orthogonalise` (on the whole
    inputs, the matrix's owner): :attr:`local_state`.

    Example::

        opt = Muon(MuonConfig(lr=0.02))
        states = [opt.init_state(p.shape, p.dtype, p.device) for p in params]
        opt.step(params, [p.grad for p in params], states)
    """

    name = "Muon"

    def __init__(self, config: MuonConfig | None = None):
        self.config = config if config is not None else MuonConfig()

    row_state_only = True
    local_state = True

    def state_roles(self, shape) -> dict[str, str]:
        matrix_shape(self.name, shape)
        return {"momentum_buffer": "rows"}

    def init_state(self, shape, dtype=torch.float32, device=None) -> dict[str, Tensor]:
        m, n = matrix_shape(self.name, shape)
        return {"momentum_buffer": torch.zeros((m, n), dtype=dtype, device=device)}

    def flops(self, shape, *, amortised: bool = True) -> int:
        m, n = matrix_shape(self.name, shape)
        return formulas.muon_flops(m, n, ns_steps=self.config.ns_steps)

    def state_numel(self, shape) -> int:
        m, n = matrix_shape(self.name, shape)
        return formulas.muon_state_numel(m, n)

    def init_row_state(self, rows, shape, dtype=torch.float32, device=None) -> dict[str, Tensor]:
        m, n = matrix_shape(self.name, shape)
        if not 0 <= rows <= m:
            raise ValueError(f"{self.name}: {rows} rows of a {m}×{n} matrix")
        return {"momentum_buffer": torch.zeros((rows, n), dtype=dtype, device=device)}

    def direction(self, grads, states, *, names=None) -> list[Tensor | None]:
        return self.orthogonalise(self.momentum_inputs(grads, states, names=names))

    def momentum_inputs(self, grads, states, *, names=None) -> list[Tensor | None]:
        """Momentum ``B ← lerp(B, G, 1 − μ)`` on each gradient (a whole matrix or a block of its
        rows) and the Newton–Schulz input: ``lerp(G, B, μ)`` with Nesterov, else ``B`` itself
        (the state's tensor: read it, do not modify it). None for a non-finite gradient under
        ``nonfinite="skip"`` (its state untouched); ``NonFiniteGradientError`` under
        ``"raise"``, before anything is modified."""
        cfg = self.config
        common_length(self.name, grads, states)
        names = param_names(names, len(grads))
        check_matrix_grads(self.name, grads, names)
        for g, s, name in zip(grads, states, names):
            check_state(self.name, name, s, {"momentum_buffer": tuple(g.shape)}, g.device)
        skip = nonfinite_mask(grads, names, cfg.nonfinite)
        # --- nothing has been modified above this line ---

        out: list[Tensor | None] = [None] * len(grads)
        groups: dict[tuple, list[int]] = {}
        for i, g in enumerate(grads):
            if not skip[i]:
                buf = states[i]["momentum_buffer"]
                groups.setdefault((tuple(g.shape), buf.dtype, g.device), []).append(i)
        for idx in groups.values():
            bufs = [states[i]["momentum_buffer"] for i in idx]
            # Momentum is kept in the state's dtype (e.g. fp32 state for bf16 gradients).
            gs = [grads[i].to(bufs[0].dtype) for i in idx]
            torch._foreach_lerp_(bufs, gs, 1 - cfg.momentum)
            ups = torch._foreach_lerp(gs, bufs, cfg.momentum) if cfg.nesterov else bufs
            for i, u in zip(idx, ups):
                out[i] = u
        return out

    def orthogonalise(self, inputs, *, names=None) -> list[Tensor | None]:
        """Newton–Schulz in ``ns_dtype`` of whole matrices' inputs (None stays None; the inputs
        are not modified): one call per group of alike shapes (a stacked ``bmm`` for several, a
        single matrix as ``torch.optim.Muon`` does it). Results are in ``ns_dtype``, those of a
        group views into one batched tensor."""
        cfg = self.config
        names = param_names(names, len(inputs))
        check_matrix_grads(self.name, [x for x in inputs if x is not None],
                           [n for x, n in zip(inputs, names) if x is not None])
        out: list[Tensor | None] = [None] * len(inputs)
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(inputs):
            if x is not None:
                groups.setdefault((tuple(x.shape), x.dtype, x.device), []).append(i)
        for idx in groups.values():
            ups = [inputs[i] for i in idx]
            if len(idx) == 1:
                out[idx[0]] = newton_schulz(ups[0], cfg.schedule, eps=cfg.eps, dtype=cfg.ns_dtype)
                continue
            # One stacked copy in the iteration dtype (the cast torch does per matrix).
            stack = torch.empty((len(idx), *ups[0].shape), dtype=cfg.ns_dtype,
                                device=ups[0].device)
            torch._foreach_copy_(list(stack.unbind(0)), ups)
            ortho = _newton_schulz_(stack, cfg.schedule, cfg.eps)
            for k, i in enumerate(idx):
                out[i] = ortho[k]  # views into one batched tensor (transposed for tall shapes)
        return out

    def finish_shared(self, pieces: Sequence[Tensor], states: Sequence[dict[str, Tensor]],
                      full_shapes: Sequence[Sequence[int]], whole_rows: Sequence[bool],
                      reduce: Callable[[list[tuple[int, Tensor]]], None] | None) -> list[Tensor]:
        """The pieces of shared matrices' orthogonalised updates as they are applied (float32):
        Muon applies them as they are, with no collective. A kernel whose update needs the
        whole matrix after the orthogonalisation (NorMuon's row statistics) overrides it;
        ``reduce`` sums ``(k, tensor)`` items in place over matrix k's sharing ranks."""
        return [p.to(torch.float32) for p in pieces]

    def apply(self, param, update, *, lr=None, weight_decay=None, full_shape=None) -> None:
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        wd = cfg.weight_decay if weight_decay is None else weight_decay
        shape = tuple(param.shape) if full_shape is None else tuple(full_shape)
        if update.shape != param.shape:
            raise ValueError(
                f"Muon.apply: update shape {tuple(update.shape)} != "
                f"param shape {tuple(param.shape)}"
            )
        adjusted = adjust_lr(lr, cfg.adjust_lr_fn, shape)
        param.mul_(1 - lr * wd)
        param.add_(update, alpha=-adjusted)
