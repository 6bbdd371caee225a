"""QK-clip (MuonClip, Kimi K2): after the optimizer step, the query and key weights of every
attention head group whose largest logit exceeds a threshold τ are scaled down, so that its
logits come back under τ.

For KV group g of a layer (GQA: the query heads sharing one key head), with m_g the largest
attention logit of its query heads over the global batch, η_g = min(1, τ / m_g); its query heads'
rows are scaled by η_g^α and its key head's rows by η_g^(1−α), so every logit of the group
scales by η_g (Megatron-core's ``SelfAttention.clip_qk``; per head under multi-head attention,
as in Kimi K2). Under canzona the step is not single-device:

* each rank's logits are of its own batch: they are reduced with MAX over the data-parallel
  group (and any extra group, such as context parallelism) before anything is scaled;
* each TP rank holds its own heads' rows (a shard of Megatron's fused QKV, grouped per KV group,
  or of column-parallel q and k projections) and scales those;
* with fp32 main copies the main copy is the weight: each rank scales its own slice of it, and
  the parameters are gathered from the main copies again, so every replica holds the same bits
  (rows of a matrix several ranks share are wherever the buckets put them: the scaling follows
  the elements, not the tasks).

:func:`attention_heads` finds the attention layers of a Megatron-core model or of a module with
``q_proj``/``k_proj`` projections and a ``head_dim``; :class:`AttentionHeads` describes one by
hand. :func:`max_logits` computes a layer's per-head largest logit from its queries and keys, and
:func:`record_max_logits` records it from Megatron-core's local ``DotProductAttention`` with
forward hooks (Megatron-core records it only from Transformer Engine's kernels).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["AttentionHeads", "LogitRecorder", "attention_heads", "max_logits",
           "record_max_logits"]


@dataclass(frozen=True, slots=True)
class AttentionHeads:
    """One attention layer as QK-clip sees it.

    Attributes:
        name: the layer's key in ``max_logits`` (its module's name).
        weight: the parameter holding the query rows: Megatron's fused QKV (grouped per KV
            group, ``[q heads of g; k_g; v_g]``) when ``key`` is None, else the q projection.
        key: the k projection's parameter, or None (fused).
        q_heads, kv_heads: the layer's query and KV heads (all TP ranks together).
        head_dim: rows per head.
    """

    name: str
    weight: str
    key: str | None
    q_heads: int
    kv_heads: int
    head_dim: int


def attention_heads(model: nn.Module) -> list[AttentionHeads]:
    """The attention layers of ``model``, in module order: Megatron-core ``SelfAttention``
    modules (``linear_qkv``, read from their config) and modules with ``q_proj`` and ``k_proj``
    linear layers and a ``head_dim`` (Hugging Face attention, the examples' blocks)."""
    out = []
    for name, m in model.named_modules():
        pre = f"{name}." if name else ""
        cfg = getattr(m, "config", None)
        if hasattr(m, "linear_qkv") and cfg is not None and hasattr(cfg, "num_attention_heads"):
            heads = int(cfg.num_attention_heads)
            groups = int(getattr(cfg, "num_query_groups", None) or heads)
            hd = int(getattr(cfg, "kv_channels", None) or cfg.hidden_size // heads)
            out.append(AttentionHeads(name, f"{pre}linear_qkv.weight", None, heads, groups, hd))
        elif (isinstance(getattr(m, "q_proj", None), nn.Linear)
              and isinstance(getattr(m, "k_proj", None), nn.Linear)
              and getattr(m, "head_dim", None)):
            hd = int(m.head_dim)
            out.append(AttentionHeads(name, f"{pre}q_proj.weight", f"{pre}k_proj.weight",
                                      m.q_proj.out_features // hd, m.k_proj.out_features // hd,
                                      hd))
    return out


@torch.no_grad()
def max_logits(q: Tensor, k: Tensor, *, scale: float | None = None, causal: bool = False,
               mask: Tensor | None = None) -> Tensor:
    """The largest attention logit of each query head, over the batch and every (query, key)
    pair attended to: ``q`` ``[batch, heads, sq, d]``, ``k`` ``[batch, kv_heads, sk, d]`` (as
    ``scaled_dot_product_attention`` takes them; kv_heads divides heads), logits ``scale·q·kᵀ``
    (default 1/√d). ``causal``: a query attends to keys at or before its position; ``mask``:
    boolean, True where a pair is masked out (broadcast to ``[batch, heads, sq, sk]``).
    Returns ``[heads]`` in float32 (an extra product of the queries and keys: what a fused
    attention kernel computes anyway)."""
    b, h, sq, d = q.shape
    g = k.shape[1]
    if h % g:
        raise ValueError(f"{g} key heads do not divide {h} query heads")
    kk = k.repeat_interleave(h // g, dim=1) if g != h else k
    s = torch.matmul(q.float(), kk.float().transpose(-1, -2)) * (scale or 1 / math.sqrt(d))
    if causal:
        sk = kk.shape[2]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device)
                          .triu(sk - sq + 1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return s.amax(dim=(0, 2, 3))


class LogitRecorder:
    """The largest logit per query head of every recorded layer since the last :meth:`pop`
    (the maximum over the micro-batches in between); built by :func:`record_max_logits`."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}
        self._hooks: list[Any] = []

    def add(self, name: str, logits: Tensor) -> None:
        """Fold ``logits`` (``[heads]``) into layer ``name``'s maximum."""
        old = self.values.get(name)
        self.values[name] = logits if old is None else torch.maximum(old, logits)

    def pop(self) -> dict[str, Tensor]:
        """The maxima recorded, and start afresh (call once per optimizer step)."""
        out, self.values = self.values, {}
        return out

    def remove(self) -> None:
        """Remove the forward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def record_max_logits(model: nn.Module) -> LogitRecorder:
    """Record each attention layer's largest logit per local query head, under the layer's
    module name: forward pre-hooks on the ``core_attention`` of every Megatron-core
    ``SelfAttention`` (the local ``DotProductAttention``: queries ``[sq, b, np, hn]``, keys
    ``[sk, b, ng, hn]``, a boolean mask, ``softmax_scale``); for a ``transformers`` model, an
    attention function registered with its ``AttentionInterface`` that records them and calls
    the model's own (``sdpa`` in place of ``eager``, whose function is the model's); ``remove``
    restores it."""
    if hasattr(model, "set_attn_implementation") and hasattr(model, "config"):
        return _record_hf(model)
    rec = LogitRecorder()
    for layer in attention_heads(model):
        attn = model.get_submodule(layer.name)
        core = getattr(attn, "core_attention", None)
        if core is None:
            continue

        def hook(module: nn.Module, args: tuple, kwargs: dict, name: str = layer.name) -> None:
            q, k = args[0], args[1]
            mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
            rec.add(name, max_logits(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                     scale=getattr(module, "softmax_scale", None),
                                     mask=mask if isinstance(mask, Tensor) else None))

        rec._hooks.append(core.register_forward_pre_hook(hook, with_kwargs=True))
    return rec


def _record_hf(model: nn.Module) -> LogitRecorder:
    """:func:`record_max_logits` for a ``transformers`` model."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rec = LogitRecorder()
    base = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS.get(base) or sdpa_attention_forward
    names = {id(m): n for n, m in model.named_modules()}

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, **kwargs: Any) -> Any:
        mask = None
        causal = attention_mask is None and bool(getattr(module, "is_causal", True)) \
            and query.shape[2] > 1
        if attention_mask is not None:
            m = attention_mask[..., :key.shape[2]]
            mask = ~m if m.dtype == torch.bool else m == float("-inf")
        rec.add(names[id(module)], max_logits(query, key, scale=kwargs.get("scaling"),
                                              causal=causal, mask=mask))
        return inner(module, query, key, value, attention_mask, **kwargs)

    name = f"canzona_max_logits_{id(rec)}"
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)

    class _Restore:
        def remove(self) -> None:
            model.set_attn_implementation(base)

    rec._hooks.append(_Restore())
    return rec


