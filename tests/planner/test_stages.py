"""Pipeline stages in the planner: Megatron's layer split, each stage's parameters, a plan per
stage in one file (schema version 9), its checks, and the 1F1B iteration of the simulator."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner import DPOptions, ModelConfig, ParallelSizes, PlanFileError, SizeError
from canzona.planner import build_inventory
from canzona.planner.hardware import load_hardware
from canzona.planner.pipeline import plan
from canzona.planner.plan import PIPELINE_VERSION, PipelinePlan, Plan, save_plan
from canzona.planner.plan.inverse import rebuild_model
from canzona.planner.plan.load import as_pipeline, load_plan, parse_plan
from canzona.planner.planning import make_problem
from canzona.planner.pipeline import plan_problem
from canzona.planner.report import inspect_report, stages_dict
from canzona.planner.simulate import one_f_one_b, simulate_pipeline
from canzona.planner.stages import StageSplit, split_model, stage_layers
from canzona.planner.strategies import compare_pipeline

SMALL = DPOptions(bucket_size=20000)


def tiny(layers: int = 4, tied: bool = False) -> ModelConfig:
    return ModelConfig(name=f"tiny{layers}{'t' if tied else ''}", arch="qwen3", hidden=64,
                       ffn=128, layers=layers, q_heads=4, kv_heads=2, head_dim=16, vocab=256,
                       tied_embeddings=tied, qk_norm=True)


# --- Megatron's split ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 40), pp=st.integers(1, 9),
       first=st.none() | st.integers(0, 12), last=st.none() | st.integers(0, 12))
def test_the_layer_split_is_megatrons_rule(layers, pp, first, last):
    """Even without first/last counts; with them, the rest even over the other stages; every
    layer on one stage; and a split that does not fit is refused naming the option."""
    split = StageSplit(pp=pp, first_stage_layers=first, last_stage_layers=last)
    given_ends = (first is not None) + (last is not None)
    rest = layers - (first or 0) - (last or 0)
    middle = pp - given_ends
    fits = (pp == 1 and not given_ends) or (pp > 1 and (
        (not given_ends and layers % pp == 0)
        or (given_ends and rest >= 0 and (rest % middle == 0 if middle else rest == 0))))
    if not fits:
        with pytest.raises(SizeError, match="StageSplit"):
            stage_layers(layers, split)
        return
    counts = stage_layers(layers, split)
    assert len(counts) == pp and sum(counts) == layers
    if first is not None and pp > 1:
        assert counts[0] == first
    if last is not None and pp > 1:
        assert counts[-1] == last
    inner = [c for s, c in enumerate(counts)
             if not (s == 0 and first is not None) and not (s == pp - 1 and last is not None)]
    assert len(set(inner)) <= 1


@pytest.mark.parametrize("tied", [False, True])
def test_each_stage_holds_its_layers_and_the_end_modules(tied):
    """Stage 0 the embedding, the last stage the final norm and output layer (tied: the
    embedding's copy, named output_layer.weight); every parameter of the whole model on exactly
    one stage, in registration order, under its global name."""
    spec = build_inventory(tiny(7, tied))
    parts = split_model(spec, StageSplit(pp=3, first_stage_layers=1))
    assert [(p.stage.first_layer, p.stage.layers) for p in parts] == [(0, 1), (1, 3), (4, 3)]
    held = [p.name for part in parts for p in part.params]
    copy = ["output_layer.weight"] if tied else []
    assert held == [p.name for p in spec.params] + copy
    assert parts[0].params[0].kind == "embedding"
    assert all(p.kind != "embedding" for part in parts[1:] for p in part.params)
    for part in parts:
        for p in part.params:
            if p.layer is not None:
                assert part.stage.first_layer <= p.layer < part.stage.first_layer + \
                    part.stage.layers
    last = parts[-1].params
    assert last[-1].name == "output_layer.weight"
    if tied:
        emb = spec["embedding.word_embeddings.weight"]
        assert (last[-1].shape, last[-1].optimizer, last[-1].tp_layout) == \
            (emb.shape, emb.optimizer, emb.tp_layout)
    assert len({p.fingerprint() for p in parts}) == 3


# --- a plan per stage -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staged() -> PipelinePlan:
    return plan(tiny(4, tied=True), ParallelSizes(dp=2, tp=2), dp_options=SMALL,
                stages=StageSplit(pp=2))


def test_a_pipeline_plan_is_each_stage_planned_alone(staged):
    """Nothing moves across stages: stage s's plan is the plan of stage s's parameters alone,
    and the file records which stage each is (schema version 9)."""
    assert staged.pp == 2 and staged.schema_version == PIPELINE_VERSION
    parts = split_model(build_inventory(tiny(4, tied=True)), StageSplit(pp=2))
    for s, (p, part) in enumerate(zip(staged.stages, parts)):
        assert p.schema_version == PIPELINE_VERSION
        assert p.inputs.stage.stage == s and p.inputs.stage.first_layer == 2 * s
        assert p.inputs.stage.tied_copy  # both ends hold one of the two copies
        alone = plan_problem(make_problem(part, ParallelSizes(dp=2, tp=2), cost=SMALL.cost,
                                          bucket_size=SMALL.bucket_size), model_source="hf_config")
        assert p == alone
        assert p.fingerprint == part.fingerprint()
        assert {t.param for t in p.tasks} == {x.name for x in part.params}


def test_a_pipeline_plan_file_is_deterministic_and_reads_back(staged, tmp_path):
    """Same inputs, the same bytes; a pipeline's file reads back as the plan it is; a whole
    model's plan reads as itself and as a pipeline of one stage."""
    again = plan(tiny(4, tied=True), ParallelSizes(dp=2, tp=2), dp_options=SMALL,
                 stages=StageSplit(pp=2))
    assert again.to_json() == staged.to_json()
    path = save_plan(staged, tmp_path / "pp.json")
    back = load_plan(path)
    assert back == staged and back.to_json() == path.read_text()
    whole = plan(tiny(4), ParallelSizes(dp=2, tp=1), dp_options=SMALL)
    assert isinstance(whole, Plan) and "stage" not in whole.to_json()
    assert as_pipeline(whole) == (whole,) and as_pipeline(staged) == staged.stages


def test_every_stage_of_a_pipeline_file_is_checked(staged):
    """A stage's plan gets every check a plan file gets (the error names the stage), and the
    stages must be in order, of the file's pp, for one model."""
    data = json.loads(staged.to_json())
    bad = json.loads(json.dumps(data))
    bad["stages"][1]["tasks"][0]["flops"] += 1
    with pytest.raises(PlanFileError, match=r"\(stage 1\).*tasks\[0\]\.flops"):
        parse_plan(json.dumps(bad), "pp.json")
    swapped = {**data, "stages": data["stages"][::-1]}
    with pytest.raises(PlanFileError, match="stage 0 of pp 2"):
        parse_plan(json.dumps(swapped), "pp.json")
    more = {**data, "pp": 3}
    with pytest.raises(PlanFileError, match="stages holds 2 plans for pp 3"):
        parse_plan(json.dumps(more), "pp.json")
    old = {**data, "schema_version": 8}
    with pytest.raises(PlanFileError, match="schema version 9"):
        parse_plan(json.dumps(old), "pp.json")
    other = json.loads(json.dumps(data))
    other["stages"][1]["inputs"]["dp"] = 4
    with pytest.raises(PlanFileError):
        parse_plan(json.dumps(other), "pp.json")
    loose = json.loads(json.dumps(data))
    del loose["stages"][0]["inputs"]["stage"]
    loose["stages"][0]["schema_version"] = 2
    with pytest.raises(PlanFileError, match=r"stages\.0\.inputs\.stage"):
        parse_plan(json.dumps(loose), "pp.json")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The tiny tied model's Hugging Face config.json (what its plans were made from)."""
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    c = tiny(4, tied=True)
    path.write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": c.hidden, "intermediate_size": c.ffn,
        "num_hidden_layers": c.layers, "num_attention_heads": c.q_heads,
        "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab,
        "tie_word_embeddings": True}))
    return path


