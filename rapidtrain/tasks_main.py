"""`torchrun rapidtrain/tasks_main.py --task MNLI|RACE FLAGS`: Megatron's tasks/main.py, fine-tuning the built-in BERT
from a rapidtrain BERT checkpoint (--pretrained-checkpoint: a --save folder of pretrain_bert.py) on the task's files
(--train-data, --valid-data: GLUE's MNLI .tsv files, or RACE's folders of passages) for --epochs, printing the
accuracy on each --valid-data file after every epoch. A Megatron launch script changes its entry point to this file
and nothing else.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the package importable, not its folder's modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from rapidtrain.core.process import exit_after, pause_collection  # noqa: E402

pause_collection(__name__ == "__main__")  # until main starts (rapidtrain/core/process.py)

from typing import Any  # noqa: E402

from rapidtrain.core.errors import user_errors  # noqa: E402
from rapidtrain.tasks.megatron_tasks import MegatronTaskFinetuner  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402

ENTRY = "tasks_main"  # its declared defaults: arguments.ENTRY_DEFAULTS (the built-in BERT, Megatron's tokenizer)


@user_errors()
def main(argv: list[str] | None = None) -> dict[str, Any]:
    engine = Engine(argv=argv, entry=ENTRY)
    results = MegatronTaskFinetuner(engine).train()
    engine.shutdown()  # while every rank is still here, not at interpreter exit (gloo)
    return results


if __name__ == "__main__":
    exit_after(main)  # a rank ends without finalization (rapidtrain/core/process.py)
