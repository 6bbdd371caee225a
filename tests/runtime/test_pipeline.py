"""Pipeline parallelism in the runtime: a model split into two stages with
``torch.distributed.pipelining`` (``PipelineStage``, ``Schedule1F1B``) at pp 2 × dp 2 trains
to what one process computes (tied embeddings, Muon and Shampoo; the untied path is the tied
one without the exchange, and runs in the other cases); the stages' gradient norm, the tied
weight's two copies and a stage without parameters."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dp_helpers as H
from canzona.runtime.errors import PlanMismatchError

PP, DP = 2, 2
LAYERS = 4
MICRO = 4
STEPS = 10
CLIP = 0.3  # below the gradients' norm at every step: clipping is active


class PPGPT(nn.Module):
    """A GPT whose decoder layers are ``layers.{i}`` (what splits into stages); ``tied``: the
    output head is the embedding's tensor."""

    def __init__(self, *, tied: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(H.VOCAB, H.DIM)
        self.layers = nn.ModuleList(H.Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(H.DIM)
        self.lm_head = nn.Linear(H.DIM, H.VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.tok_embeddings.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class First(nn.Module):
    """Stage 0: the embedding and the first half of the layers, numbered from 0 (as Megatron's
    stage modules number theirs)."""

    def __init__(self, whole: PPGPT) -> None:
        super().__init__()
        self.tok_embeddings = whole.tok_embeddings
        self.layers = nn.ModuleList(whole.layers[:LAYERS // 2])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return x


class Last(nn.Module):
    """Stage 1: the other layers (their global keys kept, as torchtitan splits), the norm and
    the head (tied: its own copy of the embedding's weight)."""

    def __init__(self, whole: PPGPT, tied: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): whole.layers[i]
                                     for i in range(LAYERS // 2, LAYERS)})
        self.norm = whole.norm
        self.lm_head = nn.Linear(H.DIM, H.VOCAB, bias=False)
        self.lm_head.weight = nn.Parameter(whole.lm_head.weight.detach().clone()) if tied \
            else whole.lm_head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x))


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One microbatch's loss, scaled so that the microbatches' gradients add up to the batch's
    mean (canzona takes the gradients from the hooks, before a schedule could scale them)."""
    return F.cross_entropy(logits.reshape(-1, H.VOCAB), y.reshape(-1)) / MICRO


def groups(rank: int) -> tuple:
    """Pipeline-major ranks (rank = stage · dp + d): this rank's stage, DP index, DP group and
    pipeline group (every rank creates every group, in one order)."""
    dp_groups = [dist.new_group([s * DP + d for d in range(DP)]) for s in range(PP)]
    pp_groups = [dist.new_group([s * DP + d for s in range(PP)]) for d in range(DP)]
    s, d = divmod(rank, DP)
    return s, d, dp_groups[s], pp_groups[d]


def train_pipeline(rank: int, world: int, *, tied: bool, optimizer: str = "muon"):
    import canzona
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    s, d, dp_group, pp_group = groups(rank)
    whole = PPGPT(tied=tied)
    plan = canzona.plan_model(whole, dp=DP, pp=PP, optimizer=optimizer, bucket_size=3000,
                              **H.plan_settings(optimizer))
    module = First(whole) if s == 0 else Last(whole, tied)
    opt = canzona.CanzonaOptimizer(
        module, plan, dp_group=dp_group, pp_group=pp_group, lr=H.MATRIX_LR[optimizer],
        ns_dtype=torch.float32, adamw_lr=H.ADAMW_LR, adamw_weight_decay=0.01,
        collective_timeout=30,
        matrix_options=H.SHAMPOO_OPTIONS if optimizer == "shampoo" else None)
    stage = PipelineStage(module, s, PP, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=loss_fn, scale_grads=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    mine = H.rows(d, DP)
    norms, copies_equal = [], []
    for step in range(STEPS):
        x, y = H.batch(step, 0, DP)
        with opt.no_sync():  # every microbatch accumulates; step() reduces once
            if s == 0:
                schedule.step(x[mine])
            else:
                schedule.step(target=y[mine])
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        if tied:  # the end stages' copies, compared bit for bit over the pipeline group
            w = (module.tok_embeddings.weight if s == 0 else module.lm_head.weight).detach()
            other = torch.empty_like(w)
            peer = dist.get_global_rank(pp_group, 1 - s)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, w.clone(), peer),
                                                dist.P2POp(dist.irecv, other, peer)]):
                work.wait()
            copies_equal.append(bool(torch.equal(w, other)))
    # stage 0 numbers its layers from 0, which are the global numbers; stage 1's keys are
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    opt.close()
    return {"stage": s, "params": params, "norms": norms, "copies_equal": copies_equal}


def train_reference(*, tied: bool, optimizer: str = "muon", steps: int = STEPS,
                    dp: int = DP) -> dict:
    """One process, the whole batch: the matrix kernel per matrix, torch's AdamW on the rest,
    clipping by torch's global norm (a tied weight counts once)."""
    from canzona.runtime.introspect import inventory

    model = PPGPT(tied=tied)
    route = {p.name: p.optimizer for p in inventory(model).params}
    named = list(model.named_parameters())
    mats = [p for n, p in named if route[n] == "matrix"]
    others = [p for n, p in named if route[n] != "matrix"]
    kernel = H.matrix_kernel(optimizer, H.MATRIX_LR[optimizer])
    states = [kernel.init_state(p.shape) for p in mats]
    adamw = torch.optim.AdamW(others, lr=H.ADAMW_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, H.lr_factor)
    norms = []
    for step in range(steps):
        x, y = H.batch(step, 0, dp)
        for r in range(dp):  # the ranks' halves, each microbatch's loss / MICRO, averaged
            xs, ys = x[H.rows(r, dp)], y[H.rows(r, dp)]
            for xm, ym in zip(xs.chunk(MICRO), ys.chunk(MICRO)):
                (loss_fn(model(xm), ym) / dp).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        lr = H.MATRIX_LR[optimizer] * H.lr_factor(step)
        with torch.no_grad():
            for p, st in zip(mats, states):
                kernel.step([p], [p.grad], [st], lr=lr)
        adamw.step()
        sched.step()
        model.zero_grad()
    return {"params": H.params_of(model), "norms": norms}


CASES = [("tied-muon", functools.partial(train_pipeline, tied=True)),
         ("tied-shampoo", functools.partial(train_pipeline, tied=True, optimizer="shampoo"))]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pp"))
    ckpt = ("checkpoints", functools.partial(checkpoints_across_pp, folder=out))
    return H.run_world(PP * DP, [*CASES, ckpt], out)


def _whole(ranks: list, tied: bool) -> dict[str, torch.Tensor]:
    """The trained model under the whole model's names, from DP index 0 of each stage."""
    first, last = ranks[0], ranks[DP]
    out = dict(first["params"])
    for name, p in last["params"].items():
        if name == "lm_head.weight" and tied:
            continue
        out[name] = p
    return out


@pytest.mark.parametrize("case, tied, optimizer", [("tied-muon", True, "muon"),
                                                     ("tied-shampoo", True, "shampoo")])
def test_a_pipeline_trains_as_one_process(world, case, tied, optimizer):
    """pp 2 × dp 2 with 1F1B, clipping active: every parameter within 1e-5 of one process, the
    norm summed over both stages (a tied weight once), the tied copies bit-identical."""
    ranks = H.results(world, case)
    ref = train_reference(tied=tied, optimizer=optimizer)
    got = _whole(ranks, tied)
    assert set(got) == set(ref["params"])
    err = H.max_rel_err(got, ref["params"])
    assert H.is_close_rel(err), f"{case}: max relative error {err:.2e}"
    for r in ranks:
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert all(n > CLIP for n in r["norms"])
        if tied:
            assert all(r["copies_equal"])
    for d in range(DP):  # every DP rank of a stage holds the same parameters
        for k in ranks[d]["params"]:
            assert torch.equal(ranks[d]["params"][k], ranks[0]["params"][k])


# --- pp 4 with two stages without parameters; bad input ----------------------------------------


class Middle(nn.Module):
    """A stage left without layers (the first and last stages take them all): no parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def train_empty_stages(rank: int, world: int):
    """pp 4 × dp 1: stages 1 and 2 hold nothing; the others train as one process."""
    import canzona
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    singles = [dist.new_group([r]) for r in range(world)]
    pp_group = dist.new_group(list(range(world)))
    whole = PPGPT(tied=True)
    plan = canzona.plan_model(whole, dp=1, pp=4, first_stage_layers=LAYERS // 2,
                              last_stage_layers=LAYERS // 2, bucket_size=3000)
    module = First(whole) if rank == 0 else Last(whole, True) if rank == 3 else Middle()
    opt = canzona.CanzonaOptimizer(module, plan, dp_group=singles[rank], pp_group=pp_group,
                                   lr=H.MATRIX_LR["muon"], ns_dtype=torch.float32,
                                   adamw_lr=H.ADAMW_LR, adamw_weight_decay=0.01,
                                   collective_timeout=30)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=loss_fn, scale_grads=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    norms = []
    for step in range(3):
        x, y = H.batch(step, 0, 1)
        with opt.no_sync():
            if rank == 0:
                schedule.step(x)
            elif rank == 3:
                schedule.step(target=y)
            else:
                schedule.step()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    opt.close()
    return {"params": params, "norms": norms}


def wrong_stage_module(rank: int, world: int) -> str:
    """Every rank gives the other stage's module: refused before any step, naming a parameter."""
    import canzona

    s, d, dp_group, pp_group = groups(rank)
    whole = PPGPT(tied=False)
    plan = canzona.plan_model(whole, dp=DP, pp=PP, bucket_size=3000)
    module = Last(whole, False) if s == 0 else First(whole)
    try:
        canzona.CanzonaOptimizer(module, plan, dp_group=dp_group, pp_group=pp_group)
    except PlanMismatchError as exc:
        return str(exc)
    return "accepted"


CASES += [("empty-stages", train_empty_stages), ("wrong-module", wrong_stage_module)]


def test_stages_without_parameters_train_alongside(world):
    ranks = H.results(world, "empty-stages")
    assert ranks[1]["params"] == {} and ranks[2]["params"] == {}
    ref = train_reference(tied=True, steps=3, dp=1)
    got = dict(ranks[0]["params"])
    got.update({k: v for k, v in ranks[3]["params"].items() if k != "lm_head.weight"})
    assert H.is_close_rel(H.max_rel_err(got, ref["params"]))
    assert torch.equal(ranks[3]["params"]["lm_head.weight"], got["tok_embeddings.weight"])
    for r in ranks:
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)


def test_a_stage_module_that_is_not_its_plan_is_refused(world):
    for msg in H.results(world, "wrong-module"):
        assert msg != "accepted" and "\n" not in msg
        assert "layers." in msg or "tok_embeddings" in msg or "lm_head" in msg, msg


def test_a_pipeline_plan_needs_the_pipeline_group():
    import canzona

    whole = PPGPT(tied=False)
    plan = canzona.plan_model(whole, dp=1, pp=2, bucket_size=3000)
    with pytest.raises(PlanMismatchError, match="pass pp_group="):
        canzona.CanzonaOptimizer(First(whole), plan)
    with pytest.raises(PlanMismatchError, match="pass pp_group="):
        canzona.CanzonaOptimizer(First(whole), plan.stage(0))


# --- checkpoints across pipeline sizes ------------------------------------------------------------


def _pp_segment(rank: int, world: int, steps: range, folder: str, *, save: str | None,
                load: str | None) -> dict:
    """pp 2 × dp 2 training of the tied model over ``steps``, from checkpoint ``load`` and to
    ``save`` (either may be None)."""
    import canzona
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    s, d, dp_group, pp_group = groups(rank)
    whole = PPGPT(tied=True)
    plan = canzona.plan_model(whole, dp=DP, pp=PP, bucket_size=3000)
    module = First(whole) if s == 0 else Last(whole, True)
    opt = canzona.CanzonaOptimizer(module, plan, dp_group=dp_group, pp_group=pp_group,
                                   lr=H.MATRIX_LR["muon"], ns_dtype=torch.float32,
                                   adamw_lr=H.ADAMW_LR, adamw_weight_decay=0.01,
                                   collective_timeout=30)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    if load:
        canzona.load_checkpoint(f"{folder}/{load}", module, opt, extra={"sched": sched})
    schedule = Schedule1F1B(PipelineStage(module, s, PP, torch.device("cpu"), group=pp_group),
                            MICRO, loss_fn=loss_fn, scale_grads=False)
    mine = H.rows(d, DP)
    for step in steps:
        x, y = H.batch(step, 0, DP)
        with opt.no_sync():
            schedule.step(x[mine]) if s == 0 else schedule.step(target=y[mine])
        opt.clip_grad_norm_(CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    if save:
        canzona.save_checkpoint(f"{folder}/{save}", module, opt, extra={"sched": sched})
    out = {name: p.detach().clone() for name, p in module.named_parameters()}
    opt.close()
    return out


def _dp_segment(rank: int, world: int, steps: range, folder: str, *, save: str | None,
                load: str | None) -> dict:
    """pp 1 × dp 4: the whole tied model on every rank, a quarter of each batch each."""
    import canzona

    whole = PPGPT(tied=True)
    plan = canzona.plan_model(whole, dp=world, bucket_size=3000)
    opt = canzona.CanzonaOptimizer(whole, plan, lr=H.MATRIX_LR["muon"], ns_dtype=torch.float32,
                                   adamw_lr=H.ADAMW_LR, adamw_weight_decay=0.01,
                                   collective_timeout=30)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    if load:
        canzona.load_checkpoint(f"{folder}/{load}", whole, opt, extra={"sched": sched})
    mine = H.rows(rank, world)
    for step in steps:
        x, y = H.batch(step, 0, world)
        logits = whole(x[mine])
        F.cross_entropy(logits.reshape(-1, H.VOCAB), y[mine].reshape(-1)).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    if save:
        canzona.save_checkpoint(f"{folder}/{save}", whole, opt, extra={"sched": sched})
    out = H.params_of(whole)
    opt.close()
    return out


#: Steps of the runs resumed across pipeline sizes (half before the checkpoint).
RESUMED = 6


def checkpoints_across_pp(rank: int, world: int, folder: str) -> dict:
    """pp 2 → pp 1 and pp 1 → pp 2, each resumed halfway through :data:`RESUMED` steps."""
    first = range(0, RESUMED // 2)
    rest = range(RESUMED // 2, RESUMED)
    _pp_segment(rank, world, first, folder, save="pp2", load=None)
    pp2_to_pp1 = _dp_segment(rank, world, rest, folder, save=None, load="pp2")
    _dp_segment(rank, world, first, folder, save="pp1", load=None)
    pp1_to_pp2 = _pp_segment(rank, world, rest, folder, save=None, load="pp1")
    return {"pp2_to_pp1": pp2_to_pp1, "pp1_to_pp2": pp1_to_pp2}


def test_a_checkpoint_resumes_across_pipeline_sizes(world):
    """Saved at pp 2 (each stage its parameters; the tied copy under the embedding's keys) and
    resumed at pp 1, and the reverse, halfway through: within 1e-5 of the run without a
    break."""
    ref = train_reference(tied=True, dp=4, steps=RESUMED)["params"]
    ranks = H.results(world, "checkpoints")
    for r in ranks:
        assert H.is_close_rel(H.max_rel_err(r["pp2_to_pp1"], ref))
    got = dict(ranks[0]["pp1_to_pp2"])
    got.update({k: v for k, v in ranks[DP]["pp1_to_pp2"].items() if k != "lm_head.weight"})
    assert H.is_close_rel(H.max_rel_err(got, ref))
    assert torch.equal(ranks[DP]["pp1_to_pp2"]["lm_head.weight"], got["tok_embeddings.weight"])


# --- what the stages agree on; a plan of another pipeline ----------------------------------------


def nonfinite_on_one_stage(rank: int, world: int) -> str:
    """At the second step the last stage's norm gets a NaN gradient (its own parameter: stage 0
    sees nothing wrong). Every rank of both stages raises, before anything is updated."""
    import canzona
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from canzona.runtime.optim._base import NonFiniteGradientError

    s, d, dp_group, pp_group = groups(rank)
    whole = PPGPT(tied=False)
    plan = canzona.plan_model(whole, dp=DP, pp=PP, bucket_size=3000)
    module = First(whole) if s == 0 else Last(whole, False)
    opt = canzona.CanzonaOptimizer(module, plan, dp_group=dp_group, pp_group=pp_group,
                                   collective_timeout=30)
    schedule = Schedule1F1B(PipelineStage(module, s, PP, torch.device("cpu"), group=pp_group),
                            MICRO, loss_fn=loss_fn, scale_grads=False)
    mine = H.rows(d, DP)
    after: dict[str, torch.Tensor] = {}
    for step in range(2):
        if step == 1 and s == 1:
            module.norm.weight.register_hook(lambda g: g * float("nan"))
        x, y = H.batch(step, 0, DP)
        with opt.no_sync():
            schedule.step(x[mine]) if s == 0 else schedule.step(target=y[mine])
        try:
            opt.clip_grad_norm_(CLIP)
            opt.step()
        except NonFiniteGradientError as exc:
            same = all(torch.equal(p, after[n]) for n, p in module.named_parameters())
            opt.close()
            return f"raised at step {step}: {exc}; unchanged={same}"
        after = {n: p.detach().clone() for n, p in module.named_parameters()}
        opt.zero_grad()
    opt.close()
    return "no error"


def plan_of_another_pipeline(rank: int, world: int) -> str:
    """A pp 2 plan with the whole world (4 ranks) as the pipeline group: one line, before any
    collective."""
    import canzona

    whole = PPGPT(tied=False)
    plan = canzona.plan_model(whole, dp=DP, pp=PP, bucket_size=3000)
    try:
        canzona.CanzonaOptimizer(First(whole), plan, pp_group=dist.group.WORLD)
    except PlanMismatchError as exc:
        return str(exc)
    return "accepted"


CASES += [("nonfinite", nonfinite_on_one_stage), ("other-pp", plan_of_another_pipeline)]


def test_a_stage_that_raises_makes_every_stage_raise(world):
    for r, msg in enumerate(H.results(world, "nonfinite")):
        assert msg.startswith("raised at step 1") and msg.endswith("unchanged=True"), (r, msg)
        if r >= DP:  # the stage with the NaN names the parameter; the other names the stage
            assert "norm.weight" in msg
        else:
            assert "on pipeline stage(s) 1" in msg


def test_a_plan_for_another_pipeline_is_refused(world):
    for msg in H.results(world, "other-pp"):
        assert msg == ("pp_group has 4 ranks but the plan has 2 pipeline stages: pass the group "
                       "of this rank's stages, one rank each.")