def test_a_stage_plan_rebuilds_its_stage_of_the_model(staged, config):
    """``rebuild_model`` finds the stage's parameters from the plan's ``inputs.stage`` (so
    inspect rebuilds a stage's problem)."""
    cfg = config
    for p in staged.stages:
        spec = rebuild_model(p, cfg)
        assert spec.fingerprint() == p.fingerprint
        report = inspect_report(p, config=cfg)
        assert report["baselines"]


def test_a_stage_without_parameters_is_planned():
    """A middle stage left without layers (the first and last stages take them all) has a plan
    of no task, which loads."""
    made = plan(tiny(4), ParallelSizes(dp=2, tp=1), dp_options=SMALL,
                stages=StageSplit(pp=3, first_stage_layers=2, last_stage_layers=2))
    assert [len(p.tasks) for p in made.stages][1] == 0
    assert parse_plan(made.to_json()) == made
    assert simulate_pipeline(made, load_hardware("h100")).steps[1].step_s == 0.0


def test_bad_stage_splits_fail_before_planning():
    with pytest.raises(SizeError, match="StageSplit.pp 3 must divide the 4 decoder layers"):
        plan(tiny(4), ParallelSizes(dp=2, tp=1), stages=StageSplit(pp=3))
    with pytest.raises(SizeError, match="need StageSplit.pp > 1"):
        plan(tiny(4), ParallelSizes(dp=2, tp=1), stages=StageSplit(first_stage_layers=1))
    with pytest.raises(SizeError, match="leaves 1 of the 4 decoder layers for 0 other stages"):
        plan(tiny(4), ParallelSizes(dp=2, tp=1),
             stages=StageSplit(pp=2, first_stage_layers=1, last_stage_layers=2))


