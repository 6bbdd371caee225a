"""A Megatron-core Qwen3-MoE-style GPTModel trained by canzona under expert parallelism in a
spawned gloo world, and the one-process reference with every expert on one rank.

Every rank loads the same canonical weights (the planner's full views, every expert by its
global index; a rank of EP rank k takes experts [k·E/ep, (k+1)·E/ep) as its ``local_experts``).
Each DP rank takes its own tokens; Megatron's ``allgather`` token dispatcher (megatron-core
0.16.1's alltoall dispatcher creates CUDA streams) sends them to the EP rank of their expert.
The reference concatenates the DP ranks' batches in one ep = 1 model: its gradient is their
average, the Muon kernel (float32 Newton–Schulz) updates every matrix, every expert included,
``torch.optim.AdamW`` the rest.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

import megatron_train as train
from canzona.planner.models import ModelConfig

#: Qwen3-MoE-style: QK layernorm, GQA 4:2, 4 experts of width 32, top-2; float32 (exactness).
CFG = ModelConfig(name="qwen3-moe-megatron-tiny", arch="qwen3_moe", hidden=64, ffn=0, layers=2,
                  q_heads=4, kv_heads=2, head_dim=16, vocab=1000, tied_embeddings=False,
                  qk_norm=True, num_experts=4, experts_per_token=2, moe_ffn=32, dtype="fp32")
STEPS = 10
LR, ADAMW_LR = 0.02, 3e-3
#: per matrix optimizer: its learning rate, the plan's settings and the kernel's options (Shampoo's
#: ε regularises the inverse roots of the experts' rank-deficient statistics)
OPTIMIZERS = {"muon": (LR, {}, {}),
              "shampoo": (0.01, {"shampoo_precondition_frequency": 3},
                          {"precondition_frequency": 3, "eps": 1e-4})}


def kernel(optimizer: str):
    """The reference's matrix kernel (float32 Newton–Schulz for Muon)."""
    from canzona.runtime.optim import Muon, MuonConfig, Shampoo, ShampooConfig

    lr, _, options = OPTIMIZERS[optimizer]
    if optimizer == "muon":
        return Muon(MuonConfig(lr=lr, ns_dtype=torch.float32))
    return Shampoo(ShampooConfig(lr=lr, **options))
CLIP = 0.5  # below the gradients' global norm: clipping is active every step
_LOCAL = re.compile(r"\.local_experts\.(\d+)\.")


def global_name(name: str, offset: int) -> str:
    return _LOCAL.sub(lambda m: f".local_experts.{int(m[1]) + offset}.", name, count=1)


def load_canonical(gpt: torch.nn.Module, tp: int, tp_rank: int, offset: int,
                   etp: int | None = None) -> None:
    """This rank's experts (its first one global index ``offset``) and TP shards."""
    train.load_canonical(gpt, tp, tp_rank, CFG, lambda n: global_name(n, offset), etp)


def tokens(dp_rank: int) -> torch.Tensor:
    return train.tokens(dp_rank, "megatron-moe")


def _expert_offset(gpt: torch.nn.Module) -> int:
    for m in gpt.modules():
        if getattr(m, "local_expert_indices", None):
            return int(m.local_expert_indices[0])
    return 0


