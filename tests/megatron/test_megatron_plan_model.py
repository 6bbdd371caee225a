"""``canzona.plan_model`` reads a live Megatron-core GPTModel through its TransformerConfig:
the plan equals the one made offline from the matching config under Megatron names (same
fingerprint, buffers and tasks) at dp 1-2 × tp 1-2, for Llama-style (tied), Qwen3-style and
Qwen3-MoE (ep 1, and ep 2 on every EP rank) models, bf16 under ``Float16Module`` and float32;
a bare bf16 GPTModel (float32 norms) records each parameter's own dtype; the TP and EP sizes
are the model's; bad input is refused in one line naming the setting. The offline plan (the
tokenizer's vocabulary) applies to the live model whose vocabulary Megatron padded, at tp 1 too.

One process: the ``fake`` process group lets rank 0 of a dp·tp world build the models.
"""

from __future__ import annotations

import itertools

import pytest

from canzona.planner.models import ModelConfig
from megatron_stubs import gpt_model, megatron_world

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
              pytest.mark.filterwarnings("ignore::canzona.planner.errors.CanzonaWarning")]

MODELS = {
    "llama-tied": ModelConfig(name="llama-tied-tiny", arch="llama", hidden=64, ffn=176, layers=2,
                              q_heads=8, kv_heads=2, head_dim=8, vocab=1000,
                              tied_embeddings=True, qk_norm=False),
    "qwen3": ModelConfig(name="qwen3-tiny", arch="qwen3", hidden=48, ffn=120, layers=2, q_heads=4,
                         kv_heads=2, head_dim=24, vocab=777, tied_embeddings=False, qk_norm=True),
}
SIZES = [(1, 1), (2, 1), (1, 2), (2, 2)]
#: every layer MoE (router, 8 per-expert gated SwiGLUs), at expert-parallel size 1
MOE = ModelConfig(name="qwen3-moe-tiny", arch="qwen3_moe", hidden=64, ffn=0, layers=2, q_heads=4,
                  kv_heads=2, head_dim=32, vocab=1000, tied_embeddings=False, qk_norm=True,
                  num_experts=8, experts_per_token=2, moe_ffn=40)


def _offline(cfg: ModelConfig, dp: int, tp: int):
    from canzona.planner import ParallelSizes, TPOptions
    from canzona.planner.pipeline import plan

    return plan(cfg, ParallelSizes(dp=dp, tp=tp), tp_options=TPOptions(comm_dtype="fp32"))


def _live(cfg: ModelConfig, dp: int, tp: int, **kw):
    import canzona

    with megatron_world(dp, tp):
        _, gpt = gpt_model(cfg, tp, **kw.pop("build", {}))
        return canzona.plan_model(gpt, dp=dp, comm_dtype="fp32", **kw), gpt


def _same_plan(a, b) -> None:
    assert a.fingerprint == b.fingerprint
    assert a.buffers == b.buffers
    assert [(t.param, t.part, t.shape, t.owner) for t in a.tasks] == \
        [(t.param, t.part, t.shape, t.owner) for t in b.tasks]
    assert (a.tp is None) == (b.tp is None)
    if a.tp is not None:
        assert a.tp.layouts == b.tp.layouts and a.tp.indices == b.tp.indices


@pytest.mark.parametrize("model,dtype,sizes",
                         list(itertools.product(MODELS, ("bf16", "fp32"), SIZES)),
                         ids=lambda x: str(x))
def test_plan_model_equals_offline_plan(model, dtype, sizes):
    dp, tp = sizes
    cfg = MODELS[model].model_copy(update={"dtype": dtype})
    live, gpt = _live(cfg, dp, tp, vocab=cfg.vocab)
    assert live.inputs.tp == tp  # read from the model's TransformerConfig
    _same_plan(live, _offline(cfg, dp, tp))


