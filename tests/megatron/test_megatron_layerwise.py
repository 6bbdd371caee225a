"""canzona's ``layerwise`` dealing equals megatron-core's own ``shard_params``.

megatron-core 0.16.1's ``LayerWiseDistributedOptimizer.shard_params`` deals every parameter of the
optimizers it chains to a DP rank: sorted by ascending (TP-local) size, ping-pong over the ranks,
all-reduced parameters over the DP group and expert-parallel ones (``allreduce=False``: experts at
ep > 1) over the expert-data-parallel group, each with its own count.
``get_megatron_muon_optimizer`` hands it the Muon optimizer (the 2-D parameters that are not the
embedding or output layer) and then the AdamW ones of the dense and the expert parameters, each with
the parameter groups of megatron-core's ``_get_param_groups``; ties of size keep that order.

Here megatron-core builds GPTModels (dense Llama and Qwen3, tied and untied; a Llama whose
embedding and output layer are the size of two of its Muon matrices, so that the optimizers' order
decides ties; Qwen3-MoE at ep 1 — the experts all-reduced and dealt with the dense parameters — and
at ep 2 and 4, recorded on the first and the last EP rank) at several dp and tp, the parameter
groups are made by megatron-core's ``_get_param_groups`` with the freezing
``get_megatron_muon_optimizer`` applies (its Muon optimizer itself needs ``emerging_optimizers``,
which these tests do without), and ``shard_params`` itself deals them over the world's real DP and
expert-DP groups (the ``fake`` process group: one process plays one rank). Every parameter's DP
index must equal what :func:`canzona.planner.baselines.megatron_layerwise` gives the same model
and sizes.
"""

from __future__ import annotations

import re
import types

import pytest

from canzona.planner.baselines import megatron_layerwise
from canzona.planner.inventory import build_inventory
from canzona.planner.layout import ParallelSizes
from canzona.planner.models import ModelConfig
from canzona.planner.planning import make_problem
from megatron_stubs import gpt_model, megatron_world

#: megatron-core on CPU warns about the missing Transformer Engine and Apex, and deprecations
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")]

MODELS = {
    # untied embeddings: the embedding and the output layer tie in size (AdamW's default group)
    "llama": ModelConfig(name="llama-tiny", arch="llama", hidden=64, ffn=176, layers=3,
                         q_heads=8, kv_heads=2, head_dim=8, vocab=1000, tied_embeddings=False,
                         qk_norm=False),
    # QK-norm: q/k norms tie with each other, the input and pre-MLP norms with the final norm
    "qwen3-tied": ModelConfig(name="qwen3-tied-tiny", arch="qwen3", hidden=64, ffn=96, layers=2,
                              q_heads=4, kv_heads=2, head_dim=32, vocab=1000,
                              tied_embeddings=True, qk_norm=True),
    # the embedding and output layer (AdamW: after Muon's parameters) the size of linear_proj
    # and linear_fc2 (Muon's): 128 padded rows × 64 = 64 × 128
    "ties": ModelConfig(name="llama-ties-tiny", arch="llama", hidden=64, ffn=128, layers=2,
                        q_heads=4, kv_heads=2, head_dim=32, vocab=100, tied_embeddings=False,
                        qk_norm=False),
    # every layer MoE: router (Muon, dense) and per-expert fc1/fc2 (Muon, expert-parallel)
    "moe": ModelConfig(name="qwen3-moe-tiny", arch="qwen3_moe", hidden=64, ffn=0, layers=2,
                       q_heads=4, kv_heads=2, head_dim=32, vocab=1000, tied_embeddings=False,
                       qk_norm=True, num_experts=8, experts_per_token=2, moe_ffn=40),
}
#: (model, dp, tp, ep, EP rank recorded)
CASES = [("llama", 1, 1, 1, 0), ("llama", 3, 1, 1, 0), ("llama", 4, 2, 1, 0),
         ("qwen3-tied", 2, 1, 1, 0), ("qwen3-tied", 3, 2, 1, 0), ("ties", 3, 1, 1, 0),
         ("ties", 4, 1, 1, 0),
         ("moe", 2, 1, 1, 0), ("moe", 3, 2, 1, 0), ("moe", 4, 2, 2, 0), ("moe", 4, 2, 2, 1),
         ("moe", 4, 1, 4, 3)]

