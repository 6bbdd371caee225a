"""canzona: matrix-based optimizers (Muon, Shampoo, SOAP) under ZeRO-1 DP and TP.

The planner (``canzona.planner``) is torch-free; the runtime (``canzona.runtime``) needs torch
(``pip install canzona[runtime]``). Names that need torch are loaded lazily so that
``import canzona`` and ``import canzona.planner`` never import torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
