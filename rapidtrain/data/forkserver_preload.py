"""Imported only by multiprocessing's forkserver that starts a rank's DataLoader workers (data/worker_start.py),
first of its preloads:
- SIGTERM sent to the rank's process group (torchrun's shutdown, a scheduler) is the rank's to answer (it saves,
  then stops its workers): the server ignores it, as the workers do, so it cannot die under the rank's feet.
- The server ends with its rank, however the rank ends (SIGKILL included): the kernel kills it when the rank
  dies, and its workers, whose parent it is, then notice within 5 s (torch's watchdog) and exit. Its own way
  of noticing (end of file on a pipe from the rank) never comes while workers live: each holds that pipe open."""

import os
import signal

from rapidtrain.core.shutdown import stop_with_parent

signal.signal(signal.SIGTERM, signal.SIG_IGN)
stop_with_parent(int(os.environ["RAPIDTRAIN_RANK_PID"]) if "RAPIDTRAIN_RANK_PID" in os.environ else None,
                 signal.SIGKILL)  # a rank already gone: killed now