_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def _case_id(case: tuple) -> str:
    model, dp, tp, ep, k = case
    return f"{model}-dp{dp}-tp{tp}-ep{ep}-eprank{k}"


def _optimizers(module, config) -> list:  # noqa: ANN001
    """Stand-ins for the optimizers ``get_megatron_muon_optimizer`` chains, in its order, each
    with the parameter groups megatron-core makes for it: Muon's (every 2-D parameter that is
    not the embedding or the output layer, the rest frozen), then ``get_megatron_optimizer``'s
    dense and expert AdamW ones (the Muon parameters frozen)."""
    from megatron.core.optimizer import _get_param_groups

    linear, other = [], []
    for _, p in module.named_parameters():
        if not getattr(p, "is_embedding_or_output_parameter", False) and len(p.shape) == 2:
            linear.append(p)
        else:
            other.append(p)
    for p in other:
        p.requires_grad = False
    muon = _get_param_groups([module], config, None)
    for p in other:
        p.requires_grad = True
    for p in linear:
        p.requires_grad = False
    adam = _get_param_groups([module], config, None)
    for p in linear:
        p.requires_grad = True
    return [types.SimpleNamespace(param_groups=groups)
            for groups in (muon, [g for g in adam if not g["is_expert_parallel"]],
                           [g for g in adam if g["is_expert_parallel"]]) if groups]


def _megatron_owners(case: tuple) -> dict[str, int]:
    """Parameter name (canzona's: experts by their global index) → the DP index
    ``shard_params`` deals it to, as rank ``k``'s EP rank sees it (expert-DP rank r of EP rank k
    is DP index r·ep + k)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    model, dp, tp, ep, k = case
    cfg = MODELS[model]
    # the last rank of the world is on the last EP rank (Megatron's tp-cp-ep-dp order)
    with megatron_world(dp, tp, ep=ep, rank=0 if k == 0 else dp * tp - 1):
        assert parallel_state.get_expert_model_parallel_rank() == k
        module, gpt = gpt_model(cfg, tp, ep, perform_initialization=False)
        first = k * (cfg.num_experts // ep) if cfg.is_moe else 0
        names = {p: _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{first + int(m[2])}{m[3]}", n)
                 for n, p in gpt.named_parameters()}
        optimizers = _optimizers(module, OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True))
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        expert = {p for o in optimizers for g in o.param_groups if g["is_expert_parallel"]
                  for p in g["params"]}
        # shard_params keeps only this rank's parameters in the groups; its lists name all
        lw = LayerWiseDistributedOptimizer.__new__(LayerWiseDistributedOptimizer)
        lw.pg_collection = ProcessGroupCollection.use_mpu_process_groups(["dp_cp", "expt_dp"])
        LayerWiseDistributedOptimizer.shard_params(lw, optimizers)
        out: dict[str, int] = {}
        # None: a group of one rank (or no expert parameters) keeps everything on its rank 0
        for r, mine in enumerate(lw.dp_cp_params_list or [[p for p in params
                                                          if p not in expert]]):
            out.update({names[p]: r for p in mine})
        for r, mine in enumerate(lw.expt_dp_params_list or [list(expert)]):
            out.update({names[p]: r * ep + k for p in mine})
        assert len(out) == len(params) == len(names)
    return out


@pytest.fixture(scope="module")
def megatron_owners() -> dict:
    """megatron-core's dealing of every case, recorded in this process (fake process group)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    return {case: _megatron_owners(case) for case in CASES}


def _canzona_owners(case: tuple) -> dict[str, int]:
    """canzona's ``layerwise`` dealing of the same model and sizes: the dense parameters and EP
    rank k's experts."""
    model, dp, tp, ep, k = case
    problem = make_problem(build_inventory(MODELS[model]), ParallelSizes(dp, tp, ep))
    out = {}
    for g in megatron_layerwise(problem).groups:
        if g.expert and g.members[0] != k:
            continue
        for (bi, ii), d in zip(g.items, g.owners):
            b = problem.buckets[bi]
            slot = problem.layout.buffers[b.buffer].buckets[b.bucket].slots[b.items[ii].slot]
            out[slot.name] = d
    return out


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_layerwise_deals_as_megatron_shard_params(megatron_owners, case):
    mega = megatron_owners[case]
    ours = _canzona_owners(case)
    assert ours == mega
    assert set(mega.values()) == set(range(case[1]))  # every DP index is dealt something
