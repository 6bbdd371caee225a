"""Hardware profiles: a GPU (or this CPU) and its links, as versioned data.

A profile is a JSON file (the built-in ones live in ``canzona/planner/hardware/``): peak FLOP/s
per dtype and the achieved fraction, memory, and two links — NVLink inside a node and InfiniBand
across nodes — each an achieved NCCL bus bandwidth and a per-call latency α.
``version`` is the revision of a profile's numbers; a plan records the name, the version and
the link figures it was made with (``Plan.comm``), so a later change of the numbers never
changes what an old plan says it predicted.

A leaf module: the cost model, the communication model (:mod:`canzona.planner.comm`) and the
plan loader's converter read it; it imports only the errors.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import CanzonaError

#: The profile a plan is made with unless told otherwise (also what old plans are converted with).
DEFAULT_HARDWARE = "h100"


class LinkProfile(BaseModel):
    """One kind of link: what a collective achieves over it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    busbw: float = Field(gt=0, description="achieved NCCL bus bandwidth, bytes/s")
    latency_s: float = Field(ge=0, description="per-collective latency α, seconds")

    def seconds(self, nbytes: float, calls: int = 1) -> float:
        """The α–β time of ``calls`` collectives that move ``nbytes`` through the busiest rank:
        ``calls · α + nbytes / busbw``; 0 for no calls."""
        if calls == 0:
            return 0.0
        return calls * self.latency_s + nbytes / self.busbw


class HardwareProfile(BaseModel):
    """A GPU (or this CPU) and its links, as data (``canzona/planner/hardware/*.json``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: int = Field(default=1, ge=1, description="revision of the profile's numbers")
    description: str
    gpus_per_node: int = Field(gt=0)
    peak_flops: dict[str, float]
    compute_efficiency: float = Field(gt=0, le=1)
    memory_bytes: float = Field(gt=0)
    memory_bandwidth: float = Field(gt=0)
    intra_node: LinkProfile
    inter_node: LinkProfile
    calibration: dict[str, float] = Field(
        default_factory=dict, description="further measurements of `canzona calibrate` "
                                          "(kernel rates and times by shape, link timings)")

    def seconds(self, flops: float, dtype: str = "bf16") -> float:
        """Compute time of ``flops`` at the achieved rate."""
        return flops / (self.peak_flops[dtype] * self.compute_efficiency)

    def link(self, ranks_spanned: int) -> LinkProfile:
        """The link a collective over a group uses: NVLink when the global ranks it spans
        (its size × its stride) fit in one node, else InfiniBand (a ring is as slow as its
        slowest hop)."""
        return self.intra_node if ranks_spanned <= self.gpus_per_node else self.inter_node


def hardware_names() -> list[str]:
    """The built-in profiles' names."""
    return list(_names())


@lru_cache(maxsize=1)
def _names() -> tuple[str, ...]:
    files = resources.files("canzona.planner").joinpath("hardware")
    return tuple(sorted(f.name.removesuffix(".json") for f in files.iterdir()
                        if f.name.endswith(".json")))


@lru_cache(maxsize=None)
def _builtin(name: str) -> HardwareProfile:
    """A built-in profile, read once (profiles are frozen; the planner asks for one often)."""
    data = resources.files("canzona.planner").joinpath("hardware").joinpath(
        f"{name}.json").read_text()
    return HardwareProfile.model_validate(json.loads(data))


def load_hardware(name: str | Path) -> HardwareProfile:
    """A built-in profile by name (:func:`hardware_names`: ``cpu``, ``h100``, ``h800``) or a
    profile file's path (what ``canzona calibrate`` writes).

    Raises:
        CanzonaError: unknown name, unreadable file, or a file that is not a valid profile.
    """
    text = str(name)
    if isinstance(name, Path) or text.endswith(".json") or "/" in text:
        path = Path(text)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CanzonaError(f"cannot read hardware profile '{path}': "
                               f"{exc.strerror or exc}.") from None
        except json.JSONDecodeError as exc:
            raise CanzonaError(f"hardware profile '{path}' is not JSON: {exc.msg} "
                               f"(line {exc.lineno}).") from None
        except (UnicodeDecodeError, RecursionError) as exc:
            what = "nested too deeply" if isinstance(exc, RecursionError) else "not UTF-8 text"
            raise CanzonaError(f"hardware profile '{path}' is not a profile: {what}.") from None
        try:
            return HardwareProfile.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise CanzonaError(f"hardware profile '{path}' is not valid: {where}: "
                               f"{first['msg']}.") from None
    names = hardware_names()
    if text.lower() not in names:
        raise CanzonaError(f"unknown hardware profile '{text}'; choose one of: {', '.join(names)}, "
                           f"or give a profile file (.json).")
    return _builtin(text.lower())
