"""A Hugging Face model trained with canzona under ``transformers.Trainer`` (or a hand-written
loop on the same batches), CPU, gloo:

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py [--loop trainer|manual]
             [--model qwen3|qwen3-moe] [--steps 8] [--accum 1] [--json]

The Trainer gets the optimizer through ``optimizers=(opt, scheduler)``;
``canzona.hf.CanzonaTrainer`` keeps the model out of DDP (canzona reduce-scatters the gradients
itself), sets the Trainer's own clipping aside (``max_grad_norm=0``: it would clip local, unreduced
gradients) and clips the global norm with ``opt.clip_grad_norm_``. ``--loop manual`` runs canzona's
usual loop on the batches the Trainer's data loader gives this rank, epoch after epoch as the
Trainer takes them: the two print the same steps, once each, with the same loss and gradient norm.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import canzona

VOCAB, SEQ, SAMPLES, LR, ADAMW_LR, CLIP = 96, 16, 256, 0.02, 3e-3, 1.0


class Tokens(Dataset):
    """Counting sequences from random starts (token t+1 = token t + 1, mod the vocabulary): a
    pattern the model learns in a few steps. The same on every rank (the Trainer shards them)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
        self.x = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def build(which: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
                  attn_implementation="eager")
    torch.manual_seed(0)
    if which == "qwen3-moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[], **common))
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=64, **common))


def main() -> None:
    from transformers import PrinterCallback, TrainerCallback, TrainingArguments

    from canzona.hf import CanzonaTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", choices=("trainer", "manual"), default="trainer")
    ap.add_argument("--model", choices=("qwen3", "qwen3-moe"), default="qwen3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON line per step")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build(a.model)
    plan = canzona.plan_model(model, dp=world)
    opt = canzona.CanzonaOptimizer(model, plan, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.05 * s)
    args = TrainingArguments(
        output_dir="/tmp/canzona-train-hf", per_device_train_batch_size=4, max_steps=a.steps,
        gradient_accumulation_steps=a.accum, logging_steps=1, max_grad_norm=0.0, report_to=[],
        use_cpu=True, save_strategy="no", seed=0, dataloader_drop_last=True,
        average_tokens_across_devices=False, disable_tqdm=True, log_level="warning")
    rows: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                rows.append({"step": state.global_step, "loss": float(logs["loss"]),
                             "grad_norm": float(logs["grad_norm"])})

    trainer = CanzonaTrainer(model=model, args=args, train_dataset=Tokens(),
                             optimizers=(opt, sched), clip_grad_norm=CLIP, callbacks=[Record()])
    trainer.remove_callback(PrinterCallback)  # the rows below are the one record of each step
    if a.loop == "trainer":
        trainer.train()
    else:  # canzona's loop on the batches the Trainer's loader gives this rank
        groups = _update_steps(trainer.get_train_dataloader(), a.accum)
        for step in range(1, a.steps + 1):
            group = next(groups)
            total = torch.zeros(())
            for micro, b in enumerate(group):
                ctx = opt.no_sync() if micro < len(group) - 1 else _Null()
                with ctx:
                    loss = model(**b).loss / len(group)
                    loss.backward()
                total += loss.detach()
            norm = float(opt.clip_grad_norm_(CLIP))
            opt.step()
            sched.step()
            opt.zero_grad()
            dist.all_reduce(total)
            rows.append({"step": step, "loss": float(total) / world, "grad_norm": norm})
    if rank == 0:
        for r in rows:
            print(json.dumps(r) if a.json else
                  f"step {r['step']:3d}  loss {r['loss']:.6f}  grad norm {r['grad_norm']:.6f}",
                  flush=True)
    opt.close()
    dist.destroy_process_group()


def _update_steps(loader, accum: int) -> Iterator[list]:  # noqa: ANN001
    """The micro-batches of each optimizer step, as the Trainer takes them from ``loader``: epoch
    after epoch, each reshuffled by its number as the Trainer does (``set_epoch``), ``accum`` at a
    time, the last step of an epoch with the rest when ``accum`` does not divide it."""
    epoch = 0
    while True:
        inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        for sampler in (loader, inner):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        batches, n = iter(loader), len(loader)
        for first in range(0, n, accum):
            yield [next(batches) for _ in range(min(accum, n - first))]
        epoch += 1


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


if __name__ == "__main__":
    main()
