"""Train a Megatron-core GPTModel with canzona in place of Megatron's DDP and distributed optimizer.

    torchrun --standalone --nproc-per-node 4 examples/train_megatron.py --tp 2   # dp 2 × tp 2
    torchrun --standalone --nproc-per-node 2 examples/train_megatron.py --tp 2   # dp 1 × tp 2
    torchrun --standalone --nproc-per-node 2 examples/train_megatron.py --tp 1   # dp 2
    torchrun --standalone --nproc-per-node 4 examples/train_megatron.py --tp 1 --ep 2  # MoE
    torchrun --standalone --nproc-per-node 4 examples/train_megatron.py --tp 2 --qk-clip 0.25 \
        --no-qk-layernorm                                                     # MuonClip
    torchrun --standalone --nproc-per-node 2 examples/train_megatron.py --tp 1 --pp 2  # stages
    torchrun --standalone --nproc-per-node 4 examples/train_megatron.py --tp 1 --pp 2 --tied


Needs megatron-core (``pip install 'canzona[runtime,megatron]'``; 0.16.1 on Python 3.11). The
model is Qwen3-style (RMSNorm, grouped-query attention with QK layernorm, gated SwiGLU, no biases,
RoPE) built with Megatron's local layer spec, its vocabulary padded as Megatron's training script
pads it. ``canzona.plan_model(gpt, dp=, vocab=)`` reads the TransformerConfig (TP size, fused QKV
and gate/up layouts, the vocabulary-parallel embedding and output layer) and plans; ``--plan FILE``
takes a plan saved before instead (``canzona.save_plan`` or the CLI with a matching config; the
parameter names are Megatron's). ``CanzonaOptimizer`` gets Megatron's TP and DP groups: it
reduce-scatters the gradients over DP in Megatron's bucket layout, updates whole matrices (each
TP-split one gathered to its host TP rank in micro-groups), sums the QK layernorm gradients over
TP as Megatron does, and all-gathers the parameters. Megatron's DDP wrapper is not used.

With ``--ep N`` the MLPs are mixtures of ``--experts`` (default 4) per-expert SwiGLUs, top-2
routed (Qwen3-MoE style), each rank holding E/N of them: the expert gradients are reduced over
Megatron's expert-data-parallel group (dp/ep ranks), the rest over DP. Megatron runs MoE under TP
only with sequence parallelism, which its local layer spec does not offer: ``--ep`` needs
``--tp 1`` here. The token dispatcher is ``allgather`` on CPU (megatron-core 0.16.1's
``alltoall`` dispatcher creates CUDA streams), ``alltoall`` on GPUs.

On a machine without GPUs the script runs on CPU with gloo: ``torch.cuda.current_device`` is
pointed at the CPU while the model is built (Megatron allocates a few tensors there), Megatron's
RNG trackers are seeded without CUDA, and attention gets an explicit causal mask. Data: arithmetic
progressions (each DP rank its own), so the loss falls within 100 steps.

``--qk-clip TAU`` (MuonClip): forward hooks record each attention layer's largest logit per query
head (``canzona.runtime.qk_clip.record_max_logits``), and after every step ``opt.qk_clip_``
reduces them over DP and scales the query and key rows of the KV groups above TAU. With QK
layernorm (the default Qwen3-style model) the scaling does not reach the logits: QK-clip is for
attention without it (``--no-qk-layernorm``).
``--qkv-split heads`` orthogonalises each attention head alone.

``--pp N`` splits the layers into N pipeline stages and trains with Megatron's own 1F1B schedule
(``get_forward_backward_func``, ``--microbatches`` per step): each rank builds its stage's
module (Megatron's ``pre_process``/``post_process``), ``plan_model`` of it gives the whole model's
plan with a section per stage, and ``CanzonaOptimizer(..., pp_group=)`` runs its stage's (the
clipping norm over every stage; with ``--tied``, the last stage's copy of the embedding kept
identical). The schedule runs under ``opt.no_sync()`` and ``step()`` reduces once; Megatron's
``finalize_model_grads`` is not needed (canzona reduces the gradients). On CPU, Megatron's
schedule and point-to-point code assume CUDA in three more places, pointed at the CPU by
``_cpu_pipeline``: ``torch.cuda.synchronize()`` after the batched sends and receives, the
schedule's ``torch.zeros(..., device="cuda")`` token count, and ``weight.data.cuda()`` of a tied
copy while the model is built.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import canzona
from canzona.planner.layout import padded_vocab
from canzona.runtime.qk_clip import record_max_logits


@contextlib.contextmanager
def _cpu_device(cuda: bool):
    """Megatron asks ``torch.cuda.current_device()`` for a device (buffers, RoPE): the CPU here."""
    if cuda:
        yield
        return
    # megatron-core 0.16.1's MoE router names Transformer Engine's GEMM only where it imports
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


class _CpuSchedulesTorch:
    """``torch`` for Megatron's pipeline schedules on CPU: ``zeros(device="cuda")`` on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


