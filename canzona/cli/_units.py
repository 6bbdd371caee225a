"""Units of the CLI's tables, summaries and charts, one family each throughout.

Bytes in binary units (KiB, MiB, GiB, TiB: C_max is given in MiB), FLOPs and counts in decimal SI
prefixes.
"""

from __future__ import annotations


def human(n: float, unit: str = "") -> str:
    """A count or FLOPs in decimal prefixes: ``human(3.2e13, "FLOP")`` → ``32.00 TFLOP``."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def human_flops(n: float) -> str:
    """FLOPs in decimal prefixes: ``human_flops(3.2e13)`` → ``32.00 TFLOP``."""
    return human(n, "FLOP")


def human_bytes(n: float) -> str:
    """Bytes in binary units: ``human_bytes(3 * 2**30)`` → ``3.00 GiB``."""
    for div, suffix in ((2.0 ** 40, "TiB"), (2.0 ** 30, "GiB"), (2.0 ** 20, "MiB"),
                        (2.0 ** 10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {suffix}"
    return f"{n:.0f} B"


def params_count(n: int) -> str:
    """A parameter count as models are named: ``32.76B``."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def seconds(s: float) -> str:
    """Seconds in s, ms or µs: ``seconds(0.0123)`` → ``12.30 ms``."""
    for div, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(s) >= div:
            return f"{s / div:.2f} {unit}"
    return f"{s * 1e9:.0f} ns"


#: How each cost model's loads read: roofline loads are nanoseconds.
_LOADS = {"flops": lambda n: human(n, "FLOP"), "roofline": lambda n: seconds(n * 1e-9)}


def load(n: float, cost_model: str) -> str:
    """A load in the plan's cost units (FLOPs for flops, time for roofline, else elements)."""
    return _LOADS.get(cost_model, lambda v: human(v, "el"))(n)


def gpus(n: int) -> str:
    """``1 GPU``, ``16 GPUs``."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"