def train_ep(rank: int, *, dp: int, tp: int, ep: int, init: str, optimizer: str = "muon",
             wrong_group: bool = False, steps: int = STEPS, etp: int | None = None,
             save: str | None = None, resume: str | None = None) -> dict:
    """Rank ``rank`` of a Megatron world (Megatron's dp: the world over tp) with ``ep``-way
    expert parallelism (expert TP ``etp``, default tp), trained by CanzonaOptimizer with
    clipping. ``wrong_group``: the expert buckets reduced over the whole DP group instead of the
    expert-DP group (must fail); ``save``/``resume``: a logical checkpoint folder written after
    the steps / loaded before them."""
    import canzona
    from canzona.runtime.errors import WeightsDifferError
    from megatron.core import parallel_state as ps
    from megatron_stubs import gpt_model, megatron_world, torch_norms_under_sequence_parallelism

    with megatron_world(dp, tp, ep=ep, etp=etp, backend="gloo", rank=rank, init_method=init,
                        timeout_s=60):
        # Megatron runs MoE under TP only with sequence parallelism
        with torch_norms_under_sequence_parallelism():
            _, gpt = gpt_model(CFG, tp, ep, moe_token_dispatcher_type="allgather",
                               sequence_parallel=tp > 1,
                               **({"expert_tensor_parallel_size": etp} if etp else {}))
        tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
        offset = _expert_offset(gpt)
        load_canonical(gpt, tp, tp_rank, offset, etp)
        lr, settings, options = OPTIMIZERS[optimizer]
        # a checkpoint keeps the logical vocabulary's rows: the padded one is logical here, as
        # the padded output rows enter the loss's softmax and are trained
        plan = canzona.plan_model(gpt, dp=dp, vocab=None if save or resume else CFG.vocab,
                                  comm_dtype="fp32",
                                  optimizer=optimizer, bucket_size=20000, **settings)
        # the wrong group has the right size: the EP group, whose ranks hold other experts
        edp_group = (ps.get_expert_model_parallel_group() if wrong_group
                     else ps.get_expert_data_parallel_group())
        losses = []
        kwargs = dict(tp_group=tp_group if tp > 1 else None, dp_group=dp_group,
                      ns_dtype=torch.float32, lr=lr, adamw_lr=ADAMW_LR,
                      adamw_weight_decay=0.01, collective_timeout=60, optimizer=optimizer,
                      matrix_options={k: v for k, v in options.items()
                                      if k != "precondition_frequency"} or None)
        refused = ""
        if wrong_group:  # the weights check sees other experts; forced, the run goes wrong
            try:
                canzona.CanzonaOptimizer(gpt, plan, expert_dp_group=edp_group, **kwargs).close()
            except WeightsDifferError as exc:
                refused = str(exc)
            kwargs["sync_init"] = True
        opt = canzona.CanzonaOptimizer(gpt, plan, expert_dp_group=edp_group, **kwargs)
        if resume:
            canzona.load_checkpoint(resume, gpt, opt)
        with opt:
            for _ in range(steps):
                loss = train.forward_loss(gpt, tokens(dp_rank))
                loss.backward()
                opt.clip_grad_norm_(CLIP)
                opt.step()
                opt.zero_grad()
                mean = loss.detach().clone()
                dist.all_reduce(mean, group=dp_group)
                losses.append(float(mean) / dp)
            opt.finish()
            if save:
                canzona.save_checkpoint(save, gpt, opt)
        experts = train.gather_canonical(gpt, tp, tp_group, CFG,
                                         lambda n: global_name(n, offset), etp)
        return {"losses": losses, "weights": experts, "ep": plan.inputs.ep, "refused": refused,
                "etp": plan.inputs.etp,
                "expert_buffers": sum(b.expert for b in plan.buffers)}


def reference(rank: int, *, dp: int, init: str, optimizer: str = "muon",
              steps: int = STEPS) -> dict:
    """One process, ep = 1: every DP rank's batch concatenated; the matrix kernel on every matrix
    (every expert too), AdamW on the rest; the global norm clipped as canzona does."""
    from megatron_stubs import gpt_model, megatron_world

    with megatron_world(1, 1, backend="gloo", rank=0, init_method=init, timeout_s=60):
        _, gpt = gpt_model(CFG, 1, 1, moe_token_dispatcher_type="allgather")
        load_canonical(gpt, 1, 0, 0)
        losses = train.reference_steps(
            gpt, kernel(optimizer), OPTIMIZERS[optimizer][0],
            lambda: torch.cat([tokens(d) for d in range(dp)]), steps, clip=CLIP)
        return {"losses": losses, "weights": train.gather_canonical(gpt, 1, None, CFG)}
