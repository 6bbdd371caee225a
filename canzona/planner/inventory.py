"""Parameter inventory: every weight of a model, with the attributes the planner needs.

The inventory follows Megatron-core's module structure and registration order (the order
``model.parameters()`` yields, which the ZeRO-1 buffer reverses), with the non-Transformer-Engine
("local") layer spec names:

    embedding.word_embeddings.weight
    decoder.layers.{i}.input_layernorm.weight
    decoder.layers.{i}.self_attention.linear_proj.weight      (Attention.__init__ builds it first)
    decoder.layers.{i}.self_attention.linear_qkv.weight       (SelfAttention.__init__, fused Q/K/V)
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight  (Qwen3 QK-norm)
    decoder.layers.{i}.pre_mlp_layernorm.weight
    decoder.layers.{i}.mlp.linear_fc1.weight                  (fused gate/up, TP stride 2)
    decoder.layers.{i}.mlp.linear_fc2.weight
      or, for MoE layers: mlp.router.weight, mlp.experts.local_experts.{e}.linear_fc{1,2}.weight
      (SequentialMLP: expert by expert; e is the global expert index)
      or, named ``megatron-grouped``: mlp.router.weight, mlp.experts.linear_fc1.weight{e} for
      every e, then mlp.experts.linear_fc2.weight{e} (TEGroupedMLP: one TE GroupedLinear per
      projection, each registering one 2-D weight per expert)
    decoder.final_layernorm.weight
    output_layer.weight                                       (absent when embeddings are tied)

Shapes are logical (unsharded, unpadded): the physical layout module derives the TP shards.
Each parameter also records the Hugging Face names it covers, so a live HF model can be matched.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Literal

from .errors import ModelError
from .models import ModelConfig, check_config

if TYPE_CHECKING:
    import networkx as nx

#: The part name of expert e's matrix in a 3-D tensor of stacked experts: ``expert{e}``.
EXPERT_PART = "expert"

Kind = Literal["matrix", "expert", "vector", "embedding", "output", "router"]
OptimizerRoute = Literal["matrix", "adamw"]
TPLayout = Literal["replicated", "column", "row", "qkv", "gate_up", "vocab"]


#: A decoder layer's number in a parameter name (``decoder.layers.3.…``, ``model.layers.3.…``,
#: ``layers.3.…``): the one rule by which a live module's parameters are placed in layers,
#: stages and checkpoint keys.
LAYER_NAME = re.compile(r"(^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer number ``name`` carries (its first ``layers.N.``), or None."""
    m = LAYER_NAME.search(name)
    return int(m[2]) if m is not None else None


@dataclass(frozen=True, slots=True)
class Part:
    """A logical sub-matrix of a fused parameter (Q, K, V of ``linear_qkv``; gate, up of
    ``fc1``)."""

    name: str
    rows: int


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of the model, logical (unsharded) view.

    Attributes:
        name: Megatron-core parameter name.
        shape: logical shape (vocabulary unpadded).
        dtype: parameter dtype ("bf16", "fp16", "fp32").
        kind: matrix / expert (a 2-D weight of an MoE expert) / vector / embedding / output /
            router.
        layer: transformer layer index, None outside the decoder layers.
        expert: global expert index for expert weights.
        tp_layout: how tensor parallelism splits it (``replicated``, ``column`` [dim 0], ``row``
            [dim 1], ``qkv`` [dim 0, per KV group], ``gate_up`` [dim 0, stride 2], ``vocab``
            [dim 0, padded vocabulary]).
        parts: sub-matrices of a fused weight, in logical (Hugging Face) order.
        hf_names: the Hugging Face parameter names this weight holds (one per part when fused).
        optimizer: "matrix" (Muon/Shampoo/SOAP) or "adamw", by Megatron's rule unless overridden.
        head_rows: rows per attention head of a weight whose rows are attention heads (the fused
            QKV, or a q, k or v projection), 0 otherwise: what ``qkv_split="heads"`` cuts.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: Kind
    layer: int | None
    expert: int | None
    tp_layout: TPLayout
    parts: tuple[Part, ...] = ()
    hf_names: tuple[str, ...] = ()
    optimizer: OptimizerRoute = "adamw"
    head_rows: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def tp_dim(self) -> int | None:
        """Megatron's ``partition_dim`` (None for replicated parameters)."""
        if self.tp_layout == "replicated":
            return None
        return 1 if self.tp_layout == "row" else 0

    @property
    def tp_stride(self) -> int:
        """Megatron's ``partition_stride`` (2 for the fused gate/up of fc1)."""
        return 2 if self.tp_layout == "gate_up" else 1

    @property
    def is_expert(self) -> bool:
        return self.expert is not None

    @property
    def stacked_experts(self) -> int:
        """E for a 3-D tensor of E expert matrices ([E, m, n], as ``transformers`` stores a MoE
        layer's experts), else 0. The matrix optimizer updates each [m, n] matrix on its own."""
        return _stacked(self.kind, self.shape)


