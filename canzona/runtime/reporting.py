"""What a :class:`~canzona.runtime.optimizer.CanzonaOptimizer` reports about itself and saves, a
mixin: the collective method of every bucket, the bytes its state, its collectives and its TP
scratch take (``runtime.accounting``), and this rank's sharded state dict with the fp32 main
copies (``runtime.checkpoint.sharded``)."""

from __future__ import annotations

from typing import Any

import torch

from canzona.runtime import accounting
from canzona.runtime.checkpoint import sharded

__all__ = ["Reporting"]


class Reporting:
    """``CanzonaOptimizer``'s byte counts and state dict (its pieces are set by
    ``runtime.construction``)."""

    @property
    def collective_methods(self) -> tuple[str, ...]:
        """Per bucket, in launch order, the collective method it uses (``equal``, ``padded``,
        ``all_to_all``, ``per_root``, ``all_reduce``; ``local`` when dp = 1)."""
        return self._storage.methods

    def tp_scratch_bytes(self) -> int:
        """Most bytes of gathered full matrices this rank's TP pipeline holds at once (two
        micro-groups in flight; 0 for tp = 1). The plan bounds one group by C_max."""
        return self._micro.peak_scratch_bytes(getattr(self._matrix.config, "ns_dtype",
                                                      torch.bfloat16))

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (every tensor, step counters included, and the
        fp32 main copies under ``main_params="fp32"``): :func:`predicted_state_bytes` of the plan.
        """
        return accounting.measured_state_bytes(self.state, self._storage.main_copies)

    def predicted_state_bytes(self) -> int:
        """``state_bytes()`` predicted from the plan's geometry and this optimizer's kernels:
        :func:`predicted_state_bytes`, with each owned matrix task's state taken from the matrix
        kernel in use (exact also when ``matrix_options`` change Shampoo's state layout)."""
        return accounting.kernel_state_bytes(
            self.plan, self._rank, self._schedule.mine,
            {self._names[i] for i in self._schedule.matrix_params}, self._matrix, self._micro,
            self._main_params)

    @torch.no_grad()
    def reload_main_params(self) -> None:
        """Take the fp32 main copies again from the (bf16/fp16) parameters, e.g. after
        ``model.load_state_dict`` (a no-op without ``main_params="fp32"``)."""
        self.wait_params()
        for buf in self._storage.buffers:
            if buf.main is not None:
                buf.main.copy_(buf.own_params)

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per step in the reduce-scatters and all-gathers (the methods the
        constructor chose; padding included)."""
        buckets, buffers = self._schedule.buckets, self._storage.buffers
        return accounting.comm_bytes(
            list(self._storage.methods), [b.sizes for b in buckets], [b.rank for b in buckets],
            grad_bytes=[4 if self._external else buf.grads.element_size() for buf in buffers],
            param_bytes=[buf.params.element_size() for buf in buffers],
            external=self._external)

    def state_dict(self) -> dict[str, Any]:
        """This rank's (sharded) state: per parameter index its owned task or slice state, the
        param groups' hyper-parameters, and the plan it belongs to."""
        self.wait_params()
        main = self._storage.main_copies if self._main_params is not None else None
        return sharded.build_state_dict(self._params, self.state, self.param_groups,
                                           digest=self._digest, rank=self._rank, main=main)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved by this DP rank under this plan."""
        sharded.check_owner(state_dict, digest=self._digest, rank=self._rank)
        # fp32 main copies: the saved ones, else (saved without them) from the parameters.
        if not sharded.load_into(state_dict, self._params, self.state, self.param_groups,
                                    self._storage.main_copies):
            self.reload_main_params()
