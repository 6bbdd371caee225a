"""Blocked Shampoo with Adam grafting, as practised by Distributed Shampoo.

Reference: Gupta et al., "Shampoo: Preconditioned Stochastic Tensor Optimization" (2018), and
Shi et al., "A Distributed Data-Parallel PyTorch Implementation of the Distributed Shampoo
Optimizer for Training Neural Networks At-Scale" (arXiv 2309.06497), whose conventions we follow:

* the logical m×n matrix is cut into blocks of at most ``max_preconditioner_dim`` per side
  (``torch.split`` along each dimension, remainder last), each block preconditioned on its own;
  blocks are defined on the unsharded matrix, so they do not change with the TP size;
* per block, statistics ``L ← β2·L + (1−β2)·G Gᵀ`` and ``R ← β2·R + (1−β2)·GᵀG`` (with β2 = 1 they
  are plain sums), inverse 4th roots ``(L/(1−β2ᵗ) + εI)^{-1/4}`` by symmetric eigendecomposition
  (eigenvalues clamped at 0, then + ε) every ``precondition_frequency`` steps, starting at step 1;
* the preconditioned quantity is the bias-corrected filtered gradient ``M̂ = EMA_β1(G)/(1−β1ᵗ)``
  (β1 = 0: the gradient itself): ``P = L^{-1/4} M̂ R^{-1/4}`` per block;
* Adam grafting (optional): per block, P is rescaled to the Frobenius norm of Adam's direction
  ``M̂ / (√(V/(1−β_gᵗ)) + ε_g)`` with ``V = EMA_βg(G²)``;
* momentum (optional, dampening 0, optionally Nesterov) on P; decoupled weight decay in ``apply``.

Defaults: betas (0.9, 1.0) and ε 1e-12 as Distributed Shampoo; ``precondition_frequency`` 10
(Distributed Shampoo's default is 1, practical recipes use 10–100; 10 keeps the eigendecomposition
a small share of the step); Adam grafting on (β 0.999, ε 1e-8, Distributed Shampoo's
``AdamGraftingConfig`` defaults) so the learning rate has Adam's scale; lr 1e-3; momentum 0 and
weight decay 0 as there. The roots are computed in the statistics' dtype (float32 for fp32
state) unless ``root_dtype`` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from canzona.planner import formulas
from canzona.runtime.optim._base import (
    MatrixOptimizer,
    NonFinitePolicy,
    SettingError,
    check_choice,
    check_matrix_grads,
    check_range,
    check_state,
    common_length,
    matrix_shape,
    nonfinite_mask,
    param_names,
    read_step,
    zero_state,
)

__all__ = ["Shampoo", "ShampooConfig", "inverse_root"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShampooConfig:
    """Hyper-parameters of blocked Shampoo (see the module docstring for the choices)."""

    lr: float = 1e-3
    """Learning rate, ≥ 0."""
    betas: tuple[float, float] = (0.9, 1.0)
    """(β1, β2): β1 in [0, 1) filters the gradient; β2 in (0, 1] decays L and R (1 = sum)."""
    eps: float = 1e-12
    """Added to the statistics' eigenvalues before the inverse root, ≥ 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, ≥ 0."""
    momentum: float = 0.0
    """Momentum on the preconditioned direction in [0, 1); 0 keeps no buffer."""
    nesterov: bool = False
    """Nesterov momentum (only with momentum > 0)."""
    max_preconditioner_dim: int = 1024
    """Largest block side, ≥ 1."""
    precondition_frequency: int = formulas.SHAMPOO_DEFAULT_PRECONDITION_FREQUENCY
    """Steps between inverse-root recomputations, ≥ 1 (roots are computed at steps 1, 1+f, …)."""
    grafting: Literal["adam"] | None = "adam"
    """Per-block norm grafting: "adam" or None (raw Shampoo direction)."""
    grafting_beta2: float = 0.999
    """Adam grafting's second-moment EMA factor in [0, 1)."""
    grafting_eps: float = 1e-8
    """Adam grafting's ε, > 0."""
    root_dtype: torch.dtype | None = None
    """dtype of the eigendecomposition; None: the statistics' dtype (at least float32)."""
    nonfinite: NonFinitePolicy = "raise"
    """On a NaN/Inf gradient: "raise" NonFiniteGradientError, or "skip" that parameter."""

    def __post_init__(self) -> None:
        owner = "ShampooConfig"
        check_range(owner, "lr", self.lr, 0.0)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise SettingError(owner, "betas", f"{self.betas!r} must be a pair (beta1, beta2)")
        check_range(owner, "betas[0]", self.betas[0], 0.0, 1.0, hi_open=True)
        check_range(owner, "betas[1]", self.betas[1], 0.0, 1.0, lo_open=True)
        check_range(owner, "eps", self.eps, 0.0)
        check_range(owner, "weight_decay", self.weight_decay, 0.0)
        check_range(owner, "momentum", self.momentum, 0.0, 1.0, hi_open=True)
        check_choice(owner, "nesterov", self.nesterov, (True, False))
        check_range(owner, "max_preconditioner_dim", self.max_preconditioner_dim, 1, integer=True)
        check_range(owner, "precondition_frequency", self.precondition_frequency, 1, integer=True)
        check_choice(owner, "grafting", self.grafting, ("adam", None))
        check_range(owner, "grafting_beta2", self.grafting_beta2, 0.0, 1.0, hi_open=True)
        check_range(owner, "grafting_eps", self.grafting_eps, 0.0, lo_open=True)
        check_choice(owner, "root_dtype", self.root_dtype, (None, torch.float32, torch.float64))
        check_choice(owner, "nonfinite", self.nonfinite, ("raise", "skip"))


