"""Megatron-core's grouped-GEMM experts, through stand-ins carrying exactly their parameters
(``megatron_grouped``: Transformer Engine is not installed, so the real modules do not build).

* ``TEGroupedMLP`` (``experts.linear_fc1.weight{j}``, ``experts.linear_fc2.weight{j}``): the
  planner's ``megatron-grouped`` inventory laid out by ``build_layout`` is the layout Megatron's
  own ``DistributedDataParallel`` builds over the stand-in (every offset, bucket and DP rank's
  range, dense and expert buffers) at ep 1, 2 and expert TP = TP or 1; ``plan_model`` reads
  the stand-in model as the plan made offline from its config under that naming, one matrix task
  per expert named by its global index, on the first and the last EP rank; TE's tensor-parallel
  attributes are checked as TE sets them.
* The legacy ``GroupedMLP`` (every local expert in one matrix) is refused naming the
  ``TransformerConfig`` field and the fix, by ``plan_model`` and by the optimizer before any
  collective.
* Megatron-FSDP and torch FSDP2 storage are refused the same way; shared experts, multi-latent
  attention and pipeline parallelism under ep > 1 name their ``TransformerConfig`` field.
"""

from __future__ import annotations

import re
import types

import pytest

from canzona.planner.inventory import build_inventory
from canzona.planner.layout import ParallelSizes, build_layout
from megatron_grouped import grouped_gpt_model
from megatron_stubs import gpt_model, megatron_world
from test_megatron_layout import (BUCKETS, MOE, _assert_buckets, _assert_params, _assert_ranges,
                                  _record_buffer)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
              pytest.mark.filterwarnings("ignore::canzona.planner.errors.CanzonaWarning")]

#: (dp, tp, ep, etp): experts in the dense buffer (ep 1), expert buffers at expert TP = TP
#: (expert-DP 2) and at expert TP 1 under TP 2 (expert-DP 4).
LAYOUT_SIZES = [(2, 1, 1, None), (2, 2, 1, None), (4, 1, 2, None), (4, 2, 2, None), (4, 2, 2, 1)]
LAYOUT_BUCKETS = ("per-param", "small")
#: A grouped weight's local expert index (Megatron's TE GroupedLinear ``weight{j}``).
_GROUPED = re.compile(r"(\.linear_fc[12]\.weight)(\d+)$")
#: The same weight's name in SequentialMLP.
_AS_SEQUENTIAL = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)$")


def _record(dp: int, tp: int, ep: int, etp: int | None, rank: int) -> dict:
    """Megatron's DDP buffers over the stand-in model, played by ``rank``, per bucket setting;
    experts renamed by their global index (``ep_rank·E/ep + j``)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    out = {}
    extra = {} if etp is None else {"expert_tensor_parallel_size": etp}
    with megatron_world(dp, tp, ep=ep, etp=etp, rank=rank):
        k = parallel_state.get_expert_model_parallel_rank()
        for bucket in LAYOUT_BUCKETS:
            size, overlap = BUCKETS[bucket]
            module, gpt = grouped_gpt_model(MOE, tp, ep, perform_initialization=False, **extra)
            first = k * (MOE.num_experts // ep)
            names = {p: _GROUPED.sub(lambda m: f"{m[1]}{first + int(m[2])}", n)
                     for n, p in gpt.named_parameters()}
            ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=overlap, bucket_size=size,
                grad_reduce_in_fp32=True), module)
            out[bucket] = (k, [_record_buffer(b, names) for b in ddp.buffers],
                           [_record_buffer(b, names) for b in ddp.expert_parallel_buffers])
    return out


@pytest.mark.parametrize("sizes", LAYOUT_SIZES, ids=lambda s: "dp{}-tp{}-ep{}-etp{}".format(*s))
def test_te_grouped_layout_is_megatrons(sizes):
    """On the first and the last EP rank, for each bucket setting: the grouped inventory's
    layout (fc1's weights then fc2's, each expert by expert, entering the buffers in reverse) is
    Megatron's."""
    dp, tp, ep, etp = sizes
    for rank in (0, dp * tp - 1):
        recorded = _record(dp, tp, ep, etp, rank)
        spec = build_inventory(MOE, names="megatron-grouped")
        for bucket, (k, dense, experts) in recorded.items():
            size, overlap = BUCKETS[bucket]
            lay = build_layout(spec, ParallelSizes(dp, tp, ep, etp), bucket_size=size,
                               overlap_grad_reduce=overlap)
            ours = ([b for b in lay.buffers if not b.expert]
                    + [b for b in lay.buffers if b.expert and b.ep_rank == k])
            assert len(experts) == (1 if ep > 1 else 0)
            _assert_params(ours, dense + experts)
            _assert_buckets(ours, dense + experts)
            _assert_ranges(ours, dense + experts)
        assert k == (0 if rank == 0 else ep - 1)


