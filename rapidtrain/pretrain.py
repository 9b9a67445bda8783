"""`torchrun rapidtrain/pretrain.py FLAGS`: pretrain the built-in GPT (or BERT) on Megatron indexed data, as
Megatron's pretrain_gpt.py does (pretrain_gpt.py and pretrain_bert.py beside it are its two Megatron names).

With no data flags it trains a small GPT on the built-in demo corpus (prepared on first use), so
`torchrun --nproc_per_node 1 rapidtrain/pretrain.py --train-iters 200` is a complete first run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the package importable, not its folder's modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from rapidtrain.core.process import exit_after, pause_collection  # noqa: E402

pause_collection(__name__ == "__main__")  # until main starts (rapidtrain/core/process.py)

from rapidtrain.core.errors import user_errors  # noqa: E402
from rapidtrain.train.builtin_pretrainer import MegatronPreTrainer  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402

ENTRY = "pretrain"  # its declared defaults: arguments.ENTRY_DEFAULTS (and the demo's without --data-path)


@user_errors()
def main(argv: list[str] | None = None, entry: str = ENTRY) -> dict[str, float]:
    engine = Engine(argv=argv, entry=entry)
    results = MegatronPreTrainer(engine).train()
    # An undestroyed gloo group can abort the interpreter at exit ("terminate called without an active exception").
    engine.shutdown()
    return results


if __name__ == "__main__":
    exit_after(main)  # a rank ends without finalization (rapidtrain/core/process.py)
