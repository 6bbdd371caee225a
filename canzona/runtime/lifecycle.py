"""Waiting for a :class:`~canzona.runtime.optimizer.CanzonaOptimizer`'s collectives and shutting
it down, a mixin: ``wait_params`` (the parameter all-gathers), ``finish`` (every collective
waited for and its handle dropped, the CUDA stream synchronised, the backend's threads given time
to free the finished works), ``close`` (also the hooks, the process groups and the flight
recorder released) and the context manager that closes on exit."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import torch

__all__ = ["Lifecycle"]

#: Seconds ``finish()`` sleeps (GIL and core released) after the last wait, so that the backend's
#: threads finish freeing the completed works (see ``finish``).
_BACKEND_GRACE_S = 0.005

_L = TypeVar("_L", bound="Lifecycle")


class Lifecycle:
    """``CanzonaOptimizer``'s waits and shutdown (its collectives, hooks, groups and recorder
    are set by ``runtime.construction``)."""

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers of the last step (a no-op when none is running)."""
        self._storage.wait_gathers()

    def finish(self) -> None:
        """Wait for every collective this optimizer has started and drop their handles.

        The parameter all-gathers of the last step (left running by
        ``overlap_param_gather=True``) complete into the parameters; reduce-scatters that
        backward started complete into this rank's gradient slices, which the next ``step()``
        (or ``clip_grad_norm_``) uses as usual. On CUDA the current stream is then synchronised,
        so the host knows the results are in memory. Last, with dp > 1, it sleeps a few
        milliseconds (GIL and core released): a backend thread may still be letting go of a
        finished work, which frees tensors and takes the GIL; gloo's threads outlive
        ``destroy_process_group()`` when the group object stays alive (torch 2.13 keeps the
        default group's), and one still doing so at interpreter shutdown aborts the process
        ("terminate called without an active exception").

        Idempotent, and training may go on after it; call it (or :meth:`close`) before
        ``torch.distributed.destroy_process_group()``.
        """
        self._storage.finish()
        device = self._device()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        if self._dp > 1:
            time.sleep(_BACKEND_GRACE_S)

    def close(self) -> None:
        """:meth:`finish`, then release the gradient and forward hooks and the process group.

        After it the model is a plain module again (its parameters keep their values; backward
        leaves gradients in ``.grad``), and ``step()`` / ``clip_grad_norm_()`` raise; the state,
        ``state_dict()`` and the byte counts stay available. Idempotent. The optimizer is also a
        context manager that closes on exit (without waiting for collectives when the block
        raised, as a failed rank's peers may never complete them).
        """
        if self._closed:
            return
        self.finish()
        self._release()

    def _release(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._storage.release()
        self._group = None  # an explicit dp_group is no longer kept alive by this optimizer
        self._pairs.groups = {}  # nor by the DP pairs' peers
        self._micro.release()  # nor the TP pairs' DP group and the sub-groups (tp > 1)
        # nor the expert-DP group: one derived here stays in torch's registry, as every
        # subgroup does, until torch.distributed.destroy_process_group()
        self._expert_group = None
        if self._flight is not None:
            self._flight.close()
        self._closed = True

    def __enter__(self: _L) -> _L:
        self._check_open("__enter__")
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self._release()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"CanzonaOptimizer.{what}: the optimizer is closed (close() or the "
                               "end of its with-block); build a new one to train again.")