def _offline(dp: int, tp: int, ep: int, etp: int | None = None):
    from canzona.planner import TPOptions
    from canzona.planner.pipeline import plan

    return plan(MOE, ParallelSizes(dp=dp, tp=tp, ep=ep, etp=etp),
                tp_options=TPOptions(comm_dtype="fp32"), names="megatron-grouped")


@pytest.mark.parametrize("sizes", [(1, 1, 1, None), (2, 2, 1, None), (4, 1, 2, None),
                                   (2, 2, 2, None), (2, 2, 2, 1)],
                         ids=lambda s: "dp{}-tp{}-ep{}-etp{}".format(*s))
def test_plan_model_reads_te_grouped_experts(sizes):
    """The live plan equals the offline ``megatron-grouped`` plan on the first and the last
    rank: every expert's fc1 and fc2 its own matrix task, named by its global index. TE marks
    fc2's weights row-parallel (``partition_dim`` 1) only at expert TP 1 and ep 1."""
    import canzona

    dp, tp, ep, etp = sizes
    want = _offline(dp, tp, ep, etp)
    extra = {} if etp is None else {"expert_tensor_parallel_size": etp}
    for rank in (0, dp * tp - 1):
        with megatron_world(dp, tp, ep=ep, etp=etp, rank=rank):
            _, gpt = grouped_gpt_model(MOE, tp, ep, **extra)
            live = canzona.plan_model(gpt, dp=dp, vocab=MOE.vocab, comm_dtype="fp32")
        assert live.fingerprint == want.fingerprint
        assert live.buffers == want.buffers
        assert [(t.param, t.part, t.shape, t.owner) for t in live.tasks] == \
            [(t.param, t.part, t.shape, t.owner) for t in want.tasks]
    experts = {t.param for t in live.tasks if ".mlp.experts." in t.param}
    assert experts == {f"decoder.layers.{i}.mlp.experts.linear_fc{f}.weight{e}"
                       for i in range(MOE.layers) for f in (1, 2) for e in range(8)}
    assert all(t.part is None for t in live.tasks if t.param in experts)


def test_optimizer_steps_te_grouped_experts_as_sequential_ones():
    """One process, float32: the stand-in model holding the SequentialMLP model's weights under
    TEGroupedMLP's names takes the same step (Muon on every expert matrix, AdamW elsewhere) from
    the same gradients, bit for bit, and every parameter moves."""
    import torch

    import canzona

    cfg = MOE.model_copy(update={"dtype": "fp32"})
    with megatron_world(1, 1):
        _, seq = gpt_model(cfg, 1)
        _, grouped = grouped_gpt_model(cfg, 1)
        weights = dict(seq.named_parameters())
        pairs = []
        for n, p in grouped.named_parameters():
            q = weights[_AS_SEQUENTIAL.sub(r".experts.local_experts.\2.\1.weight", n)]
            with torch.no_grad():
                p.copy_(q)
            pairs.append((p, q))
        before = [q.detach().clone() for _, q in pairs]
        opts = [canzona.CanzonaOptimizer(m, canzona.plan_model(m, dp=1, comm_dtype="fp32"),
                                         ns_dtype=torch.float32, lr=0.1) for m in (seq, grouped)]
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(q.shape, generator=g) for _, q in pairs]
        for k in (0, 1):  # each parameter's gradient is its grads entry, through backward
            sum((c * pq[k]).sum() for c, pq in zip(grads, pairs)).backward()
        for opt in opts:
            opt.step()
            opt.close()
    assert all(torch.equal(p, q) for p, q in pairs)
    assert not any(torch.equal(q, b) for (_, q), b in zip(pairs, before))