def _row_factors(layer: AttentionHeads, eta: Tensor, alpha: float, tp: int
                 ) -> dict[str, Tensor]:
    """Per parameter of ``layer`` (this TP rank's shard), the factor of each of its rows: η_g^α
    on group g's query rows, η_g^(1−α) on its key rows, 1 elsewhere."""
    groups = layer.kv_heads // tp
    per = layer.q_heads // layer.kv_heads
    hd = layer.head_dim
    qf = eta.pow(alpha).repeat_interleave(per * hd)
    kf = eta.pow(1 - alpha).repeat_interleave(hd)
    if layer.key is not None:
        return {layer.weight: qf, layer.key: kf}
    block = (per + 2) * hd  # one KV group's rows of the fused QKV
    f = torch.ones(groups, block, dtype=eta.dtype)
    f[:, :per * hd] = qf.view(groups, per * hd)
    f[:, per * hd:(per + 1) * hd] = kf.view(groups, hd)
    return {layer.weight: f.reshape(-1)}


@torch.no_grad()
def clip(opt: Any, logits: Mapping[str, Tensor], *, threshold: float, alpha: float,
         groups: Sequence[Any], attention: Iterable[AttentionHeads] | None) -> float:
    """``CanzonaOptimizer.qk_clip_`` (see there)."""
    if not threshold > 0 or not 0 <= alpha <= 1:
        raise ValueError(f"qk_clip_: threshold must be > 0 and alpha in [0, 1], got "
                         f"threshold={threshold!r}, alpha={alpha!r}")
    layers = list(attention) if attention is not None else list(opt._attention())
    index = {n: i for i, n in enumerate(opt._names)}
    tp = opt._tp
    _check(layers, logits, index, opt._params, tp)
    sizes = [x.q_heads // tp for x in layers]
    packed = torch.cat([logits[x.name].detach().reshape(-1).float().cpu() for x in layers])
    device = opt._params[0].device
    packed = packed.to(device)
    if opt._dp > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=opt._storage.group)
    for g in groups:
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=g)
    packed = packed.cpu()
    factors: dict[int, Tensor] = {}
    for x, m in zip(layers, torch.split(packed, sizes)):
        group_max = m.view(x.kv_heads // tp, -1).amax(dim=1)
        eta = torch.clamp(threshold / group_max, max=1.0)
        if bool((eta < 1).any()):
            for name, f in _row_factors(x, eta, alpha, tp).items():
                factors[index[name]] = f
    if factors:
        _scale(opt, factors)
    return float(packed.max()) if packed.numel() else 0.0


def _check(layers: list[AttentionHeads], logits: Mapping[str, Tensor], index: Mapping[str, int],
           params: Sequence[Tensor], tp: int) -> None:
    """One line per refusal, before any collective."""
    if not layers:
        raise ValueError("qk_clip_: no attention layer known; pass attention=[AttentionHeads(...)]"
                         " (canzona.runtime.qk_clip) for a model canzona cannot read them from.")
    names = [x.name for x in layers]
    unknown = sorted(set(logits) - set(names))
    if unknown:
        more = " …" if len(names) > 4 else ""
        raise ValueError(f"qk_clip_: max_logits names {unknown[:3]}, not attention layers of this "
                         f"model; its layers: {', '.join(names[:4])}{more}")
    missing = [n for n in names if n not in logits]
    if missing:
        raise ValueError(f"qk_clip_: max_logits lacks {len(missing)} attention layer(s) "
                         f"({', '.join(missing[:3])}); give every layer's maxima, every step.")
    for x in layers:
        for p in (x.weight, x.key):
            if p is not None and p not in index:
                raise ValueError(f"qk_clip_: layer '{x.name}' names parameter '{p}', which this "
                                 "optimizer does not hold.")
        if x.q_heads % x.kv_heads or x.kv_heads % tp:
            raise ValueError(f"qk_clip_: layer '{x.name}': {x.kv_heads} KV heads must divide "
                             f"{x.q_heads} query heads and split over tp = {tp}.")
        t = logits[x.name]
        want = x.q_heads // tp
        if not isinstance(t, Tensor) or t.numel() != want or t.dim() > 1:
            got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"qk_clip_: max_logits['{x.name}'] is {got} but this rank holds "
                             f"{want} query heads of it (tp = {tp}): give [{want}].")
        rows = x.q_heads // tp * x.head_dim + (0 if x.key else 2 * x.kv_heads // tp * x.head_dim)
        w = params[index[x.weight]]
        if w.dim() != 2 or w.shape[0] != rows:
            raise ValueError(f"qk_clip_: '{x.weight}' holds {list(w.shape)} on this rank, not the "
                             f"{rows} rows of {x.q_heads // tp} query heads of {x.head_dim} "
                             f"(tp = {tp}); check AttentionHeads.")