@contextlib.contextmanager
def _cpu_pipeline(cuda: bool, pp: int):
    """Megatron's pipeline schedule, its point-to-point code and a tied copy's set-up assume
    CUDA in three places (module docstring): the CPU here, for pp > 1 without GPUs."""
    if cuda or pp == 1:
        yield
        return
    from megatron.core.pipeline_parallel import schedules

    saved = [(torch.cuda, "synchronize", torch.cuda.synchronize),
             (schedules, "torch", schedules.torch), (torch.Tensor, "cuda", torch.Tensor.cuda)]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    schedules.torch = _CpuSchedulesTorch()  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def build_gpt(args, tp: int, cuda: bool):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    stages = dict(pipeline_model_parallel_size=args.pp, pipeline_dtype=dtype) if args.pp > 1 \
        else {}
    moe = {}
    if args.experts:
        moe = dict(num_moe_experts=args.experts, moe_ffn_hidden_size=args.moe_ffn,
                   moe_router_topk=2, expert_model_parallel_size=args.ep,
                   moe_token_dispatcher_type="alltoall" if cuda else "allgather")
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, num_query_groups=args.kv_heads, kv_channels=args.head_dim,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=not args.no_qk_layernorm,
        tensor_model_parallel_size=tp, use_cpu_initialization=not cuda, params_dtype=dtype,
        bf16=args.bf16, hidden_dropout=0.0, attention_dropout=0.0, **moe, **stages)
    spec = get_gpt_layer_local_spec(num_experts=args.experts or None,
                                    qk_layernorm=not args.no_qk_layernorm, normalization="RMSNorm")
    gpt = GPTModel(config=config, transformer_layer_spec=spec,
                   vocab_size=padded_vocab(args.vocab, tp), max_sequence_length=args.seq,
                   position_embedding_type="rope", share_embeddings_and_output_weights=args.tied,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    # every parameter bf16, as Megatron's get_model wraps it; canzona keeps fp32 mains
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, gpt), gpt
    return gpt, gpt


def progressions(gen: torch.Generator, batch: int, seq: int, vocab: int):
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 5, (batch, 1), generator=gen)
    data = (start + stride * torch.arange(seq + 1)) % vocab
    return data[:, :-1], data[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the world)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE; --tp 1)")
    ap.add_argument("--experts", type=int, help="experts per MoE layer (default: 4 with --ep > 1, "
                                                "else a dense model)")
    ap.add_argument("--moe-ffn", type=int, default=96, help="each expert's ffn size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (Megatron's 1F1B)")
    ap.add_argument("--microbatches", type=int, default=4, help="per step, with --pp > 1")
    ap.add_argument("--tied", action="store_true", help="tied input and output embeddings")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"])
    ap.add_argument("--plan", help="a saved plan for this model and sizes (default: plan_model)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=352)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32, help="≠ hidden/heads, as Qwen3")
    ap.add_argument("--vocab", type=int, default=1000, help="the tokenizer's (before padding)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="sequences per DP rank")
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 main copies")
    ap.add_argument("--qkv-split", default="fused", choices=["fused", "qkv", "heads"],
                    help="orthogonalise the fused QKV whole, as Q, K and V, or head by head")
    ap.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                    help="QK-clip after every step: KV groups whose largest attention logit "
                         "exceeds TAU have their query and key rows scaled down")
    ap.add_argument("--no-qk-layernorm", action="store_true",
                    help="attention without QK layernorm (where QK-clip reaches the logits)")
    ap.add_argument("--qk-clip-alpha", type=float, default=0.5,
                    help="the query rows' share of the QK-clip scaling")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="megatron")  # no Transformer Engine / Apex here
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.tp < 1 or args.pp < 1 or world % (args.tp * args.pp):
        raise SystemExit(f"--tp {args.tp} × --pp {args.pp} must divide the world size {world}")
    dp = world // (args.tp * args.pp)
    if args.pp > 1 and (args.ep > 1 or args.qk_clip is not None or args.plan):
        raise SystemExit("--pp runs dense models without --qk-clip or --plan here")
    if args.pp > 1 and args.batch % args.microbatches:
        raise SystemExit(f"--microbatches {args.microbatches} must divide --batch {args.batch}")
    if args.experts is None:
        args.experts = 4 if args.ep > 1 else 0
    if args.ep < 1 or dp % args.ep or (args.ep > 1 and args.experts % args.ep):
        raise SystemExit(f"--ep {args.ep} must divide the DP size {dp} and --experts "
                         f"{args.experts}")
    if args.experts and args.tp > 1:
        raise SystemExit("--ep/--experts need --tp 1: Megatron runs MoE under TP only with "
                         "sequence parallelism, which its local layer spec does not offer")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # the whole run: RoPE asks for the device in every forward
    with _cpu_device(cuda), _cpu_pipeline(cuda, args.pp):
        train(args, dp, rank, cuda)
    dist.destroy_process_group()


