"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024, arXiv 2409.11321).

For an m×n matrix with statistics L ≈ E[G Gᵀ] (m×m) and R ≈ E[GᵀG] (n×n) and their eigenbases
Q_L, Q_R, one step is (the authors' reference code, github.com/nikhilvyas/SOAP, as ported by
``pytorch_optimizer.SOAP``, which the tests compare against)::

    G' = Q_Lᵀ G Q_R                               # gradient in the eigenbasis
    M  ← lerp(M, G, 1 − β1)                       # first moment, in the original basis
    V  ← lerp(V, G'², 1 − β2)                     # second moment, in the eigenbasis
    U  = Q_L ((Q_Lᵀ M Q_R) / (√V + ε)) Q_Rᵀ       # Adam step, rotated back
    L  ← lerp(L, G Gᵀ, 1 − β_s);  R ← lerp(R, GᵀG, 1 − β_s)
    every f steps: Q ← QR(L Q) with columns sorted by the estimated eigenvalues diag(Qᵀ L Q)
                   (one power iteration), and V's rows/columns permuted to match

The first call only accumulates L, R and takes their first eigenbasis by ``eigh`` (no update, as in
the reference). A side larger than ``max_precond_dim`` is not rotated (identity basis). The bias
correction √(1 − β2ᵗ)/(1 − β1ᵗ) (t counts the steps after the first) is folded into the update;
``apply`` then does ``θ ← θ − lr·U`` followed by ``θ ← θ·(1 − lr·wd)``, the reference's order.

Defaults are the paper's: lr 3e-3, betas (0.95, 0.95), weight decay 0.01, precondition frequency
10, max_precond_dim 10000, eps 1e-8; ``shampoo_beta`` defaults to β2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

__all__ = ["SOAP", "SOAPConfig"]

# State keys per side: statistic and eigenbasis (absent for a side > max_precond_dim).
_SIDES = (("GG_L", "Q_L"), ("GG_R", "Q_R"))


@dataclass(frozen=True, kw_only=True, slots=True)
class SOAPConfig:
    """Hyper-parameters of SOAP (defaults from Vyas et al. 2024)."""

    lr: float = 3e-3
    """Learning rate, ≥ 0."""
    betas: tuple[float, float] = (0.95, 0.95)
    """Adam's (β1, β2), each in [0, 1)."""
    shampoo_beta: float | None = None
    """EMA factor of the L/R statistics in [0, 1); ``None`` uses β2."""
    weight_decay: float = 0.01
    """Decoupled weight decay, ≥ 0."""
    precondition_frequency: int = 10
    """Steps between eigenbasis refreshes (power iteration + QR), ≥ 1."""
    max_precond_dim: int = 10000
    """Sides larger than this are not preconditioned, ≥ 1."""
    eps: float = 1e-8
    """Added to √V, ≥ 0."""
    correct_bias: bool = True
    """Adam's bias correction."""
    nonfinite: NonFinitePolicy = "raise"
    """On a NaN/Inf gradient: "raise" NonFiniteGradientError, or "skip" that parameter."""

    def __post_init__(self) -> None:
        owner = "SOAPConfig"
        check_range(owner, "lr", self.lr, 0.0)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise SettingError(owner, "betas", f"{self.betas!r} must be a pair (beta1, beta2)")
        check_range(owner, "betas[0]", self.betas[0], 0.0, 1.0, hi_open=True)
        check_range(owner, "betas[1]", self.betas[1], 0.0, 1.0, hi_open=True)
        if self.shampoo_beta is not None:
            check_range(owner, "shampoo_beta", self.shampoo_beta, 0.0, 1.0, hi_open=True)
        check_range(owner, "weight_decay", self.weight_decay, 0.0)
        check_range(owner, "precondition_frequency", self.precondition_frequency, 1, integer=True)
        check_range(owner, "max_precond_dim", self.max_precond_dim, 1, integer=True)
        check_range(owner, "eps", self.eps, 0.0)
        check_choice(owner, "correct_bias", self.correct_bias, (True, False))
        check_choice(owner, "nonfinite", self.nonfinite, ("raise", "skip"))


class SOAP(MatrixOptimizer):
    """SOAP kernels for whole matrices.

    State per m×n task: ``exp_avg`` and ``exp_avg_sq`` (m×n), per preconditioned side its
    statistic and eigenbasis (``GG_L``, ``Q_L``: m×m; ``GG_R``, ``Q_R``: n×n) and ``step``.
    """

    name = "SOAP"

    def __init__(self, config: SOAPConfig | None = None):
        self.config = config if config is not None else SOAPConfig()

    def _expected(self, m: int, n: int) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"exp_avg": (m, n), "exp_avg_sq": (m, n), "step": ()}
        for (gg, q), k in zip(_SIDES, (m, n)):
            if k <= self.config.max_precond_dim:
                shapes[gg] = shapes[q] = (k, k)
        return shapes

    def state_roles(self, shape) -> dict[str, str]:
        """M lives in the matrix's rows; V too unless the left side is rotated (then its rows
        are eigen-directions, which a row permutation leaves alone); GG_L both ways, Q_L's rows
        (its columns are eigen-directions)."""
        m, n = matrix_shape(self.name, shape)
        keys = self._expected(m, n)
        roles = {k: "fixed" for k in keys}
        roles["exp_avg"] = "rows"
        roles["exp_avg_sq"] = "fixed" if "GG_L" in keys else "rows"
        if "GG_L" in keys:
            roles["GG_L"], roles["Q_L"] = "both", "rows"
        return roles

    def init_state(self, shape, dtype=torch.float32, device=None) -> dict[str, Tensor]:
        m, n = matrix_shape(self.name, shape)
        return zero_state(self._expected(m, n), dtype, device)

    def flops(self, shape, *, amortised: bool = True) -> int:
        m, n = matrix_shape(self.name, shape)
        return formulas.soap_flops(
            m,
            n,
            max_precond_dim=self.config.max_precond_dim,
            precondition_frequency=self.config.precondition_frequency,
            amortised=amortised,
        )

    def state_numel(self, shape) -> int:
        m, n = matrix_shape(self.name, shape)
        return formulas.soap_state_numel(m, n, max_precond_dim=self.config.max_precond_dim)

    def direction(self, grads, states, *, names=None) -> list[Tensor | None]:
        common_length(self.name, grads, states)
        names = param_names(names, len(grads))
        check_matrix_grads(self.name, grads, names)
        for g, s, name in zip(grads, states, names):
            check_state(self.name, name, s, self._expected(*g.shape), g.device)
        skip = nonfinite_mask(grads, names, self.config.nonfinite)
        # --- nothing has been modified above this line ---
        return [
            None if skip[i] else self._one(g.to(s["exp_avg"].dtype), s)
            for i, (g, s) in enumerate(zip(grads, states))
        ]

    def _one(self, grad: Tensor, state: dict[str, Tensor]) -> Tensor | None:
        cfg = self.config
        beta1, beta2 = cfg.betas
        taken = read_step(state)
        state["step"] += 1
        if taken == 0:
            # First call: statistics and the first eigenbasis only (as the reference does).
            self._update_statistics(grad, state)
            for gg, q in _SIDES:
                if gg in state:
                    state[q].copy_(_eigenbasis(state[gg]))
            return None

        g_rot = _rotate(grad, state)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.lerp_(g_rot.square(), 1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(cfg.eps)
        update = _rotate(_rotate(exp_avg, state) / denom, state, back=True)
        if cfg.correct_bias:
            # Steps with an update so far (the reference's "step - 1").
            t = taken
            update.mul_(math.sqrt(1.0 - math.pow(beta2, t)) / (1.0 - math.pow(beta1, t)))

        self._update_statistics(grad, state)
        if taken % cfg.precondition_frequency == 0:
            self._refresh_bases(state)
        return update

    def apply(self, param, update, *, lr=None, weight_decay=None, full_shape=None) -> None:
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        wd = cfg.weight_decay if weight_decay is None else weight_decay
        if update.shape != param.shape:
            raise ValueError(
                f"SOAP.apply: update shape {tuple(update.shape)} != "
                f"param shape {tuple(param.shape)}"
            )
        # The reference decays after the update (θ − lr·U)·(1 − lr·wd).
        param.add_(update, alpha=-lr)
        if wd != 0:
            param.mul_(1.0 - wd * lr)

    def _update_statistics(self, grad: Tensor, state: dict[str, Tensor]) -> None:
        beta = (
            self.config.betas[1]
            if self.config.shampoo_beta is None
            else self.config.shampoo_beta
        )
        if "GG_L" in state:
            state["GG_L"].lerp_((grad @ grad.T).to(state["GG_L"].dtype), 1.0 - beta)
        if "GG_R" in state:
            state["GG_R"].lerp_((grad.T @ grad).to(state["GG_R"].dtype), 1.0 - beta)

    @staticmethod
    def _refresh_bases(state: dict[str, Tensor]) -> None:
        """One power iteration + QR per side; V follows the new eigenvalue order."""
        exp_avg_sq = state["exp_avg_sq"]
        for dim, (gg, q) in enumerate(_SIDES):
            if gg not in state:
                continue
            Q = state[q]
            product = state[gg] @ Q
            est_eig = (Q * product).sum(dim=0)
            order = torch.argsort(est_eig, descending=True)
            exp_avg_sq.copy_(exp_avg_sq.index_select(dim, order))
            power_iter = product.index_select(1, order)
            # QR in float32 at least: no bfloat16 QR, and Q's orthogonality matters.
            qr_dtype = torch.promote_types(power_iter.dtype, torch.float32)
            Q.copy_(torch.linalg.qr(power_iter.to(qr_dtype)).Q)


def _eigenbasis(gg: Tensor) -> Tensor:
    """Eigenvectors of a statistic, by decreasing eigenvalue."""
    eye = torch.eye(gg.shape[0], device=gg.device, dtype=gg.dtype)
    try:
        # The tiny shift keeps exactly-zero statistics from failing (the reference does this).
        _, vecs = torch.linalg.eigh(gg + 1e-30 * eye)
    except RuntimeError:  # pragma: no cover - ill-conditioned input; retry in float64
        _, vecs = torch.linalg.eigh(gg.double() + 1e-30 * eye.double())
        vecs = vecs.to(gg.dtype)
    return torch.flip(vecs, dims=[1])


def _rotate(x: Tensor, state: dict[str, Tensor], *, back: bool = False) -> Tensor:
    """Q_Lᵀ x Q_R (``back=False``) or Q_L x Q_Rᵀ (``back=True``); missing sides are identity.

    The products are ordered as the reference's ``tensordot`` loop forms them (contract dim 0
    with Q_L, then again with Q_R), which keeps rounding identical.
    """
    y = x
    for _, q in _SIDES:
        Q = state.get(q)
        if Q is None:
            y = y.T
        else:
            y = y.T @ (Q.T if back else Q)
    return y
