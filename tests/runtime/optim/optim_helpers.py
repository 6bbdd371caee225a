"""Helpers of the optimizer-kernel tests (a uniquely named module, importable from the tests)."""

from __future__ import annotations

import math


def rel_err(a, b) -> float:
    """Frobenius relative error ‖a − b‖ / ‖b‖ of tensor a against the reference b, in float64
    (0 when both are zero, inf when only b is); ``dp_helpers.max_rel_err`` is the dict form."""
    a, b = a.detach().double(), b.detach().double()
    if not b.any():
        return 0.0 if not a.any() else math.inf
    return ((a - b).norm() / b.norm()).item()