@lru_cache(maxsize=16)
def _fingerprint(params: tuple[ParamSpec, ...]) -> str:
    """:meth:`ModelSpec.fingerprint` of ``params`` (once per inventory: plans and checks ask
    for it often)."""
    rows = [[p.name, list(p.shape), p.dtype, p.tp_layout, p.tp_dim, p.tp_stride] for p in params]
    blob = json.dumps(rows, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True, slots=True)
class Stage:
    """Which pipeline stage an inventory holds (Megatron's layout of ``pp`` stages): decoder
    layers ``first_layer`` to ``first_layer + layers - 1`` under their global numbers, the
    embedding on stage 0, the final norm and the output layer on the last stage (with tied
    embeddings, a copy of the embedding there as ``output_layer.weight``, :attr:`tied_copy`)."""

    pp: int
    stage: int
    first_layer: int
    layers: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's parameters in Megatron registration order, plus its config.

    ``config`` is None for an inventory read from a live module (``canzona.runtime.introspect``):
    such a spec is named by ``label``; TP lays out only its plain column and row splits (the head
    and FFN sizes that fused layouts need are unknown), and EP only its per-expert weights.
    ``stage``: the pipeline stage these parameters are (``canzona.planner.stages``), None for the
    whole model. ``tied``: the output layer's name when it shares the embedding's weight (the
    whole model holds that weight once, as the embedding; a pipeline's last stage holds a copy
    under this name), read from a live module; a config says so itself
    (``ModelConfig.tied_embeddings``).
    """

    config: ModelConfig | None
    params: tuple[ParamSpec, ...]
    label: str | None = None
    stage: Stage | None = None
    tied: str | None = None
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    #: What is computed once per spec (its fingerprint).
    _memo: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for i, p in enumerate(self.params):
            if p.name in self._index:
                raise ModelError(f"duplicate parameter name '{p.name}' in the inventory.")
            self._index[p.name] = i

    @property
    def name(self) -> str:
        if self.config is not None:
            return self.config.name
        return self.label or "module"

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def num_experts(self) -> int:
        """The config's number of experts, or (read from a live module) the number of distinct
        expert indices among the parameters; 0 for a dense model."""
        if self.config is not None:
            return self.config.num_experts
        return len({p.expert for p in self.params if p.is_expert})

    def __getitem__(self, name: str) -> ParamSpec:
        return self.params[self._index[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def fingerprint(self) -> str:
        """sha256 over names, shapes, dtypes and TP attributes, in registration order."""
        got = self._memo.get("fingerprint")
        if got is None:
            try:
                got = _fingerprint(self.params)
            except TypeError:  # a spec built by hand with a list somewhere: not hashable
                got = _fingerprint.__wrapped__(self.params)
            self._memo["fingerprint"] = got
        return got

    def graph(self) -> "nx.DiGraph":
        """The parameter graph.

        Nodes: every parameter (attributes: shape, kind, layer, expert, tp_layout, optimizer,
        numel), one node per layer (``layer:i``), per expert (``layer:i/expert:e``) and per part
        of a fused weight (``<name>#<part>``). Edges carry ``rel``: ``next`` (layer i → i+1),
        ``member`` (layer or expert → its parameters, layer → expert), ``part`` (fused weight →
        its parts).
        """
        import networkx as nx  # imported here: planning itself does not need the graph

        g = nx.DiGraph(model=self.name)
        layers = sorted({p.layer for p in self.params if p.layer is not None})
        for i in layers:
            g.add_node(f"layer:{i}", type="layer", layer=i)
        for a, b in zip(layers, layers[1:]):
            g.add_edge(f"layer:{a}", f"layer:{b}", rel="next")
        for p in self.params:
            g.add_node(p.name, type="param", shape=p.shape, kind=p.kind, layer=p.layer,
                       expert=p.expert, tp_layout=p.tp_layout, optimizer=p.optimizer, numel=p.numel)
            owner = None
            if p.layer is not None:
                owner = f"layer:{p.layer}"
                if p.expert is not None:
                    ex = f"{owner}/expert:{p.expert}"
                    if ex not in g:
                        g.add_node(ex, type="expert", layer=p.layer, expert=p.expert)
                        g.add_edge(owner, ex, rel="member")
                    owner = ex
                g.add_edge(owner, p.name, rel="member")
            for part in p.parts:
                node = f"{p.name}#{part.name}"
                g.add_node(node, type="part", rows=part.rows, cols=p.shape[1])
                g.add_edge(p.name, node, rel="part")
        return g


def _hf_prefix(cfg: ModelConfig) -> str:
    return "model"


def build_inventory(
    cfg: ModelConfig,
    *,
    matrix_globs: Sequence[str] = (),
    adamw_globs: Sequence[str] = (),
    names: str = "megatron",
) -> ModelSpec:
    """The parameters of ``cfg`` in registration order, routed to an optimizer.

    Args:
        cfg: the model config.
        matrix_globs: name globs forced onto the matrix optimizer (must be 2-D).
        adamw_globs: name globs forced onto AdamW (take precedence over ``matrix_globs``).
        names: a key of :data:`NAMINGS`: ``megatron`` (Megatron-core's parameters: fused QKV
            and gate/up, SequentialMLP's per-expert weights), ``megatron-grouped`` (the same
            with TEGroupedMLP's per-expert weights) or ``hf`` (the ``transformers`` 5 model's
            own: q/k/v and gate/up separate — so the separate-projection update rule —, MoE
            experts as 3-D tensors, its registration order), so a plan made offline fits that
            live model's fingerprint.
    """
    if names not in NAMINGS:
        raise ModelError(f"names must be one of: {', '.join(NAMINGS)}; got {names!r}.")
    check_config(cfg)  # sizes that no model has fail here, in one line, before any building
    return _built(cfg, tuple(matrix_globs), tuple(adamw_globs), names)


@lru_cache(maxsize=16)
def _built(cfg: ModelConfig, matrix_globs: tuple[str, ...], adamw_globs: tuple[str, ...],
           names: str) -> ModelSpec:
    """:func:`build_inventory`'s inventory, built once per config (a spec is immutable: the
    planner, the plan's checks and the simulator read the same model many times)."""
    return NAMINGS[names].build(cfg, matrix_globs, adamw_globs)


#: A MoE layer's expert weights under one Megatron expert module: ``(cfg, layer prefix)`` →
#: (name, global expert index, ``fc1``/``fc2``) in registration order.
ExpertWeights = Callable[[ModelConfig, str], Iterator[tuple[str, int, str]]]


def _sequential_experts(cfg: ModelConfig, pre: str) -> Iterator[tuple[str, int, str]]:
    """SequentialMLP (``moe_grouped_gemm=False``): one MLP module per expert in a
    ``local_experts`` ModuleList, each registering its fc1 then its fc2. Yields (name, expert,
    ``fc1``/``fc2``) in registration order."""
    for e in range(cfg.num_experts):
        for fc in ("fc1", "fc2"):
            yield f"{pre}.mlp.experts.local_experts.{e}.linear_{fc}.weight", e, fc


def _grouped_experts(cfg: ModelConfig, pre: str) -> Iterator[tuple[str, int, str]]:
    """TEGroupedMLP (``moe_grouped_gemm=True`` with Transformer Engine): ``linear_fc1`` then
    ``linear_fc2``, each a GroupedLinear registering ``weight{e}`` for every expert in turn."""
    for fc in ("fc1", "fc2"):
        for e in range(cfg.num_experts):
            yield f"{pre}.mlp.experts.linear_{fc}.weight{e}", e, fc


def _megatron_inventory(cfg: ModelConfig, matrix_globs: Sequence[str],
                        adamw_globs: Sequence[str], *, experts: ExpertWeights) -> ModelSpec:
    """Megatron-core's parameters of ``cfg`` (the local layer spec's names), a MoE layer's
    experts named and ordered by ``experts``."""
    h, hd, dt = cfg.hidden, cfg.head_dim, cfg.dtype
    nq, nkv = cfg.q_heads, cfg.kv_heads
    hf = _hf_prefix(cfg)
    out: list[ParamSpec] = []

    def add(name: str, shape: tuple[int, ...], kind: Kind, layout: TPLayout,
            hf_names: Iterable[str], layer: int | None = None, expert: int | None = None,
            parts: tuple[Part, ...] = (), head_rows: int = 0) -> None:
        out.append(ParamSpec(name=name, shape=shape, dtype=dt, kind=kind, layer=layer,
                             expert=expert, tp_layout=layout, parts=parts,
                             hf_names=tuple(hf_names), head_rows=head_rows,
                             optimizer=_route_of(kind, shape)))  # ``route`` keeps it

    add("embedding.word_embeddings.weight", (cfg.vocab, h), "embedding", "vocab",
        [f"{hf}.embed_tokens.weight"])
    for i in range(cfg.layers):
        pre, hpre = f"decoder.layers.{i}", f"{hf}.layers.{i}"
        add(f"{pre}.input_layernorm.weight", (h,), "vector", "replicated",
            [f"{hpre}.input_layernorm.weight"], layer=i)
        add(f"{pre}.self_attention.linear_proj.weight", (h, nq * hd), "matrix", "row",
            [f"{hpre}.self_attn.o_proj.weight"], layer=i)
        add(f"{pre}.self_attention.linear_qkv.weight", ((nq + 2 * nkv) * hd, h), "matrix", "qkv",
            [f"{hpre}.self_attn.{x}_proj.weight" for x in "qkv"], layer=i,
            parts=(Part("q", nq * hd), Part("k", nkv * hd), Part("v", nkv * hd)), head_rows=hd)
        if cfg.qk_norm:
            for x in "qk":
                add(f"{pre}.self_attention.{x}_layernorm.weight", (hd,), "vector", "replicated",
                    [f"{hpre}.self_attn.{x}_norm.weight"], layer=i)
        add(f"{pre}.pre_mlp_layernorm.weight", (h,), "vector", "replicated",
            [f"{hpre}.post_attention_layernorm.weight"], layer=i)
        if cfg.is_moe:
            add(f"{pre}.mlp.router.weight", (cfg.num_experts, h), "router", "replicated",
                [f"{hpre}.mlp.gate.weight"], layer=i)
            f = cfg.moe_ffn
            for name, e, fc in experts(cfg, pre):
                hepre = f"{hpre}.mlp.experts.{e}"
                if fc == "fc1":  # [gate; up], column-parallel with stride 2
                    add(name, (2 * f, h), "expert", "gate_up",
                        [f"{hepre}.gate_proj.weight", f"{hepre}.up_proj.weight"], layer=i,
                        expert=e, parts=(Part("gate", f), Part("up", f)))
                else:
                    add(name, (h, f), "expert", "row", [f"{hepre}.down_proj.weight"], layer=i,
                        expert=e)
        else:
            f = cfg.ffn
            add(f"{pre}.mlp.linear_fc1.weight", (2 * f, h), "matrix", "gate_up",
                [f"{hpre}.mlp.gate_proj.weight", f"{hpre}.mlp.up_proj.weight"], layer=i,
                parts=(Part("gate", f), Part("up", f)))
            add(f"{pre}.mlp.linear_fc2.weight", (h, f), "matrix", "row",
                [f"{hpre}.mlp.down_proj.weight"], layer=i)
    add("decoder.final_layernorm.weight", (h,), "vector", "replicated", [f"{hf}.norm.weight"])
    if not cfg.tied_embeddings:
        add("output_layer.weight", (cfg.vocab, h), "output", "vocab", ["lm_head.weight"])
    return ModelSpec(config=cfg, params=tuple(route(out, matrix_globs=matrix_globs,
                                                    adamw_globs=adamw_globs)))


def megatron_route(p: ParamSpec) -> OptimizerRoute:
    """Megatron's rule: 2-D non-embedding weights → matrix optimizer; embeddings, output layer,
    norms and the MoE router → AdamW. A 3-D tensor of stacked expert
    matrices is E matrices (Megatron's per-expert weights, stored together)."""
    return _route_of(p.kind, p.shape)


def _route_of(kind: Kind, shape: tuple[int, ...]) -> OptimizerRoute:
    """:func:`megatron_route` of a parameter of this kind and shape."""
    if kind in ("matrix", "expert") and (len(shape) == 2 or _stacked(kind, shape)):
        return "matrix"
    return "adamw"


def _stacked(kind: Kind, shape: tuple[int, ...]) -> int:
    """:attr:`ParamSpec.stacked_experts` of a parameter of this kind and shape."""
    return shape[0] if kind == "expert" and len(shape) == 3 else 0


def route(
    params: Iterable[ParamSpec], *, matrix_globs: Sequence[str] = (),
    adamw_globs: Sequence[str] = (),
) -> list[ParamSpec]:
    """Assign each parameter its optimizer; name globs override Megatron's rule.

    Raises:
        ModelError: a glob that matches nothing, or a matrix glob matching a non-2-D parameter.
    """
    params = list(params)
    for globs in (matrix_globs, adamw_globs):
        for g in globs:
            if not any(fnmatch.fnmatchcase(p.name, g) or any(fnmatch.fnmatchcase(n, g)
                       for n in p.hf_names) for p in params):
                raise ModelError(f"optimizer override '{g}' matches no parameter; names look like "
                                 f"'{params[min(2, len(params) - 1)].name}'.")

    def matches(p: ParamSpec, globs: Sequence[str]) -> bool:
        names = (p.name, *p.hf_names)
        return any(fnmatch.fnmatchcase(n, g) for g in globs for n in names)

    routed = []
    for p in params:
        choice = megatron_route(p)
        if adamw_globs and matches(p, adamw_globs):
            choice = "adamw"
        elif matrix_globs and matches(p, matrix_globs):
            if len(p.shape) != 2 and not p.stacked_experts:
                raise ModelError(f"parameter '{p.name}' of shape {list(p.shape)} cannot use the "
                                 "matrix optimizer: it is not 2-D (nor a 3-D tensor of stacked "
                                 "expert matrices).")
            choice = "matrix"
        routed.append(p if p.optimizer == choice else dataclasses.replace(p, optimizer=choice))
    return routed


def _hf_inventory(cfg: ModelConfig, matrix_globs: Sequence[str],
                  adamw_globs: Sequence[str]) -> ModelSpec:
    """The live ``transformers`` model's parameters (Qwen3, Qwen3-MoE, Llama; tp = 1), as
    ``named_parameters()`` lists them: a tied output layer is the embedding (not listed)."""
    h, hd, dt = cfg.hidden, cfg.head_dim, cfg.dtype
    nq, nkv = cfg.q_heads, cfg.kv_heads
    out: list[ParamSpec] = []

    def add(name: str, shape: tuple[int, ...], kind: Kind, layer: int | None = None,
            head_rows: int = 0) -> None:
        out.append(ParamSpec(name=name, shape=shape, dtype=dt, kind=kind, layer=layer,
                             expert=None, tp_layout="replicated", hf_names=(name,),
                             head_rows=head_rows))

    add("model.embed_tokens.weight", (cfg.vocab, h), "embedding")
    for i in range(cfg.layers):
        pre = f"model.layers.{i}"
        add(f"{pre}.self_attn.q_proj.weight", (nq * hd, h), "matrix", i, hd)
        add(f"{pre}.self_attn.k_proj.weight", (nkv * hd, h), "matrix", i, hd)
        add(f"{pre}.self_attn.v_proj.weight", (nkv * hd, h), "matrix", i, hd)
        add(f"{pre}.self_attn.o_proj.weight", (h, nq * hd), "matrix", i)
        if cfg.qk_norm:
            add(f"{pre}.self_attn.q_norm.weight", (hd,), "vector", i)
            add(f"{pre}.self_attn.k_norm.weight", (hd,), "vector", i)
        if cfg.is_moe:
            e, f = cfg.num_experts, cfg.moe_ffn
            add(f"{pre}.mlp.experts.gate_up_proj", (e, 2 * f, h), "expert", i)
            add(f"{pre}.mlp.experts.down_proj", (e, h, f), "expert", i)
            add(f"{pre}.mlp.gate.weight", (e, h), "router", i)
        else:
            add(f"{pre}.mlp.gate_proj.weight", (cfg.ffn, h), "matrix", i)
            add(f"{pre}.mlp.up_proj.weight", (cfg.ffn, h), "matrix", i)
            add(f"{pre}.mlp.down_proj.weight", (h, cfg.ffn), "matrix", i)
        add(f"{pre}.input_layernorm.weight", (h,), "vector", i)
        add(f"{pre}.post_attention_layernorm.weight", (h,), "vector", i)
    add("model.norm.weight", (h,), "vector")
    if not cfg.tied_embeddings:
        add("lm_head.weight", (cfg.vocab, h), "output")
    return ModelSpec(config=cfg, label=f"{cfg.name} (transformers names)",
                     params=tuple(route(out, matrix_globs=matrix_globs, adamw_globs=adamw_globs)))


@dataclass(frozen=True, slots=True)
class Naming:
    """One way of naming a model's parameters.

    Attributes:
        build: the inventory of a config under these names (``cfg, matrix_globs,
            adamw_globs``), in the registration order of the model that carries them.
        parallel: the names carry tensor- and expert-parallel layouts (Megatron-core's modules
            do; a plain ``transformers`` model holds one process's whole parameters).
    """

    build: Callable[[ModelConfig, Sequence[str], Sequence[str]], ModelSpec]
    parallel: bool


#: How an inventory names parameters (``build_inventory(names=)``, ``canzona plan --names``):
#: Megatron-core's (fused QKV and gate/up; experts per SequentialMLP, or per TEGroupedMLP under
#: ``megatron-grouped``) or the live Hugging Face ``transformers`` model's (separate
#: projections, 3-D stacked experts).
NAMINGS: dict[str, Naming] = {
    "megatron": Naming(partial(_megatron_inventory, experts=_sequential_experts),
                       parallel=True),
    "megatron-grouped": Naming(partial(_megatron_inventory, experts=_grouped_experts),
                               parallel=True),
    "hf": Naming(_hf_inventory, parallel=False),
}
