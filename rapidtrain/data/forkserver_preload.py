"""Imported only by multiprocessing's forkserver that starts a rank's DataLoader workers (data/worker_start.py):
SIGTERM sent to the rank's process group (torchrun's shutdown, a scheduler) is the rank's to answer (it saves,
then stops its workers). The server ignores it, as the workers do, so it cannot die under the rank's feet; it
ends when the rank does (multiprocessing closes its pipe)."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
