"""AdamW for the parameters that are not matrix-optimized (embeddings, output layer, norms, router).

Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (arXiv 1711.05101). The step is
``torch.optim.AdamW``'s single-tensor path operation for operation (``torch/optim/adam.py``,
``_single_tensor_adam`` with ``decoupled_weight_decay=True``, no AMSGrad), so results are bitwise
equal to it. AdamW is elementwise: ``step`` works on any slice of a parameter (a ZeRO-1 cut or a
TP shard), with the state of that slice, so it has no direction/apply split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from canzona.planner import formulas
from canzona.runtime.optim._base import (
    NonFinitePolicy,
    SettingError,
    check_choice,
    check_range,
    check_state,
    common_length,
    new_step_counter,
    nonfinite_mask,
    param_names,
    read_step,
)

__all__ = ["AdamW", "AdamWConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWConfig:
    """Hyper-parameters of AdamW; defaults equal ``torch.optim.AdamW``'s."""

    lr: float = 1e-3
    """Learning rate, ≥ 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """(β1, β2), each in [0, 1)."""
    eps: float = 1e-8
    """Added to the bias-corrected √v, ≥ 0."""
    weight_decay: float = 1e-2
    """Decoupled weight decay, ≥ 0."""
    nonfinite: NonFinitePolicy = "raise"
    """On a NaN/Inf gradient: "raise" NonFiniteGradientError, or "skip" that parameter."""

    def __post_init__(self) -> None:
        owner = "AdamWConfig"
        check_range(owner, "lr", self.lr, 0.0)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise SettingError(owner, "betas", f"{self.betas!r} must be a pair (beta1, beta2)")
        check_range(owner, "betas[0]", self.betas[0], 0.0, 1.0, hi_open=True)
        check_range(owner, "betas[1]", self.betas[1], 0.0, 1.0, hi_open=True)
        check_range(owner, "eps", self.eps, 0.0)
        check_range(owner, "weight_decay", self.weight_decay, 0.0)
        check_choice(owner, "nonfinite", self.nonfinite, ("raise", "skip"))


class AdamW:
    """AdamW kernel. State per tensor (or slice): ``exp_avg``, ``exp_avg_sq`` and ``step``."""

    name = "AdamW"

    def __init__(self, config: AdamWConfig | None = None):
        self.config = config if config is not None else AdamWConfig()

    def init_state(self, shape, dtype=torch.float32, device=None) -> dict[str, Tensor]:
        """Fresh state for a tensor (or slice) of ``shape``."""
        shape = tuple(int(s) for s in shape)
        return {
            "exp_avg": torch.zeros(shape, dtype=dtype, device=device),
            "exp_avg_sq": torch.zeros(shape, dtype=dtype, device=device),
            "step": new_step_counter(),
        }

    def flops(self, shape, *, amortised: bool = True) -> int:
        return formulas.adamw_flops(_numel(shape))

    def state_numel(self, shape) -> int:
        return formulas.adamw_state_numel(_numel(shape))

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
        """One AdamW step, in place.

        Args:
            params: Parameters or slices of them.
            grads: Matching gradients.
            states: Matching states (updated in place).
            names: Parameter names for error messages.
            lr: Learning rate; the config's when ``None``.
            weight_decay: Decoupled weight decay; the config's when ``None``.

        Returns:
            Indices of the parameters left untouched (non-finite gradient under "skip").
        """
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        wd = cfg.weight_decay if weight_decay is None else weight_decay
        beta1, beta2 = cfg.betas
        if len(params) != len(grads):
            raise ValueError(f"AdamW: got {len(params)} params for {len(grads)} gradients")
        common_length(self.name, grads, states)
        names = param_names(names, len(grads))
        for p, g, s, name in zip(params, grads, states, names):
            if p.shape != g.shape:
                raise ValueError(
                    f"AdamW: gradient of {name} has shape {tuple(g.shape)}, param {tuple(p.shape)}"
                )
            check_state(
                self.name,
                name,
                s,
                {"exp_avg": tuple(g.shape), "exp_avg_sq": tuple(g.shape), "step": ()},
                g.device,
            )
        skip = nonfinite_mask(grads, names, cfg.nonfinite)
        # --- nothing has been modified above this line ---

        untouched = []
        for i, (param, grad, state) in enumerate(zip(params, grads, states)):
            if skip[i]:
                untouched.append(i)
                continue
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            grad = grad.to(exp_avg.dtype)  # moments in the state's dtype (no-op when equal)
            state["step"] += 1
            t = read_step(state)
            if wd != 0:
                param.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step_size = lr / (1 - beta1**t)
            bias_correction2_sqrt = (1 - beta2**t) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)
        return untouched


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
