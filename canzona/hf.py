"""``transformers.Trainer`` with a :class:`~canzona.runtime.optimizer.CanzonaOptimizer`.

::

    from canzona.hf import CanzonaTrainer
    opt = canzona.CanzonaOptimizer(model, canzona.plan_model(model, dp=world), lr=0.02)
    args = TrainingArguments(..., max_grad_norm=0.0)      # the Trainer must not clip
    trainer = CanzonaTrainer(model=model, args=args, train_dataset=data,
                             optimizers=(opt, scheduler), clip_grad_norm=1.0)
    trainer.train()
    opt.close()

What it changes in ``Trainer`` (and why):

* **No DDP wrapper.** Under ``torchrun`` the Trainer's ``accelerate`` would wrap the model in
  ``DistributedDataParallel``, whose all-reduce would average every gradient before canzona's own
  reduce-scatter (twice the bytes, then a second reduction). ``CanzonaTrainer`` keeps the model
  unwrapped, so canzona's hooks reduce-scatter each bucket as backward fills it. The data loader is
  still sharded over the ranks by ``accelerate``.
* **Clipping on the global norm.** The Trainer's own clipping would run on local, unreduced
  gradients; ``max_grad_norm`` must be 0 and ``clip_grad_norm=`` clips with
  ``CanzonaOptimizer.clip_grad_norm_`` (the norm over every rank's owned slices), which is also the
  ``grad_norm`` the Trainer logs.
* **Gradient accumulation** runs the micro-batches before the last under ``opt.no_sync()``.

Needs ``transformers`` (and its ``accelerate``); imported only by this module.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer, TrainerCallback

from canzona.planner.errors import CanzonaError
from canzona.runtime.optimizer import CanzonaOptimizer

__all__ = ["CanzonaTrainer"]


class _Clip(TrainerCallback):
    def __init__(self, trainer: CanzonaTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
        t = self.trainer
        norm = t._canzona.clip_grad_norm_(t._clip if t._clip else float("inf"))
        t._global_norm = float(norm)


class CanzonaTrainer(Trainer):
    """A ``transformers.Trainer`` that leaves gradient sync and clipping to canzona.

    Args:
        optimizers: ``(CanzonaOptimizer, scheduler)``, as for ``Trainer``.
        clip_grad_norm: clip the global gradient norm to this (None: measure and log it only).
        Everything else goes to ``Trainer``.

    Raises:
        CanzonaError: no CanzonaOptimizer given, or ``args.max_grad_norm`` not 0.
    """

    def __init__(self, *args: Any, clip_grad_norm: float | None = None, **kwargs: Any) -> None:
        optimizers = kwargs.get("optimizers") or (None, None)
        opt = optimizers[0]
        if not isinstance(opt, CanzonaOptimizer):
            raise CanzonaError("CanzonaTrainer needs optimizers=(CanzonaOptimizer, scheduler); got "
                               f"{type(opt).__name__}.")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise CanzonaError(f"clip_grad_norm must be > 0 (or None), got {clip_grad_norm}.")
        self._canzona = opt
        self._clip = clip_grad_norm
        self._global_norm: float | None = None
        super().__init__(*args, **kwargs)
        if self.args.max_grad_norm:
            raise CanzonaError(
                f"TrainingArguments.max_grad_norm is {self.args.max_grad_norm}: the Trainer would "
                "clip local, unreduced gradients. Set max_grad_norm=0.0 and pass "
                "clip_grad_norm= to CanzonaTrainer (it clips the global norm).")
        self.add_callback(_Clip(self))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Keep the model out of DistributedDataParallel: canzona reduce-scatters the gradients.
        self.accelerator.prepare_model = lambda model, *args, **kwargs: model

    def training_step(self, model, inputs, *args: Any, **kwargs: Any):  # noqa: ANN001
        if not self.accelerator.sync_gradients:  # a micro-batch before the last
            with self._canzona.no_sync():
                return super().training_step(model, inputs, *args, **kwargs)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "grad_norm" in logs and self._global_norm is not None:
            logs["grad_norm"] = self._global_norm  # the global norm, not the Trainer's (none)
        super().log(logs, *args, **kwargs)