def test_te_attributes_are_checked():
    """Under ep > 1 TE marks fc2's weights ``partition_dim`` 0 (Megatron hands TE no parallel
    mode); a weight marked as a row-parallel Megatron layer is refused."""
    import canzona
    from canzona.planner.errors import ModelError

    with megatron_world(4, 1, ep=2):
        _, gpt = grouped_gpt_model(MOE, 1, 2)
        gpt.decoder.layers[1].mlp.experts.linear_fc2.weight3.partition_dim = 1
        with pytest.raises(ModelError, match=r"layers\.1\.mlp\.experts\.linear_fc2\.weight3' has "
                                             r"tensor_model_parallel, partition_dim, "
                                             r"partition_stride = \(True, 1, 1\) .* 'row' layout "
                                             r"\(True, 0, 1\)"):
            canzona.plan_model(gpt, dp=4)


def test_config_flag_does_not_decide_the_expert_module():
    """``moe_grouped_gemm=True`` in a config whose layer spec still builds SequentialMLP: the
    model's own weights decide, and it plans under SequentialMLP's names."""
    import canzona

    with megatron_world(4, 1, ep=2):
        _, gpt = gpt_model(MOE, 1, ep=2, moe_grouped_gemm=True)
        live = canzona.plan_model(gpt, dp=4, vocab=MOE.vocab)
    assert any(".local_experts.7.linear_fc2.weight" in t.param for t in live.tasks)


def _no_collectives(monkeypatch) -> None:
    """Every collective the optimizer could start fails the test."""
    import torch.distributed as dist

    def collective(*args, **kwargs):
        raise AssertionError("a collective ran before the refusal")

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                 "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier",
                 "new_group", "new_subgroups_by_enumeration"):
        monkeypatch.setattr(dist, name, collective)


def test_legacy_grouped_mlp_is_refused_before_any_collective(monkeypatch):
    import canzona
    from canzona.planner.errors import ModelError

    with megatron_world(4, 1, ep=2):
        _, gpt = grouped_gpt_model(MOE, 1, 2, experts="GroupedMLP")
        fix = (r"legacy GroupedMLP \('decoder\.layers\.0\.mlp\.experts\.weight1' holds every "
               r"local expert in one matrix\).*TransformerConfig\.moe_grouped_gemm=False "
               r"\(SequentialMLP\).*moe_use_legacy_grouped_gemm=False \(TEGroupedMLP\)")
        with pytest.raises(ModelError, match=fix):
            canzona.plan_model(gpt, dp=4)
        plan = _offline(4, 1, 2)
        _no_collectives(monkeypatch)
        with pytest.raises(ModelError, match=fix):
            canzona.CanzonaOptimizer(gpt, plan)


class _Wrapper:
    """A Megatron data-parallel wrapper as canzona sees it: ``module`` and ``ddp_config``."""

    def __new__(cls, module, ddp_config):
        from torch import nn

        wrapper = nn.Module()
        wrapper.module, wrapper.ddp_config = module, ddp_config
        return wrapper


