"""A trainer that dies while saving (run by test_checkpoint_files.py in its own process).

    python checkpoint_crash_worker.py DIR POINT

Trains TinyGPT on one process (dp 1) for 2 steps, saves DIR/ck, writes its parameters to
DIR/after2.pt, trains one more step and saves DIR/ck again, killing itself with SIGKILL at POINT:
``write`` (while DCP writes the data), ``meta`` (data written, canzona.json not yet),
``publish`` (the old checkpoint moved aside, the new one not yet in place).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import checkpoint_files_common as C


def _die(*_args, **_kwargs):
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(where: str, point: str) -> None:
    import canzona
    import canzona.runtime.checkpoint.files as LC

    torch.set_num_threads(1)
    model, opt = C.build()
    C.train(model, opt, range(2))
    ck = os.path.join(where, "ck")
    canzona.save_checkpoint(ck, model, opt)
    torch.save(C.params(model), os.path.join(where, "after2.pt"))
    C.train(model, opt, range(2, 3))
    if point == "write":
        real = torch.distributed.checkpoint.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            real(self, plan, planner)  # the data files are (being) written
            _die()

        torch.distributed.checkpoint.FileSystemWriter.write_data = write_then_die
    elif point == "meta":
        LC._write_meta = _die
    elif point == "publish":
        calls = []
        real_replace = os.replace

        def replace(src, dst):
            calls.append((src, dst))
            if len(calls) == 3:  # canzona.json, then the old checkpoint aside, then ...
                _die()
            real_replace(src, dst)

        LC.os.replace = replace
    canzona.save_checkpoint(ck, model, opt)
    print("saved without dying", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
