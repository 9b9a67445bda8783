"""`rapidtrain/pretrain.py` whose rank 1 dies by SIGKILL once, after iteration `$KILL_AT_ITERATION`: a fault
test's stand-in for a crashed node. A marker file in --save keeps the group torchrun restarts from dying again.

Usage: `torchrun --max-restarts 1 ... tests/distributed/killed_pretrain.py FLAGS` with KILL_AT_ITERATION set.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rapidtrain.pretrain import ENTRY, MegatronPreTrainer  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402


class KilledPreTrainer(MegatronPreTrainer):
    def after_iteration(self) -> None:
        super().after_iteration()
        marker = Path(self.plan.checkpoint.save or ".") / ".test_killed"
        at = int(os.environ["KILL_AT_ITERATION"])
        if self.engine.rank == 1 and self.iteration == at and not marker.exists():
            self.records.flush()  # what a log line would have written by now
            marker.write_text(f"killed rank 1 after iteration {at}\n")
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    engine = Engine(entry=ENTRY)
    KilledPreTrainer(engine).train()
    engine.shutdown()
