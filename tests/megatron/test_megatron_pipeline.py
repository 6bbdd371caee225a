"""Megatron-core GPTModels in pipeline stages, trained with Megatron's own 1F1B schedule
(``get_forward_backward_func``) and canzona on every stage, equal one process within 1e-5:
untied and tied embeddings at pp 2 × dp 2 and at pp 2 × tp 2, Muon, clipping active (Shampoo
under pipeline stages: ``tests/runtime/test_pipeline.py``).

The stages' modules number their layers from 0; canzona's plan (``plan_model`` of a stage's
module) is the whole model's, a section per stage. The tied output layer on the last stage is a
copy Megatron keeps equal; canzona sums its gradient with the embedding's and keeps the copies
bit-identical.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

PP = 2
MICRO = 2  # microbatches of one sequence: each DP rank's two sequences
CLIP = 0.05


def _config(tied: bool):
    from megatron_train import CFG

    return CFG.model_copy(update={"tied_embeddings": tied})


def _canonical_name(tied: bool, offset: int):
    """A stage's live name → the canonical (pp 1) name: global layers, the tied copy as the
    embedding."""
    from canzona.runtime.checkpoint.names import Placement, global_name

    def rename(name: str) -> str:
        if tied and name == "output_layer.weight":
            return "embedding.word_embeddings.weight"
        return global_name(name, Placement(layer_offset=offset))

    return rename


def train_stage(rank: int, *, dp: int, tp: int, tied: bool, init: str) -> dict:
    """Rank ``rank`` of a pp 2 × dp × tp world: its stage's GPTModel trained by canzona under
    Megatron's schedule. Returns the stage's canonical weights (DP rank 0, gathered over TP),
    the norms and whether the tied copies were equal after each step."""
    import torch.distributed as dist

    import canzona
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_stubs import causal_attention_mask, gpt_model, megatron_world
    from megatron_train import LR, ADAMW_LR, SEQ, STEPS, gather_canonical, load_canonical, tokens

    cfg = _config(tied)
    with megatron_world(dp, tp, pp=PP, backend="gloo", rank=rank, init_method=init,
                        timeout_s=60):
        _, gpt = gpt_model(cfg, tp)
        s, dp_rank, tp_rank = (ps.get_pipeline_model_parallel_rank(),
                               ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank())
        offset = int(gpt.decoder.layers[0].layer_number) - 1
        rename = _canonical_name(tied, offset)
        load_canonical(gpt, tp, tp_rank, cfg, rename=rename)
        plan = canzona.plan_model(gpt, dp=dp, vocab=cfg.vocab, comm_dtype="fp32")
        pp_group = ps.get_pipeline_model_parallel_group()
        opt = canzona.CanzonaOptimizer(
            gpt, plan, dp_group=ps.get_data_parallel_group(),
            tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
            pp_group=pp_group, ns_dtype=torch.float32, lr=LR, adamw_lr=ADAMW_LR,
            adamw_weight_decay=0.01, collective_timeout=60)
        mask = causal_attention_mask(SEQ)
        pos = torch.arange(SEQ)[None]

        def forward_step(data, model):
            ids = next(data)
            out = model(ids[:, :-1], pos, mask, labels=ids[:, 1:])

            def loss_func(output):
                loss = output.float().mean()
                return loss, {"lm loss": loss.detach().clone()}

            return out, loss_func

        fwd_bwd = get_forward_backward_func()
        norms, equal = [], []
        for _ in range(STEPS):
            batch = tokens(dp_rank)
            with opt.no_sync():  # every microbatch accumulates; step() reduces once
                fwd_bwd(forward_step_func=forward_step,
                        data_iterator=iter(batch.split(1)), model=[gpt],
                        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1,
                        forward_only=False)
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
            opt.zero_grad()
            if tied:
                w = gpt.shared_embedding_or_output_weight().detach()
                other = torch.empty_like(w)
                peer = dist.get_global_rank(pp_group, 1 - s)
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, w.clone(), peer),
                                                    dist.P2POp(dist.irecv, other, peer)]):
                    work.wait()
                equal.append(bool(torch.equal(w, other)))
        opt.close()
        weights = gather_canonical(gpt, tp, ps.get_tensor_model_parallel_group(), cfg,
                                   rename=rename)
        return {"stage": s, "dp_rank": dp_rank, "tp_rank": tp_rank, "norms": norms,
                "equal": equal, "weights": weights if dp_rank == 0 and tp_rank == 0 else None}


def reference(rank: int, *, dp: int, tied: bool, init: str) -> dict:
    """One process, pp 1, tp 1: the DP ranks' batches together, clipped as canzona clips."""
    from canzona.runtime.optim import Muon, MuonConfig
    from megatron_stubs import gpt_model, megatron_world
    from megatron_train import LR, STEPS, gather_canonical, load_canonical, reference_steps, tokens

    cfg = _config(tied)
    with megatron_world(1, 1, backend="gloo", rank=0, init_method=init, timeout_s=60):
        _, gpt = gpt_model(cfg, 1)
        load_canonical(gpt, 1, 0, cfg)
        kernel = Muon(MuonConfig(lr=LR, ns_dtype=torch.float32))
        reference_steps(gpt, kernel, LR, lambda: torch.cat([tokens(d) for d in range(dp)]),
                        STEPS, clip=CLIP)
        return {"weights": gather_canonical(gpt, 1, None, cfg)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import functools

    from megatron_train import run_phases

    out = tmp_path_factory.mktemp("mpp")

    def init(tag: str) -> str:
        return f"file://{out}/{tag}"

    phases = []
    for tag, dp, tp, tied in (("untied-dp2", 2, 1, False), ("tied-dp2", 2, 1, True),
                              ("tied-tp2", 1, 2, True), ("untied-tp2", 1, 2, False)):
        phases.append((tag, {r: functools.partial(train_stage, r, dp=dp, tp=tp, tied=tied,
                                                  init=init(tag)) for r in range(4)}))
    for dp, tied in ((2, False), (2, True), (1, True), (1, False)):
        tag = f"ref-{'tied' if tied else 'untied'}-dp{dp}"
        phases.append((tag, {0: functools.partial(reference, 0, dp=dp, tied=tied,
                                                  init=init(tag))}))
    return run_phases(4, phases, str(out))


@pytest.mark.parametrize("tag, tied, dp", [("untied-dp2", False, 2), ("tied-dp2", True, 2),
                                           ("tied-tp2", True, 1), ("untied-tp2", False, 1)])
def test_megatron_stages_train_as_one_process(runs, tag, tied, dp):
    ref = runs[0][f"ref-{'tied' if tied else 'untied'}-dp{dp}"]["weights"]
    got: dict[str, torch.Tensor] = {}
    for r in runs:
        w = r[tag]["weights"]
        if w is not None:
            got.update(w)  # the tied copy and the embedding: the same canonical name
    assert set(got) == set(ref)
    err = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
    assert err <= 1e-5, f"{tag}: max relative error {err:.2e}"
    norms = [r[tag]["norms"] for r in runs]
    assert all(n == norms[0] for n in norms)  # every stage, DP and TP rank: the same norm
    assert all(x > CLIP for x in norms[0])
    if tied:
        assert all(all(r[tag]["equal"]) for r in runs)


def test_a_stage_module_plans_the_whole_pipeline_and_refuses_what_it_cannot_run():
    """``plan_model`` of one stage's module (a fake two-stage world, stage 0) is the whole
    model's pipeline plan; a ``pp`` that disagrees, first/last counts given beside the model's,
    and virtual (interleaved) stages are each refused in one line."""
    import canzona
    from canzona.planner import ModelError, SizeError
    from canzona.planner.plan import PipelinePlan
    from megatron_stubs import gpt_model, megatron_world

    with megatron_world(1, 1, pp=PP):
        _, gpt = gpt_model(_config(False), 1)
        plan = canzona.plan_model(gpt, dp=1, vocab=_config(False).vocab)
        assert isinstance(plan, PipelinePlan) and plan.pp == PP
        assert [p.inputs.stage.first_layer for p in plan.stages] == [0, 1]
        assert plan.stages[1].tasks[-1].param == "output_layer.weight"
        with pytest.raises(SizeError, match="pp=4, but the Megatron model is built for "
                                            "pipeline-parallel size 2"):
            canzona.plan_model(gpt, dp=1, pp=4)
        with pytest.raises(SizeError, match="leave them out"):
            canzona.plan_model(gpt, dp=1, first_stage_layers=1)
        gpt.config.virtual_pipeline_model_parallel_size = 2
        with pytest.raises(ModelError, match="virtual_pipeline_model_parallel_size is 2.*"
                                             "interleaved"):
            canzona.plan_model(gpt, dp=1)


def test_a_whole_model_built_for_stages_is_refused():
    """A GPTModel whose TransformerConfig says pp 2 but that holds every layer (built outside a
    pipeline): none of the stages, refused in one line."""
    import canzona
    from canzona.planner import ModelError
    from megatron_stubs import gpt_model, megatron_world

    with megatron_world(1, 1):
        _, gpt = gpt_model(_config(False), 1, pipeline_model_parallel_size=PP,
                           pipeline_dtype=torch.float32)
        with pytest.raises(ModelError, match="is none of the 2 stages"):
            canzona.plan_model(gpt, dp=1)
