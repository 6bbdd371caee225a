"""Optimizer kernels: Muon, NorMuon, Shampoo and SOAP for whole matrices, AdamW for everything else.

Each matrix optimizer splits its step into ``direction`` (stateful, whole logical matrices,
batched) and ``apply`` (elementwise, works on tensor-parallel shards); see ``_base``. State is a
plain ``dict[str, Tensor]`` per task, made by ``init_state``. FLOPs and state sizes are the
torch-free formulas of ``canzona.planner.formulas``. ``registry`` maps each optimizer name of the
planner's registry (``canzona.planner.optimizers``) to its kernel and config
(:class:`~canzona.runtime.optim.registry.KernelSpec`).
"""

from canzona.runtime.optim._base import MatrixOptimizer, NonFiniteGradientError
from canzona.runtime.optim.adamw import AdamW, AdamWConfig
from canzona.runtime.optim.muon import Muon, MuonConfig, newton_schulz
from canzona.runtime.optim.normuon import NorMuon, NorMuonConfig
from canzona.runtime.optim.shampoo import Shampoo, ShampooConfig
from canzona.runtime.optim.registry import KernelSpec
from canzona.runtime.optim.soap import SOAP, SOAPConfig

__all__ = [
    "SOAP",
    "AdamW",
    "AdamWConfig",
    "KernelSpec",
    "MatrixOptimizer",
    "Muon",
    "MuonConfig",
    "NonFiniteGradientError",
    "NorMuon",
    "NorMuonConfig",
    "SOAPConfig",
    "Shampoo",
    "ShampooConfig",
    "newton_schulz",
]
