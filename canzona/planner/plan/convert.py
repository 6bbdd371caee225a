"""Plan files of older schema versions, brought to the current schema on load.

The rule: every change to the plan schema bumps :data:`~canzona.planner.plan.schema.SCHEMA_VERSION`
by one and adds one converter to :data:`UPGRADES`; ``UPGRADES[n]`` turns the data of a version-n
file into version n + 1's. :func:`upgrade` applies them in sequence, from the file's version up
to ``SCHEMA_VERSION``, before the schema validates the data
(:func:`canzona.planner.plan.load.parse_plan`). A converter that needs more than the file says
(the default hardware profile, say) records that in the plan, as ``comm.converted_from`` does.

The chain:

* 1 → 2: buckets gain their collective ``method`` and the plan its ``comm`` section, chosen with
  the default hardware profile's communication model; ``comm.converted_from = 1`` records the
  conversion, ``inputs.solver.objective`` that the cuts were made for the max load. The file
  becomes version 2.
* 2 → 3 (TP groups share matrices: ``tp.share``, ``tp.indices[d].shared``), 3 → 4 (DP pairs:
  ``dp_shared``), 4 → 5 (TP groups share with a partner DP index's: ``SharedTaskPlan.partner``,
  ``dp_shared`` at tp > 1), 5 → 6 (the optimizer settings' ``ns_coefficients``): each adds only
  fields a plan without that feature does not write, as do 8 → 9 (a pipeline stage:
  ``inputs.stage``; a pipeline's file, ``PipelinePlan``, holds one plan per stage) and 9 → 10
  (FSDP2's storage: a file of its own, ``FSDP2Plan``, read by ``load``), and 7 → 8
  (the compact file of :mod:`~canzona.planner.plan.compact`, decoded when read), so
  a file of the older version already is one of the newer. These converters return the data as it
  is, and the plan keeps the version it was written as: the writer
  (:func:`canzona.planner.plan.build.build_plan`) writes the lowest version that holds a plan, so a
  plan saves byte for byte as it was read.

``plans/old/`` holds one file of every older version; ``plans/regenerate.py --check`` loads them.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import comm as comm_model
from ..errors import PlanFileError
from ..hardware import DEFAULT_HARDWARE, load_hardware
from .comm_section import comm_section
from .messages import REGENERATE, version_error
from .schema import (BASE_VERSION, COMPACT_VERSION, DP_PAIR_VERSION, FSDP2_VERSION,
                     HEADS_VERSION, PIPELINE_VERSION, RECIPE_VERSION, SCHEMA_VERSION,
                     TP_PAIR_VERSION, TP_SHARE_VERSION, BufferPlan)

#: A converter: a version-n file's data (and its name, for errors) → version n + 1's data.
Converter = Callable[[dict, str], dict]


def _v1_to_v2(data: dict, source: str) -> dict:
    """Version 1 → 2: the bucket methods and the ``comm`` section (see the module docstring)."""
    out = dict(data)
    try:
        inputs, layout = dict(out["inputs"]), out["rank_layout"]
        dp, tp = int(layout["dp"]), int(layout["tp"])
        ep = int(inputs.get("ep", 1))
        buffers = [BufferPlan.model_validate({**buf, "buckets": [
            {**b, "method": comm_model.PADDED} for b in buf["buckets"]]}) for buf in out["buffers"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise unreadable(source, 1, f"malformed plan, cannot convert it to version "
                                    f"{SCHEMA_VERSION}: {exc}") from None
    for name, value in (("dp", dp), ("tp", tp), ("ep", ep)):
        if value < 1:
            where = f"inputs.{name}" if name == "ep" else f"rank_layout.{name}"
            raise unreadable(source, 1, f"malformed plan: {where} is {value}, must be ≥ 1")
    hw = load_hardware(DEFAULT_HARDWARE)
    try:  # the comm section from the buckets' slices, which must fit the rank layout
        _, link = comm_model.plan_link(hw, dp, tp)
        slices = comm_model.buffer_slices(buffers, ep)
        methods = [comm_model.choose(s.sizes, grad_bytes=s.grad_bytes,
                                     param_bytes=s.param_bytes, link=link).method
                   for s in slices]
        comm = comm_section(slices, methods, hw, dp=dp, tp=tp, converted_from=1)
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise unreadable(source, 1, f"malformed plan, cannot convert it to version "
                                    f"{SCHEMA_VERSION}: its buckets do not fit rank_layout (dp "
                                    f"{dp}, tp {tp}, ep {ep}): {type(exc).__name__}: {exc}"
                         ) from None
    it = iter(methods)
    out["buffers"] = [{**buf, "buckets": [{**b, "method": next(it)} for b in buf["buckets"]]}
                      for buf in out["buffers"]]
    inputs["solver"] = {**inputs["solver"], "objective": "max-load"}
    out["inputs"] = inputs
    out["comm"] = comm.model_dump(mode="json")
    out["schema_version"] = BASE_VERSION
    return out


def _adds_optional_fields(data: dict, source: str) -> dict:  # noqa: ARG001
    """Versions 2 → 3, 3 → 4, 4 → 5, 5 → 6, 6 → 7, 8 → 9 (a pipeline stage,
    ``inputs.stage``) and 9 → 10 (a plan kind of its own, ``FSDP2Plan``): the newer version
    only adds fields (or files) a plan without its feature does not write; 7 → 8: the newer
    version is an encoding, read by ``compact.decode`` before the chain. The data (and its
    version) stay as they are. A plan of a whole model is one of a pipeline of
    one stage (``load.load_pipeline``)."""
    return data


#: ``UPGRADES[n]``: version n → n + 1, for every n from the oldest version read to the newest.
UPGRADES: dict[int, Converter] = {
    1: _v1_to_v2,
    BASE_VERSION: _adds_optional_fields,  # → TP_SHARE_VERSION
    TP_SHARE_VERSION: _adds_optional_fields,  # → DP_PAIR_VERSION
    DP_PAIR_VERSION: _adds_optional_fields,  # → TP_PAIR_VERSION
    TP_PAIR_VERSION: _adds_optional_fields,  # → RECIPE_VERSION
    RECIPE_VERSION: _adds_optional_fields,  # → HEADS_VERSION
    HEADS_VERSION: _adds_optional_fields,  # → COMPACT_VERSION
    COMPACT_VERSION: _adds_optional_fields,  # → PIPELINE_VERSION
    PIPELINE_VERSION: _adds_optional_fields,  # → FSDP2_VERSION
    FSDP2_VERSION: _adds_optional_fields,  # → SUB_GROUP_VERSION
}
#: The oldest schema version this canzona reads.
OLDEST_VERSION = min(UPGRADES)


def unreadable(source: str, found: object, problem: str, fix: str = REGENERATE) -> PlanFileError:
    """A plan file this canzona cannot read as it is, in one line: ``problem``, the file's schema
    version (``found``), the versions read (:data:`OLDEST_VERSION` to ``SCHEMA_VERSION``) and
    ``fix`` (by default: regenerate it with ``canzona plan``)."""
    return version_error(source, found, problem, fix, oldest=OLDEST_VERSION,
                         newest=SCHEMA_VERSION)


def upgrade(data: dict, source: str) -> dict:
    """``data`` of a file of schema version ``data["schema_version"]`` (from
    :data:`OLDEST_VERSION` to ``SCHEMA_VERSION``, checked by the caller) in the current schema:
    the converters of :data:`UPGRADES` from that version on, in sequence.

    Raises:
        PlanFileError: a converter found the data malformed (one line naming the file's version,
            the versions read and the fix).
    """
    for n in range(data["schema_version"], SCHEMA_VERSION):
        data = UPGRADES[n](data, source)
    return data
