"""Megatron-core's physical layout: TP shards and ZeRO-1 (DistributedOptimizer) buffers.

Rules (re-derived from megatron/core/distributed/param_and_grad_buffer.py and
distributed_data_parallel.py, pipeline size 1, context parallel size 1):

* Column-parallel weights (``linear_qkv``, ``linear_fc1``) keep [out/t, in] per TP rank,
  row-parallel ones (``linear_proj``, ``linear_fc2``) [out, in/t]; norms and the MoE router are
  replicated; the word embedding and output layer keep [Vpad/t, h] with
  Vpad = ceil(V / (128·t))·128·t. Expert weights use the expert-TP size (default: tp).
* One buffer per (param dtype, grad dtype, expert or not); expert buffers exist per EP rank and are
  sharded over the expert-data-parallel group, edp = dp·tp / (ep·etp) — only with ep > 1: at
  ep = 1 Megatron leaves expert weights in the dense buffers (``allreduce`` is
  ``not (is_expert and expert_model_parallel_size > 1)``), where they keep their registration
  place. Checked against megatron-core 0.16.1's own buffers in ``tests/megatron``.
* Parameters enter a buffer in reverse registration order; each start is padded to 64 elements.
  A bucket closes as soon as it holds ``bucket_size`` elements (default max(40M, 1M·dp); a single
  bucket when grad-reduce overlap is off); its end is padded to lcm(dp, 128).
* DP rank r owns the r-th equal chunk of every bucket, cutting parameters wherever it falls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import SizeError
from .inventory import ModelSpec, ParamSpec
from .models import ModelConfig
from .settings import PARAM_ALIGN, expert_place  # there: the plan schema reads them without layout

#: Megatron's make_vocab_size_divisible_by default.
VOCAB_DIVISOR = 128


def default_bucket_size(dp: int) -> int:
    """Megatron's default ``bucket_size``: max(40M, 1M·dp) elements."""
    return max(40_000_000, 1_000_000 * dp)


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary padded to a multiple of 128·tp (Megatron's ``_vocab_size_with_padding``)."""
    m = VOCAB_DIVISOR * tp
    return -(-vocab // m) * m


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(value: int, valid: Iterable[int]) -> str:
    valid = sorted(set(valid))
    below = [v for v in valid if v < value]
    above = [v for v in valid if v > value]
    near = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return ", ".join(str(v) for v in near) or "none"


@dataclass(frozen=True, slots=True)
class ParallelSizes:
    """Data, tensor, expert and expert-tensor parallel sizes (pipeline and context size 1)."""

    dp: int
    tp: int
    ep: int = 1
    # expert tensor parallel size; None means "same as tp" (Megatron's default)
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: dp·tp / (ep·etp)."""
        return self.world // (self.ep * self.expert_tp)

    def expert_place(self, ep_rank: int, r: int) -> tuple[int, int | None]:
        """Where rank ``r`` of EP rank ``ep_rank``'s expert-data-parallel group sits
        (:func:`expert_place`)."""
        return expert_place(r, ep_rank, ep=self.ep, tp=self.tp, etp=self.expert_tp)


def validate_sizes(cfg: ModelConfig, sizes: ParallelSizes) -> None:
    """Check the sizes against the model and Megatron's divisibility rules.

    Raises:
        SizeError: one line per violation, naming the constraint and the nearest valid sizes.
    """
    _check_positive(sizes)
    problems: list[str] = []

    tp = sizes.tp
    tp_limits = [("attention heads", cfg.q_heads), ("KV groups", cfg.kv_heads)]
    if cfg.ffn:
        tp_limits.append(("ffn size", cfg.ffn))
    valid_tp = _divisors(math.gcd(*[n for _, n in tp_limits]))
    failed = [f"{what} ({n})" for what, n in tp_limits if n % tp]
    if failed:
        listed = failed[0] if len(failed) == 1 else ", ".join(failed[:-1]) + " and " + failed[-1]
        problems.append(f"tp={tp} must divide the {listed} of {cfg.name}; "
                        f"nearest valid tp: {_nearest(tp, valid_tp)}.")
    if cfg.is_moe:
        etp = sizes.expert_tp
        ep_failed = []  # one sentence and one list of nearest sizes for every ep constraint
        if cfg.num_experts % sizes.ep:
            ep_failed.append(f"ep={sizes.ep} must divide the number of experts of {cfg.name} "
                             f"({cfg.num_experts})")
        if sizes.world % (sizes.ep * etp):
            subject = f"ep={sizes.ep}" if etp == 1 else f"ep·etp={sizes.ep * etp}"
            if ep_failed and etp == 1:
                subject = ""
            ep_failed.append(f"{subject + ' must divide ' if subject else ''}the world size "
                             f"dp·tp={sizes.world}")
        if ep_failed:
            valid_ep = [d for d in _divisors(cfg.num_experts) if sizes.world % (d * etp) == 0]
            problems.append(f"{' and '.join(ep_failed)}; "
                            f"nearest valid ep: {_nearest(sizes.ep, valid_ep)}.")
        if etp not in (1, tp):
            problems.append(f"expert tp={etp} must be 1 or tp={tp} (set {{ParallelSizes.etp}} "
                            "to 1 or leave it out): an expert matrix is either whole on each GPU "
                            "or split like the dense ones.")
        elif cfg.moe_ffn % etp:
            problems.append(f"expert tp={etp} must divide the expert ffn size of {cfg.name} "
                            f"({cfg.moe_ffn}); nearest valid: "
                            f"{_nearest(etp, _divisors(cfg.moe_ffn))}.")
    elif sizes.ep != 1:
        problems.append(f"ep={sizes.ep} needs a mixture-of-experts model; {cfg.name} is dense "
                        "(set {ParallelSizes.ep} to 1).")
    elif sizes.etp not in (None, tp):
        problems.append(f"expert tp={sizes.etp} needs a mixture-of-experts model; {cfg.name} is "
                        "dense (leave {ParallelSizes.etp} out).")
    if problems:
        raise SizeError(" ".join(problems), fields=("ParallelSizes.ep", "ParallelSizes.etp"))


def _check_positive(sizes: ParallelSizes) -> None:
    """Every size a positive integer (one error naming each field that is not)."""
    bad = [(f"ParallelSizes.{f}", getattr(sizes, f)) for f in ("dp", "tp", "ep", "etp")
           if getattr(sizes, f) is not None or f != "etp"]
    bad = [(f, v) for f, v in bad
           if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise SizeError(" ".join(f"{{{f}}} must be a positive integer, got {v!r}." for f, v in bad),
                        fields=tuple(f for f, _ in bad))


def _validate_configless(spec: ModelSpec, sizes: ParallelSizes) -> None:
    """Sizes for an inventory without a model config (a live module, DTensor TP included): ep > 1
    only with per-expert weights marked by their expert index, ep dividing their number and the
    world, and expert TP = TP; tp > 1 only with plain column/row splits (fused layouts need the
    config), each split dim divisible by tp."""
    _check_positive(sizes)
    if (sizes.etp or sizes.tp) != sizes.tp and sizes.etp != 1:
        raise SizeError(f"{spec.name} has no model config (read from a live module), so its "
                        f"experts are planned with expert tp = tp; got etp={sizes.etp}.",
                        fields=("ParallelSizes.etp",))
    experts = spec.num_experts
    if sizes.ep != 1:
        if not experts:
            raise SizeError(f"ep={sizes.ep} needs per-expert weights (names with "
                            f"'.experts.<index>.'); {spec.name} has none (set "
                            "{ParallelSizes.ep} to 1).", fields=("ParallelSizes.ep",))
        if experts % sizes.ep or sizes.world % sizes.ep:
            valid = [d for d in _divisors(experts) if sizes.world % d == 0]
            raise SizeError(f"ep={sizes.ep} must divide the number of experts of {spec.name} "
                            f"({experts}) and the world size dp·tp={sizes.world}; nearest valid "
                            f"ep: {_nearest(sizes.ep, valid)}.", fields=("ParallelSizes.ep",))
    if sizes.tp == 1:
        return
    problems = []
    for p in spec.params:
        if p.tp_layout in ("qkv", "gate_up", "vocab"):
            problems.append(f"'{p.name}' has the fused layout '{p.tp_layout}', which needs a "
                            "model config")
        elif p.tp_layout in ("column", "row"):
            dim = 0 if p.tp_layout == "column" else 1
            if len(p.shape) <= dim or p.shape[dim] % sizes.tp:
                problems.append(f"'{p.name}' ({p.tp_layout}-parallel, shape {list(p.shape)}) "
                                f"does not split evenly over tp={sizes.tp}")
    if problems:
        raise SizeError(f"{spec.name} (no model config) cannot be planned at tp={sizes.tp}: "
                        + "; ".join(problems[:3]) + ("; …" if len(problems) > 3 else "") + ".")


def local_shape(p: ParamSpec, sizes: ParallelSizes) -> tuple[int, ...]:
    """Shape of ``p``'s shard on one TP rank (every rank's shard has the same shape)."""
    t = sizes.expert_tp if p.is_expert else sizes.tp
    if p.tp_layout == "replicated":
        return p.shape
    if p.tp_layout == "vocab":
        return (padded_vocab(p.shape[0], t) // t, *p.shape[1:])
    if p.tp_layout == "row":
        return (p.shape[0], p.shape[1] // t)
    return (p.shape[0] // t, *p.shape[1:])  # column, qkv, gate_up


@dataclass(frozen=True, slots=True)
class Slot:
    """A parameter's place in a buffer: [start, end) in elements, local (TP-shard) shape."""

    name: str
    start: int
    end: int
    local_shape: tuple[int, ...]
    optimizer: str

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Bucket:
    """A contiguous, reduce-scattered-as-one range of a buffer."""

    index: int
    start: int
    end: int  # padded end
    numel_unpadded: int
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    def chunk(self, r: int, dp: int) -> tuple[int, int]:
        """ZeRO-1's equal chunk of DP rank ``r``: [start + r·S/dp, start + (r+1)·S/dp)."""
        size = self.numel // dp
        return self.start + r * size, self.start + (r + 1) * size


@dataclass(frozen=True, slots=True)
class Buffer:
    """One Megatron ``_ParamAndGradBuffer``."""

    dtype: str
    grad_dtype: str
    expert: bool
    ep_rank: int | None  # which EP rank's experts (expert buffers only)
    dp_size: int  # size of the group the buffer is sharded over (dp, or edp for experts)
    buckets: tuple[Bucket, ...]

    @property
    def key(self) -> str:
        tag = f"expert ep{self.ep_rank}" if self.expert else "dense"
        return f"{tag} {self.dtype}/{self.grad_dtype}"

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0


def build_buffer(
    params: list[ParamSpec],
    sizes: ParallelSizes,
    *,
    dp_size: int,
    bucket_size: int | None,
    grad_dtype: str,
    expert: bool,
    ep_rank: int | None = None,
) -> Buffer:
    """Lay ``params`` (registration order) out as Megatron does: reversed, 64-aligned starts,
    buckets closed at ``bucket_size`` elements, ends padded to lcm(dp_size, 128)."""
    divisor = math.lcm(dp_size, 128)

    def pad(x: int, d: int) -> int:
        return -(-x // d) * d

    buckets: list[Bucket] = []
    slots: list[Slot] = []
    bucket_start = 0
    start = 0
    end = 0

    def close(param_end: int) -> int:
        nonlocal bucket_start, slots
        bucket_end = pad(param_end, divisor)
        buckets.append(Bucket(len(buckets), bucket_start, bucket_end, param_end - bucket_start,
                              tuple(slots)))
        bucket_start, slots = bucket_end, []
        return bucket_end

    for p in reversed(params):
        shape = local_shape(p, sizes)
        n = math.prod(shape)
        start = pad(start, PARAM_ALIGN)
        end = start + n
        slots.append(Slot(p.name, start, end, shape, p.optimizer))
        if bucket_size is not None and end - bucket_start >= bucket_size:
            start = close(end)
        else:
            start = end
    if slots:
        close(end)
    return Buffer(params[0].dtype if params else "bf16", grad_dtype, expert, ep_rank, dp_size,
                  tuple(buckets))


@dataclass(frozen=True, slots=True)
class PhysicalLayout:
    """Every buffer of one TP rank (all TP ranks have the same shapes)."""

    model: str
    sizes: ParallelSizes
    bucket_size: int | None
    buffers: tuple[Buffer, ...]

    def split_matrices(self) -> list[tuple[str, int]]:
        """Matrix-optimizer parameters that ZeRO-1's equal chunks cut across DP ranks.

        Returns (name, number of DP ranks holding a piece of it), in buffer order; expert buffers
        count once per EP rank, since each EP rank holds different experts.
        """
        out = []
        for buf in self.buffers:
            for b in buf.buckets:
                size = b.numel // buf.dp_size
                for s in b.slots:
                    if s.optimizer != "matrix":
                        continue
                    first = (s.start - b.start) // size
                    last = (s.end - 1 - b.start) // size
                    if last > first:
                        out.append((s.name, last - first + 1))
        return out

    def matrix_count(self) -> int:
        return sum(1 for buf in self.buffers for b in buf.buckets for s in b.slots
                   if s.optimizer == "matrix")


def build_layout(
    spec: ModelSpec,
    sizes: ParallelSizes,
    *,
    bucket_size: int | None = None,
    overlap_grad_reduce: bool = True,
    grad_dtype: str = "fp32",
) -> PhysicalLayout:
    """Emulate Megatron's buffers for ``spec`` at ``sizes``.

    Args:
        bucket_size: elements per bucket; None means Megatron's default max(40M, 1M·dp).
        overlap_grad_reduce: False gives one bucket per buffer (Megatron without overlap).
        grad_dtype: main-grad dtype (Megatron accumulates in fp32 by default).

    Raises:
        SizeError: sizes that the model does not allow, or a non-positive bucket size.
    """
    if spec.config is not None:
        validate_sizes(spec.config, sizes)
    else:
        _validate_configless(spec, sizes)
    if bucket_size is not None and bucket_size < 1:
        raise SizeError(f"{{DPOptions.bucket_size}} must be a positive number of elements, got "
                        f"{bucket_size}.", fields=("DPOptions.bucket_size",))
    size = (bucket_size or default_bucket_size(sizes.dp)) if overlap_grad_reduce else None
    dense: dict[str, list[ParamSpec]] = {}
    experts: dict[str, list[ParamSpec]] = {}
    for p in spec.params:
        # Megatron marks an expert weight ``allreduce = not (is_expert and ep > 1)`` and DDP puts
        # the ``allreduce`` ones in the dense buffers: at ep = 1 experts share the dense buffer,
        # in registration order, sharded over the DP group.
        (experts if p.is_expert and sizes.ep > 1 else dense).setdefault(p.dtype, []).append(p)
    buffers = [build_buffer(ps, sizes, dp_size=sizes.dp, bucket_size=size, grad_dtype=grad_dtype,
                            expert=False) for _, ps in sorted(dense.items())]
    if experts:
        per_rank = spec.num_experts // sizes.ep
        for dtype, ps in sorted(experts.items()):
            for k in range(sizes.ep):
                mine = [p for p in ps if k * per_rank <= p.expert < (k + 1) * per_rank]
                buffers.append(build_buffer(mine, sizes, dp_size=sizes.edp, bucket_size=size,
                                            grad_dtype=grad_dtype, expert=True, ep_rank=k))
    return PhysicalLayout(spec.name, sizes, size, tuple(buffers))