def inverse_root(
    stat: Tensor, *, root: int = 4, eps: float = 0.0, dtype: torch.dtype | None = None
) -> Tensor:
    """``(stat + eps·I)^{-1/root}`` of a symmetric PSD matrix by eigendecomposition.

    Eigenvalues are clamped at 0 first (round-off can make them slightly negative).
    Returns the result in ``stat.dtype``; computes in ``dtype`` (default: ``stat.dtype``, at least
    float32, as ``eigh`` has no half-precision kernels).
    """
    if dtype is None:
        dtype = torch.promote_types(stat.dtype, torch.float32)
    work = stat.to(dtype)
    vals, vecs = torch.linalg.eigh(work)
    scale = vals.clamp(min=0.0).add_(eps).pow_(-1.0 / root)
    return ((vecs * scale) @ vecs.T).to(stat.dtype)


class Shampoo(MatrixOptimizer):
    """Blocked Shampoo kernels for whole matrices.

    State per m×n task, for each block (i, j) of the block grid: ``L.i.j`` / ``R.i.j`` (the
    statistics) and ``L_root.i.j`` / ``R_root.i.j`` (their inverse 4th roots); per matrix:
    ``exp_avg`` (β1 > 0), ``graft_exp_avg_sq`` (Adam grafting), ``momentum_buffer``
    (momentum > 0), and ``step``.
    """

    name = "Shampoo"

    def __init__(self, config: ShampooConfig | None = None):
        self.config = config if config is not None else ShampooConfig()

    # -- layout -------------------------------------------------------------------------------
    def blocks(self, shape) -> list[tuple[int, int, slice, slice]]:
        """The blocks of an m×n matrix: (i, j, row slice, column slice)."""
        m, n = matrix_shape(self.name, shape)
        d = self.config.max_preconditioner_dim
        out = []
        r0 = 0
        for i, k1 in enumerate(formulas.block_sizes(m, d)):
            c0 = 0
            for j, k2 in enumerate(formulas.block_sizes(n, d)):
                out.append((i, j, slice(r0, r0 + k1), slice(c0, c0 + k2)))
                c0 += k2
            r0 += k1
        return out

    def _expected(self, m: int, n: int) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        shapes: dict[str, tuple[int, ...]] = {"step": ()}
        for i, j, rows, cols in self.blocks((m, n)):
            k1, k2 = rows.stop - rows.start, cols.stop - cols.start
            shapes[f"L.{i}.{j}"] = shapes[f"L_root.{i}.{j}"] = (k1, k1)
            shapes[f"R.{i}.{j}"] = shapes[f"R_root.{i}.{j}"] = (k2, k2)
        if cfg.betas[0] > 0:
            shapes["exp_avg"] = (m, n)
        if cfg.grafting == "adam":
            shapes["graft_exp_avg_sq"] = (m, n)
        if cfg.momentum > 0:
            shapes["momentum_buffer"] = (m, n)
        return shapes

    def state_roles(self, shape) -> dict[str, str] | None:
        """Row-space moments follow the rows; the left statistics and roots both ways, which
        only one row block allows (with several, a permutation would mix blocks)."""
        m, n = matrix_shape(self.name, shape)
        if len(formulas.block_sizes(m, self.config.max_preconditioner_dim)) > 1:
            return None
        return {k: ("both" if k.startswith("L") else "rows" if len(s) == 2 and s == (m, n)
                    and not k.startswith("R") else "fixed")
                for k, s in self._expected(m, n).items()}

    def init_state(self, shape, dtype=torch.float32, device=None) -> dict[str, Tensor]:
        m, n = matrix_shape(self.name, shape)
        return zero_state(self._expected(m, n), dtype, device)

    def flops(self, shape, *, amortised: bool = True) -> int:
        m, n = matrix_shape(self.name, shape)
        return formulas.shampoo_flops(
            m,
            n,
            max_preconditioner_dim=self.config.max_preconditioner_dim,
            precondition_frequency=self.config.precondition_frequency,
            amortised=amortised,
        )

    def state_numel(self, shape) -> int:
        m, n = matrix_shape(self.name, shape)
        cfg = self.config
        return formulas.shampoo_state_numel(
            m,
            n,
            max_preconditioner_dim=cfg.max_preconditioner_dim,
            grafting=cfg.grafting == "adam",
            first_moment=cfg.betas[0] > 0,
            momentum=cfg.momentum > 0,
        )

    # -- step ---------------------------------------------------------------------------------
    def direction(self, grads, states, *, names=None) -> list[Tensor | None]:
        common_length(self.name, grads, states)
        names = param_names(names, len(grads))
        check_matrix_grads(self.name, grads, names)
        for g, s, name in zip(grads, states, names):
            check_state(self.name, name, s, self._expected(*g.shape), g.device)
        skip = nonfinite_mask(grads, names, self.config.nonfinite)
        # --- nothing has been modified above this line ---
        return [
            None if skip[i] else self._one(g.to(s["L.0.0"].dtype), s)
            for i, (g, s) in enumerate(zip(grads, states))
        ]

    def _one(self, grad: Tensor, state: dict[str, Tensor]) -> Tensor:
        cfg = self.config
        beta1, beta2 = cfg.betas
        state["step"] += 1
        t = read_step(state)
        blocks = self.blocks(grad.shape)

        # Statistics of the raw gradient, per block (β2 = 1: plain sums).
        alpha = 1.0 - beta2 if beta2 != 1.0 else 1.0
        for i, j, rows, cols in blocks:
            g = grad[rows, cols]
            L, R = state[f"L.{i}.{j}"], state[f"R.{i}.{j}"]
            # In place through out= (same kernel as addmm_, but visible to FLOP counters).
            torch.addmm(L, g, g.T, beta=beta2, alpha=alpha, out=L)
            torch.addmm(R, g.T, g, beta=beta2, alpha=alpha, out=R)

        if (t - 1) % cfg.precondition_frequency == 0:
            bias2 = 1.0 - beta2**t if beta2 != 1.0 else 1.0
            for i, j, _, _ in blocks:
                for side in ("L", "R"):
                    stat = state[f"{side}.{i}.{j}"]
                    stat = stat / bias2 if bias2 != 1.0 else stat
                    state[f"{side}_root.{i}.{j}"].copy_(
                        inverse_root(stat, root=4, eps=cfg.eps, dtype=cfg.root_dtype)
                    )

        # The filtered, bias-corrected gradient is what both Shampoo and grafting precondition.
        if beta1 > 0:
            exp_avg = state["exp_avg"]
            exp_avg.lerp_(grad, 1.0 - beta1)
            filtered = exp_avg / (1.0 - beta1**t)
        else:
            filtered = grad

        if cfg.grafting == "adam":
            v = state["graft_exp_avg_sq"]
            v.mul_(cfg.grafting_beta2).addcmul_(grad, grad, value=1.0 - cfg.grafting_beta2)
            denom = (v / (1.0 - cfg.grafting_beta2**t)).sqrt_().add_(cfg.grafting_eps)
            graft = filtered / denom

        direction = torch.empty_like(filtered)
        for i, j, rows, cols in blocks:
            p = state[f"L_root.{i}.{j}"] @ filtered[rows, cols] @ state[f"R_root.{i}.{j}"]
            if cfg.grafting == "adam":
                # Shampoo's direction with Adam's per-block step size.
                p_norm = torch.linalg.vector_norm(p)
                g_norm = torch.linalg.vector_norm(graft[rows, cols])
                scale = torch.where(p_norm > 0, g_norm / p_norm, torch.zeros_like(p_norm))
                p.mul_(scale)
            direction[rows, cols] = p

        if cfg.momentum > 0:
            buf = state["momentum_buffer"]
            buf.mul_(cfg.momentum).add_(direction)
            if cfg.nesterov:
                direction.add_(buf, alpha=cfg.momentum)
            else:
                direction.copy_(buf)
        return direction

    def apply(self, param, update, *, lr=None, weight_decay=None, full_shape=None) -> None:
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        wd = cfg.weight_decay if weight_decay is None else weight_decay
        if update.shape != param.shape:
            raise ValueError(
                f"Shampoo.apply: update shape {tuple(update.shape)} != "
                f"param shape {tuple(param.shape)}"
            )
        param.mul_(1.0 - lr * wd)
        param.add_(update, alpha=-lr)

