"""`rapidtrain/pretrain.py` whose ranks get extra flags of their own: a job whose launch script was edited on one
node. `$RANK_EXTRA_ARGS` is JSON {"rank": [flags appended to that rank's argv]}.

Usage: `torchrun ... tests/distributed/disagreeing_ranks.py FLAGS` with RANK_EXTRA_ARGS set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rapidtrain.core.process import exit_after  # noqa: E402
from rapidtrain.pretrain import main  # noqa: E402

if __name__ == "__main__":
    extra = json.loads(os.environ.get("RANK_EXTRA_ARGS", "{}")).get(os.environ["RANK"], [])
    exit_after(lambda: main(sys.argv[1:] + extra))