def train(args, dp: int, rank: int, cuda: bool) -> None:
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             expert_model_parallel_size=args.ep,
                                             pipeline_model_parallel_size=args.pp)
    # the same initial weights on every rank, as Megatron's _set_random_seed
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=not cuda)
    model, gpt = build_gpt(args, args.tp, cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model.to(device)

    if args.plan:
        plan = canzona.load_plan(args.plan)
    else:
        plan = canzona.plan_model(gpt, dp=dp, vocab=args.vocab, optimizer=args.optimizer,
                                  qkv_split=args.qkv_split)
    optimizer = getattr(plan, "stages", (plan,))[0].inputs.optimizer.name  # the plan's
    opt = canzona.CanzonaOptimizer(
        gpt, plan, lr=0.02 if optimizer == "muon" else 3e-3, adamw_lr=3e-3,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        expert_dp_group=parallel_state.get_expert_data_parallel_group() if args.ep > 1 else None,
        pp_group=parallel_state.get_pipeline_model_parallel_group() if args.pp > 1 else None,
        main_params="fp32" if args.bf16 else None)
    if args.pp > 1:
        train_stages(args, gpt, plan, opt, device)
        opt.close()
        parallel_state.destroy_model_parallel()
        return
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    if rank == 0:
        groups = [len(ix.groups) for ix in plan.tp.indices] if plan.tp else []
        experts = f" ep={args.ep} ({args.experts} experts)" if args.experts else ""
        print(f"Megatron GPTModel dp={dp} tp={args.tp}{experts}: {plan.total_params:,} params "
              f"(vocabulary {args.vocab} padded to {gpt.vocab_size}), "
              f"{plan.inputs.optimizer.name}; micro-groups per DP index {groups}", flush=True)

    # QK-clip: the largest attention logit per query head, recorded by forward hooks on
    # Megatron's attention (it records none on CPU), reduced over DP by qk_clip_
    logits = record_max_logits(gpt) if args.qk_clip else None
    mask = torch.ones(args.seq, args.seq, dtype=torch.bool, device=device).triu(1)[None, None]
    pos = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)
    gen = torch.Generator().manual_seed(1234 + parallel_state.get_data_parallel_rank())
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in progressions(gen, args.batch, args.seq, args.vocab))
        loss = model(x, pos, mask, labels=y).float().mean()  # per-token losses, [batch, seq]
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        top = ""
        if logits is not None:
            peak = opt.qk_clip_(logits.pop(), threshold=args.qk_clip, alpha=args.qk_clip_alpha)
            top = f"  max logit {peak:.2f}"
        sched.step()
        opt.zero_grad()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}{top}  "
                  f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.0f} ms/step", flush=True)
    opt.close()  # wait for the optimizer's collectives before tearing the groups down
    parallel_state.destroy_model_parallel()


def train_stages(args, gpt, plan, opt, device) -> None:
    """--pp > 1: Megatron's 1F1B schedule on this rank's stage, canzona's step after it."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    last = ps.is_pipeline_last_stage()
    talks = last and ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    if dist.get_rank() == 0:
        layers = [p.inputs.stage.layers for p in plan.stages]
        print(f"Megatron GPTModel pp={args.pp} × dp={plan.stages[0].inputs.dp} × tp={args.tp}: "
              f"layers per stage {layers}, {plan.stages[0].inputs.optimizer.name}"
              + (", tied embeddings" if args.tied else ""), flush=True)
    mbs = args.batch // args.microbatches
    mask = torch.ones(args.seq, args.seq, dtype=torch.bool, device=device).triu(1)[None, None]
    pos = torch.arange(args.seq, device=device)[None].expand(mbs, -1)

    def forward_step(data, model):
        x, y = next(data)
        out = model(x, pos, mask, labels=y)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    gen = torch.Generator().manual_seed(1234 + ps.get_data_parallel_rank())
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in progressions(gen, args.batch, args.seq, args.vocab))
        with opt.no_sync():  # every microbatch accumulates; step() reduces once
            out = fwd_bwd(forward_step_func=forward_step,
                          data_iterator=iter(zip(x.split(mbs), y.split(mbs))), model=[gpt],
                          num_microbatches=args.microbatches, seq_length=args.seq,
                          micro_batch_size=mbs, forward_only=False)
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if talks and (step % 20 == 0 or step == args.steps - 1):
            loss = sum(float(o["loss"]) for o in out) / len(out)
            print(f"step {step:4d}  loss {loss:.4f}  grad norm {norm.item():.3f}  "
                  f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.0f} ms/step", flush=True)


if __name__ == "__main__":
    main()