def test_fsdp_storage_is_refused_before_any_collective(monkeypatch):
    """Megatron-FSDP (its wrapper's ``ddp_config``, or the ``_megatron_fsdp_model`` it attaches
    to the parameters) and torch FSDP2 (DTensor parameters) under ep 2, by ``plan_model`` and by
    the optimizer."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    import canzona
    from canzona.planner.errors import ModelError

    megatron_fsdp = r"DistributedDataParallelConfig\.use_megatron_fsdp"
    with megatron_world(4, 1, ep=2):
        _, gpt = gpt_model(MOE, 1, ep=2)
        wrapped = _Wrapper(gpt, DistributedDataParallelConfig(use_megatron_fsdp=True))
        with pytest.raises(ModelError, match=megatron_fsdp + r" is True: .*Megatron-FSDP"):
            canzona.plan_model(wrapped, dp=4)
        wrapped.ddp_config = DistributedDataParallelConfig()
        canzona.plan_model(wrapped, dp=4, vocab=MOE.vocab)  # Megatron's plain DDP config
        norm = gpt.decoder.final_layernorm.weight
        norm._megatron_fsdp_model = types.SimpleNamespace()
        with pytest.raises(ModelError, match=r"'decoder\.final_layernorm\.weight' is stored by "
                                             r"Megatron-FSDP \(" + megatron_fsdp + "=True"):
            canzona.plan_model(gpt, dp=4)
        del norm._megatron_fsdp_model
        mesh = DeviceMesh("cpu", list(range(4)))
        emb = gpt.embedding.word_embeddings
        emb.weight = torch.nn.Parameter(DTensor.from_local(emb.weight.data[:256], mesh,
                                                           [Shard(0)], run_check=False))
        torch_fsdp2 = (r"'embedding\.word_embeddings\.weight' is a DTensor: .*torch FSDP2 "
                       r"\(Megatron-LM's --use-torch-fsdp2")
        with pytest.raises(ModelError, match=torch_fsdp2):
            canzona.plan_model(gpt, dp=4)
        plan = _offline(4, 1, 2)
        _no_collectives(monkeypatch)
        with pytest.raises(ModelError, match=torch_fsdp2):
            canzona.CanzonaOptimizer(gpt, plan)


@pytest.mark.parametrize("field,value,extra", [
    pytest.param("moe_shared_expert_intermediate_size", 40, {}, id="shared-experts"),
    pytest.param("multi_latent_attention", True, {}, id="mla"),
])
def test_expert_parallel_model_settings_name_the_field(field, value, extra):
    """Shared experts and multi-latent attention, each with ep 2 (virtual pipeline stages:
    ``test_megatron_pipeline.py``)."""
    import torch

    import canzona
    from canzona.planner.errors import ModelError

    extra = {k: getattr(torch, v) for k, v in extra.items()}  # torch dtypes by name
    with megatron_world(4, 1, ep=2):
        _, gpt = gpt_model(MOE, 1, ep=2, **{field: value}, **extra)
        with pytest.raises(ModelError, match=rf"TransformerConfig\.{field} is {value!r}; "):
            canzona.plan_model(gpt, dp=4)


def test_te_grouped_checkpoints_at_expert_tp_above_1_are_refused_before_any_collective():
    """Transformer Engine's attributes do not describe a grouped expert's TP shard layout, so a
    checkpoint of one split over expert TP > 1 is refused (at expert TP 1 it is whole)."""
    from types import SimpleNamespace

    from canzona.runtime.checkpoint.dcp import _check_model
    from canzona.runtime.errors import CheckpointError

    names = ["decoder.layers.0.mlp.experts.linear_fc1.weight3"]
    for etp, refused in ((2, True), (1, False)):
        opt = SimpleNamespace(_names=names, _local_names=names,
                              plan=SimpleNamespace(inputs=SimpleNamespace(etp=etp)))
        if refused:
            with pytest.raises(CheckpointError, match="expert_tensor_parallel_size=1"):
                _check_model(None, opt)
        else:
            _check_model(None, opt)
