"""`rapidtrain/pretrain.py` whose rank 0 dies by SIGKILL right after it starts the background save of iteration
`$KILL_AT_SAVE` (--async-save): a fault test's stand-in for a node lost while a checkpoint is being written.

Usage: `torchrun ... tests/distributed/killed_during_async_save.py FLAGS --async-save` with KILL_AT_SAVE set.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rapidtrain.pretrain import ENTRY, MegatronPreTrainer  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402


class KilledDuringAsyncSave(MegatronPreTrainer):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        start_save, at = self.checkpointer.save, int(os.environ["KILL_AT_SAVE"])

        def save_then_die(iteration: int, force: bool = False) -> None:
            start_save(iteration, force)  # returns once the state is copied and the background write started
            unfinished = Path(self.plan.checkpoint.save) / f"iter_{iteration:07d}.tmp"
            if iteration == at and self.engine.rank == 0 and unfinished.is_dir():
                self.records.flush()
                print(f" test: killing rank 0 while {unfinished.name} is written in the background", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        self.checkpointer.save = save_then_die


if __name__ == "__main__":
    engine = Engine(entry=ENTRY)
    KilledDuringAsyncSave(engine).train()
    engine.shutdown()