@pytest.mark.parametrize("sizes", [(2, 1), (2, 2)], ids=str)
def test_moe_at_ep1_equals_offline_plan(sizes):
    """Sharing off on both sides: what is compared is how the model is read, and the DP pair
    search's CP-SAT start spends tens of seconds on this model at dp 2."""
    from canzona.planner import ParallelSizes, TPOptions
    from canzona.planner.pipeline import plan

    dp, tp = sizes
    live, _ = _live(MOE, dp, tp, vocab=MOE.vocab, share="off")
    assert any(t.part is None and ".local_experts.7." in t.param for t in live.tasks)
    _same_plan(live, plan(MOE, ParallelSizes(dp=dp, tp=tp),
                          tp_options=TPOptions(comm_dtype="fp32", share="off")))


@pytest.mark.parametrize("rank", [0, 1, 2, 3], ids=lambda r: f"rank{r}")
def test_moe_at_ep2_equals_offline_plan_on_every_ep_rank(rank):
    """Each EP rank holds 4 experts numbered from 0; its plan names all 8 by global index and
    equals the offline plan at ep 2 (dp 4: expert-DP 2)."""
    import canzona
    from canzona.planner import ParallelSizes, TPOptions
    from canzona.planner.pipeline import plan

    with megatron_world(4, 1, ep=2, rank=rank):
        _, gpt = gpt_model(MOE, 1, ep=2)
        live = canzona.plan_model(gpt, dp=4, vocab=MOE.vocab, comm_dtype="fp32")
    assert live.inputs.ep == 2
    assert sum(b.expert for b in live.buffers) == 2
    _same_plan(live, plan(MOE, ParallelSizes(dp=4, tp=1, ep=2),
                          tp_options=TPOptions(comm_dtype="fp32")))


def test_expert_parallel_size_is_the_models():
    import canzona
    from canzona.planner.errors import SizeError

    with megatron_world(4, 1, ep=2):
        _, gpt = gpt_model(MOE, 1, ep=2)
        with pytest.raises(SizeError, match=r"ep=4, but the Megatron model is built for "
                                            r"expert-parallel size 2"):
            canzona.plan_model(gpt, dp=4, ep=4)


def test_default_vocab_is_the_models_padded_one():
    cfg = MODELS["qwen3"]
    live, gpt = _live(cfg, 2, 2)
    emb = next(t for t in live.tasks if t.param == "embedding.word_embeddings.weight")
    assert emb.shape[0] == gpt.vocab_size == 1024  # 777 padded to a multiple of 256
    _same_plan(live, _offline(cfg.model_copy(update={"vocab": 1024}), 2, 2))


def test_bare_gptmodel_records_its_float32_norms():
    """Without Float16Module the local spec keeps RMSNorm weights float32 beside bf16 matrices:
    the plan's buffers are per dtype, as Megatron's."""
    cfg = MODELS["qwen3"]
    live, gpt = _live(cfg, 2, 1, vocab=cfg.vocab, build={"float16_module": False})
    dtypes = {s.name: buf.dtype for buf in live.buffers for b in buf.buckets for s in b.slots}
    from canzona.runtime.introspect import dtype_name

    assert {n: dtype_name(p.dtype) for n, p in gpt.named_parameters()} == dtypes
    assert set(dtypes.values()) == {"bf16", "fp32"}


def test_wrapped_model_keeps_its_names():
    """Given the Float16Module, the plan names the parameters as that module does."""
    import canzona

    cfg = MODELS["llama-tied"]
    with megatron_world(1, 2):
        module, gpt = gpt_model(cfg, 2)
        plan = canzona.plan_model(module, dp=1, vocab=cfg.vocab)
        names = [n for n, _ in module.named_parameters()]
    assert names[0].startswith("module.")
    assert list(dict.fromkeys(t.param for t in plan.tasks)) == names


def test_tp_must_be_the_models():
    import canzona
    from canzona.planner.errors import SizeError

    with megatron_world(1, 2):
        _, gpt = gpt_model(MODELS["qwen3"], 2)
        with pytest.raises(SizeError, match=r"tensor_model_parallel_size\).*pass tp=2"):
            canzona.plan_model(gpt, dp=1, tp=1)