# --- the 1F1B iteration ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(pp=st.integers(1, 6), m=st.integers(1, 12), f=st.floats(0.1, 3), b=st.floats(0.1, 3))
def test_uniform_stages_give_the_1f1b_formula(pp, m, f, b):
    """Alike stages: stage 0's last backward ends at (m + pp - 1)(f + b), stage s's s·b
    earlier."""
    ends = one_f_one_b([f] * pp, [b] * pp, m)
    for s, e in enumerate(ends):
        assert e == pytest.approx((m + pp - 1) * (f + b) - s * b)


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.tuples(st.floats(0.1, 2), st.floats(0.1, 2)), min_size=2, max_size=5),
       m=st.integers(1, 8), slower=st.integers(0, 4), by=st.floats(0.1, 2))
def test_a_slower_stage_never_ends_the_pipeline_sooner(times, m, slower, by):
    fwd, bwd = [t[0] for t in times], [t[1] for t in times]
    s = slower % len(times)
    before = one_f_one_b(fwd, bwd, m)
    bwd2 = list(bwd)
    bwd2[s] += by
    after = one_f_one_b(fwd, bwd2, m)
    assert max(after) >= max(before) - 1e-12
    assert before[0] == max(before)  # stage 0 finishes its backwards last
    # at least m forwards and m backwards of the slowest stage
    assert before[0] >= m * max(f + b for f, b in zip(fwd, bwd)) - 1e-9


def test_the_iteration_ends_with_the_slowest_stage(staged, config):
    hw = load_hardware("h100")
    sim = simulate_pipeline(staged, hw, microbatches=4)
    assert sim.iteration_s == max(sim.stage_end_s)
    assert sim.critical_stage == sim.stage_end_s.index(sim.iteration_s)
    d = stages_dict(staged, hw, microbatches=4)
    assert d["critical_stage"] == sim.critical_stage
    assert [r["end_layers"] for r in d["stages"]] == [["embedding.word_embeddings.weight"],
                                                       ["output_layer.weight"]]
    comp = compare_pipeline(None, None, stages=StageSplit(pp=2), plan=staged, microbatches=4,
                            strategies=("layerwise", "canzona"), config=config)
    assert comp.run("canzona").steps[0].step_s == pytest.approx(sim.steps[0].step_s)
    assert comp.run("canzona").iteration_s == pytest.approx(sim.iteration_s)
