"""`torchrun rapidtrain/pretrain_gpt.py FLAGS`: Megatron's pretrain_gpt.py, the built-in GPT on Megatron
indexed data, with Megatron's defaults for real data (--tokenizer-type GPT2BPETokenizer) and the demo's only
without --data-path. A Megatron launch script changes its entry point to this file and nothing else.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the package importable, not its folder's modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from rapidtrain.core.process import exit_after, pause_collection  # noqa: E402

pause_collection(__name__ == "__main__")  # until main starts (rapidtrain/core/process.py)

from rapidtrain.pretrain import main  # noqa: E402

ENTRY = "pretrain_gpt"  # its declared defaults: arguments.ENTRY_DEFAULTS

if __name__ == "__main__":
    exit_after(lambda: main(entry=ENTRY))  # a rank ends without finalization (core/process.py)