def test_vocab_must_pad_to_the_models():
    import canzona
    from canzona.planner.errors import ModelError

    with megatron_world(1, 1):
        _, gpt = gpt_model(MODELS["qwen3"], 1)  # 777 → 896
        with pytest.raises(ModelError, match=r"vocab=1000 pads to 1024 .* vocab_size is 896"):
            canzona.plan_model(gpt, dp=1, vocab=1000)
        with pytest.raises(ModelError, match="vocab must be"):
            canzona.plan_model(gpt, dp=1, vocab=0)


def test_unsupported_config_names_the_field():
    import canzona
    from canzona.planner.errors import ModelError

    with megatron_world(1, 1):
        _, gpt = gpt_model(MODELS["llama-tied"], 1, add_bias_linear=True)
        with pytest.raises(ModelError, match=r"TransformerConfig\.add_bias_linear is True"):
            canzona.plan_model(gpt, dp=1)


def test_vocab_is_for_megatron_models():
    import canzona
    import torch

    with pytest.raises(ValueError, match="vocab= is for Megatron-core models"):
        canzona.plan_model(torch.nn.Linear(4, 4), dp=1, vocab=100)


def test_offline_plan_applies_to_the_padded_vocabulary_at_tp1():
    """The plan records the tokenizer's 777 rows; Megatron's model holds 896 (padded at tp 1):
    the optimizer takes it. A plan for another vocabulary is refused naming the embedding."""
    import canzona
    import torch
    from canzona.runtime.errors import PlanMismatchError

    cfg = MODELS["qwen3"].model_copy(update={"dtype": "fp32"})
    good, bad = _offline(cfg, 1, 1), _offline(cfg.model_copy(update={"vocab": 1500}), 1, 1)
    with megatron_world(1, 1):
        _, gpt = gpt_model(cfg, 1)
        assert gpt.vocab_size == 896
        opt = canzona.CanzonaOptimizer(gpt, good, ns_dtype=torch.float32)
        opt.close()
        with pytest.raises(PlanMismatchError,
                           match=r"'embedding\.word_embeddings\.weight' has "
                                 r"shape \[1500, 48\] in the plan but \[896, 48\]"):
            canzona.CanzonaOptimizer(gpt, bad)


def test_tp_attributes_must_be_the_configs():
    """A model whose fc1 does not carry Megatron's stride-2 [gate_r; up_r] layout is refused
    (its shards would be gathered as the wrong rows)."""
    import canzona
    from canzona.planner.errors import ModelError

    with megatron_world(1, 2):
        _, gpt = gpt_model(MODELS["qwen3"], 2)
        gpt.decoder.layers[1].mlp.linear_fc1.weight.partition_stride = 1
        with pytest.raises(ModelError,
                           match=r"layers\.1\.mlp\.linear_fc1\.weight' has "
                                 r"tensor_model_parallel, partition_dim, partition_stride "
                                 r"= \(True, 0, 1\) .* 'gate_up' layout \(True, 0, 2\)"):
            canzona.plan_model(gpt, dp=1)


def test_a_plan_for_another_ep_or_expert_count_is_refused_before_any_collective():
    import canzona
    from canzona.planner import ParallelSizes
    from canzona.planner.pipeline import plan
    from canzona.runtime.errors import PlanMismatchError

    fewer = MOE.model_copy(update={"num_experts": 4})
    with megatron_world(4, 1, ep=2):
        _, gpt = gpt_model(MOE, 1, ep=2)
        with pytest.raises(PlanMismatchError, match=r"the plan is for ep=1 but the model is built "
                                                    r"with TransformerConfig\.expert_model_"
                                                    r"parallel_size=2"):
            canzona.CanzonaOptimizer(gpt, plan(MOE, ParallelSizes(dp=4, tp=1)))
        with pytest.raises(PlanMismatchError, match=r"the plan has 4 experts but the model's "
                                                    r"TransformerConfig\.num_moe_experts is 8"):
            canzona.CanzonaOptimizer(gpt, plan(fewer, ParallelSizes(dp=4, tp=1, ep=2)))
