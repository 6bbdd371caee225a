"""Test-only stand-ins for Megatron-core's grouped-GEMM expert modules, which need Transformer
Engine (``TEGroupedMLP``) or the ``grouped_gemm`` package (the legacy ``GroupedMLP``) and so do
not build on this CPU.

Each stand-in carries exactly the parameters the real module registers, as megatron-core 0.16.1
and Transformer Engine build them (read from ``megatron/core/transformer/moe/experts.py``,
``megatron/core/extensions/transformer_engine.py`` and Transformer Engine's
``pytorch/module/grouped_linear.py``): names, registration order, local shapes under expert TP,
dtype, and the attributes Megatron's buffers and canzona read (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``, ``allreduce``). It has no forward: the tests build
Megatron's own ``DistributedDataParallel`` buffers over it and plan it.

* ``TEGroupedMLP``: ``linear_fc1`` (``TEColumnParallelGroupedLinear``: hidden → 2·ffn for the
  gated unit), then ``linear_fc2`` (``TERowParallelGroupedLinear``: ffn → hidden), each a TE
  ``GroupedLinear`` registering ``weight0`` … ``weight{n-1}`` of shape [out, in], one per local
  expert. Megatron splits the sizes by the expert-TP size itself and hands TE no parallel mode
  when it exchanges the expert activations itself (expert TP > 1 or ep > 1); otherwise TE gets
  the column/row mode at size 1. TE marks each weight tensor-parallel with stride 1 and
  ``partition_dim`` 1 in row mode, else 0. Megatron sets ``allreduce = not (is_expert and
  ep > 1)``. Without biases (``add_bias_linear=False``) TE registers no bias parameters.
* ``GroupedMLP`` (legacy): ``weight1`` [hidden, n·2·ffn/etp] (``partition_dim`` 1) and
  ``weight2`` [n·ffn/etp, hidden] (``partition_dim`` 0): every local expert in one matrix;
  ``allreduce = not ep > 1``.

:func:`grouped_gpt_model` builds the local-spec GPTModel of :func:`megatron_stubs.gpt_model`
(``moe_grouped_gemm=True`` in its config, as a grouped model's) and puts a stand-in in place of
each layer's ``mlp.experts``, keeping its place in the registration order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_stubs import gpt_model

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from canzona.planner.models import ModelConfig


def _sizes(config: Any) -> tuple[int, int, int, bool]:
    """(expert TP size, local experts, fc1 output width, ep > 1) of the current world."""
    from megatron.core import parallel_state

    etp = parallel_state.get_expert_tensor_parallel_world_size()
    ep = config.expert_model_parallel_size
    ffn1 = config.moe_ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    return etp, config.num_moe_experts // ep, ffn1, ep > 1


def _mark(t: Any, dim: int, ep_parallel: bool) -> None:
    t.tensor_model_parallel, t.partition_dim, t.partition_stride = True, dim, 1
    t.allreduce = not ep_parallel


def te_grouped_experts(config: Any) -> "nn.Module":
    """A stand-in for ``TEGroupedMLP`` in the current Megatron world (see the module doc)."""
    import torch
    from torch import nn

    etp, n, ffn1, ep_parallel = _sizes(config)
    explicit = etp > 1 or ep_parallel  # Megatron exchanges the expert activations itself

    class GroupedLinear(nn.Module):
        def __init__(self, in_features: int, out_features: int, mode: str) -> None:
            super().__init__()
            if explicit:  # Megatron divides by the expert-TP size; TE sees no parallel mode
                if mode == "column":
                    out_features //= etp
                else:
                    in_features //= etp
                mode = "none"
            for i in range(n):
                w = nn.Parameter(torch.empty(out_features, in_features,
                                             dtype=config.params_dtype))
                self.register_parameter(f"weight{i}", w)
                _mark(w, 1 if mode == "row" else 0, ep_parallel)

    class TEGroupedMLPStandIn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear_fc1 = GroupedLinear(config.hidden_size, ffn1, "column")
            self.linear_fc2 = GroupedLinear(config.moe_ffn_hidden_size, config.hidden_size, "row")

    return TEGroupedMLPStandIn()


def legacy_grouped_experts(config: Any) -> "nn.Module":
    """A stand-in for the legacy ``GroupedMLP`` in the current Megatron world."""
    import torch
    from torch import nn

    etp, n, ffn1, ep_parallel = _sizes(config)

    class GroupedMLPStandIn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h, dt = config.hidden_size, config.params_dtype
            self.weight1 = nn.Parameter(torch.empty(h, n * ffn1 // etp, dtype=dt))
            self.weight2 = nn.Parameter(torch.empty(n * config.moe_ffn_hidden_size // etp, h,
                                                    dtype=dt))
            _mark(self.weight1, 1, ep_parallel)
            _mark(self.weight2, 0, ep_parallel)

    return GroupedMLPStandIn()


#: The stand-ins by the expert module they play.
STAND_INS = {"TEGroupedMLP": te_grouped_experts, "GroupedMLP": legacy_grouped_experts}


def grouped_gpt_model(cfg: "ModelConfig", tp: int, ep: int = 1, *, experts: str = "TEGroupedMLP",
                      float16_module: bool = True, **config_overrides: Any):
    """:func:`megatron_stubs.gpt_model` with every MoE layer's experts the stand-in of
    ``experts`` (a key of :data:`STAND_INS`), inside ``megatron_world``. Returns (module, gpt)."""
    from megatron.core.transformer.module import Float16Module

    _, gpt = gpt_model(cfg, tp, ep, float16_module=False, moe_grouped_gemm=True,
                       **config_overrides)
    for layer in gpt.decoder.layers:
        layer.mlp.experts = STAND_INS[experts](gpt.config)  # keeps its registration place
    if float16_module and cfg.dtype in ("bf16", "fp16"):
        return Float16Module(gpt.config, gpt), gpt
    return gpt, gpt
