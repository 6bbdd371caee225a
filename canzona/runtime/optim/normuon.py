"""NorMuon: Muon whose orthogonalised update has each row normalised by a running second moment.

After Li et al., "NorMuon: Making Muon more efficient and scalable" (arXiv 2510.05491), with the
semantics and defaults of ``pytorch-optimizer``'s ``NorMuon`` for its matrices:

* Muon's momentum and Newton–Schulz (:class:`~canzona.runtime.optim.muon.Muon`, its schedule,
  ``eps`` and iteration dtype), giving O (m × n, m the output rows), cast to float32;
* the second moment of each row, ``v ← lerp(v, mean_j O_ij², 1 − β₂)`` (``v`` is m × 1, state
  ``second_momentum_buffer``), and ``Ô = O / (√v + ε)``;
* ``update_scale="preserve_norm"`` (default): ``Ô ← Ô · ‖O‖_F / (‖Ô‖_F + ε)``, applied with
  Muon's learning-rate scaling (``adjust_lr_fn``); ``"match_rms"``: ``Ô ← Ô · 0.2·√(mn) /
  (‖Ô‖_F + ε)`` with the plain learning rate (the paper's Algorithm 1).

**Shared matrices.** Where several ranks orthogonalise one matrix (shared Newton–Schulz over a
TP group, a DP pair, a TP pair) each holds a piece of O, and the row statistics need a sum
(:meth:`NorMuon.finish_shared`, one all-reduce per matrix and step):

* pieces of whole rows (a column-parallel shard, a DP pair's row blocks): each rank keeps the
  moments of its own rows; the two squared norms ‖O‖² and ‖Ô‖² are summed (2 elements);
* pieces of columns (a row-parallel shard): the partial squared sums of all m rows are summed,
  then every rank holds the same m moments and computes the same norms (m elements).

The planner counts that all-reduce (``formulas.row_stats_numel``, the registry's ``row_stats``
capability). The result equals the single-device update up to summation order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from canzona.planner import formulas
from canzona.runtime.optim._base import (check_choice, check_range, check_state, matrix_shape,
                                          param_names)
from canzona.runtime.optim.muon import Muon, MuonConfig

__all__ = ["NorMuon", "NorMuonConfig"]

UpdateScale = Literal["preserve_norm", "match_rms"]


@dataclass(frozen=True, kw_only=True, slots=True)
class NorMuonConfig(MuonConfig):
    """Muon's hyper-parameters and NorMuon's own (``pytorch-optimizer``'s defaults)."""

    beta2: float = 0.95
    """Decay of the rows' second moment, in [0, 1)."""
    norm_eps: float = 1e-10
    """Added to √v and to ‖Ô‖_F before dividing, ≥ 0."""
    update_scale: UpdateScale = "preserve_norm"
    """``"preserve_norm"``: Ô keeps O's Frobenius norm; ``"match_rms"``: Ô's RMS is 0.2 and the
    learning rate is not scaled (``adjust_lr_fn`` must then be None)."""

    def __post_init__(self) -> None:
        MuonConfig.__post_init__(self)
        owner = "NorMuonConfig"
        check_range(owner, "beta2", self.beta2, 0.0, 1.0, hi_open=True)
        check_range(owner, "norm_eps", self.norm_eps, 0.0)
        check_choice(owner, "update_scale", self.update_scale, ("preserve_norm", "match_rms"))
        if self.update_scale == "match_rms" and self.adjust_lr_fn is not None:
            raise ValueError(f"{owner}: update_scale='match_rms' sets the update's RMS itself; "
                             f"leave adjust_lr_fn None (got {self.adjust_lr_fn!r})")


#: Sums each (piece index k, tensor) in place over piece k's sharing ranks (all alike).
Reduce = Callable[[list[tuple[int, Tensor]]], None]


class NorMuon(Muon):
    """NorMuon kernels: Muon's batched ``direction``, then each row normalised (see the module).

    State per m×n task: ``{"momentum_buffer": m×n, "second_momentum_buffer": m×1}``.
    """

    name = "NorMuon"
    config: NorMuonConfig
    #: The rows' second moments are statistics of the whole orthogonalised update: its state
    #: stays with the matrix's owner.
    local_state = False

    def __init__(self, config: NorMuonConfig | None = None):
        super().__init__(config if config is not None else NorMuonConfig())

    def state_roles(self, shape) -> dict[str, str]:
        matrix_shape(self.name, shape)
        return {"momentum_buffer": "rows", "second_momentum_buffer": "rows"}

    def init_state(self, shape, dtype=torch.float32, device=None) -> dict[str, Tensor]:
        m, n = matrix_shape(self.name, shape)
        return {"momentum_buffer": torch.zeros((m, n), dtype=dtype, device=device),
                "second_momentum_buffer": torch.zeros((m, 1), dtype=dtype, device=device)}

    def state_numel(self, shape) -> int:
        m, n = matrix_shape(self.name, shape)
        return formulas.normuon_state_numel(m, n)

    def direction(self, grads, states, *, names=None) -> list[Tensor | None]:
        for g, s, name in zip(grads, states, param_names(names, len(grads))):
            if g.dim() == 2:
                check_state(self.name, name, s, {"second_momentum_buffer": (g.shape[0], 1)},
                            g.device)
        orthos = super().direction(grads, states, names=names)
        kept = [i for i, o in enumerate(orthos) if o is not None]
        done = self.finish_shared([orthos[i] for i in kept], [states[i] for i in kept],
                                  [tuple(grads[i].shape) for i in kept], [True] * len(kept),
                                  None)
        out: list[Tensor | None] = [None] * len(orthos)
        for i, u in zip(kept, done):
            out[i] = u
        return out

    def finish_shared(self, pieces: Sequence[Tensor], states: Sequence[dict[str, Tensor]],
                      full_shapes: Sequence[Sequence[int]], whole_rows: Sequence[bool],
                      reduce: Reduce | None) -> list[Tensor]:
        """Each piece of an orthogonalised update row-normalised and rescaled (float32, the
        matrix's orientation). ``pieces[k]``: this rank's rows of matrix k
        (``whole_rows[k]``) or its columns; ``states[k]["second_momentum_buffer"]``: the
        moments of those rows, or of all of them; ``full_shapes[k]``: the matrix's (m, n);
        ``reduce``: sums ``(k, tensor)`` items in place over matrix k's sharing ranks (None: the
        pieces are whole matrices). Non-finite input gives non-finite output, as on one device."""
        cfg = self.config
        out = [p.to(torch.float32) for p in pieces]
        sums = [u.square().sum(dim=1, keepdim=True) for u in out]
        cols = [k for k, w in enumerate(whole_rows) if not w]
        if cols and reduce is not None:  # pieces of columns: every row's squares, summed
            reduce([(k, sums[k]) for k in cols])
        norms = []
        for k, (u, s) in enumerate(zip(out, sums)):
            v = states[k]["second_momentum_buffer"]
            v.lerp_(s / full_shapes[k][1], 1 - cfg.beta2)
            d = v.sqrt().add_(cfg.norm_eps)
            if whole_rows[k]:
                norms.append(torch.stack([s.sum(), u.div_(d).square().sum()]))
            else:
                u.div_(d)
                norms.append(torch.stack([s.sum(), (s / d.square()).sum()]))
        rows = [(k, norms[k]) for k, w in enumerate(whole_rows) if w]
        if rows and reduce is not None:  # pieces of whole rows: the two norms, summed
            reduce(rows)
        for k, (u, nrm) in enumerate(zip(out, norms)):
            m, n = full_shapes[k]
            new = nrm[1].sqrt().add_(cfg.norm_eps)
            if cfg.update_scale == "preserve_norm":
                u.mul_(nrm[0].sqrt() / new)
            else:
                u.mul_(0.2 * math.sqrt(m * n) / new)
        return out

    def apply(self, param, update, *, lr=None, weight_decay=None, full_shape=None) -> None:
        cfg = self.config
        if cfg.update_scale == "preserve_norm":
            super().apply(param, update, lr=lr, weight_decay=weight_decay, full_shape=full_shape)
            return
        lr = cfg.lr if lr is None else lr
        wd = cfg.weight_decay if weight_decay is None else weight_decay
        if update.shape != param.shape:
            raise ValueError(f"NorMuon.apply: update shape {tuple(update.shape)} != param shape "
                             f"{tuple(param.shape)}")
        param.mul_(1 - lr * wd)
        param.add_(update, alpha=-lr)