def _scale(opt: Any, factors: Mapping[int, Tensor]) -> None:
    """Scale rows of parameters (index → factor per local row): every rank its local copy, or
    with main copies each rank its own slice of them, then the parameters gathered again."""
    opt.wait_params()
    s, storage = opt._schedule, opt._storage
    gather = []
    for bi, buf in enumerate(storage.buffers):
        slots = [sl for sl in s.buckets[bi].slots if sl.param in factors]
        if not slots:
            continue
        if buf.main is None:  # the parameters are the weights, the same on every replica
            for sl in slots:
                p = opt._params[sl.param]
                f = factors[sl.param].to(p.device, torch.float32)
                p.view(f.numel(), -1).mul_(f.view(-1, 1).to(p.dtype))
            continue
        lo, hi = buf.own_lo, buf.own_hi
        for sl in slots:
            a, z = max(lo, sl.lo), min(hi, sl.hi)
            if a >= z:
                continue
            f = factors[sl.param].to(buf.main.device, torch.float32)
            cols = (sl.hi - sl.lo) // f.numel()
            rows = torch.arange(a - sl.lo, z - sl.lo, device=f.device) // cols
            buf.main[a - lo:z - lo].mul_(f[rows])
            buf.params[a:z].copy_(buf.main[a - lo:z - lo])
        gather.append(bi)
    for bi in gather:
        storage.gather(bi)
    storage.wait_gathers()
