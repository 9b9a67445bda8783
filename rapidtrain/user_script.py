"""`rapidtrain --user-script FILE FLAGS`: run a white-box script (as `__main__`, under torchrun) and make
sure it trained something.

A script trains when it creates an Engine itself (its main code runs a template's `train()` or an
`Engine.compose` loop). A script that only defines a template subclass, and no main, gets it run:
`Subclass(engine=Engine()).train()`; one that defines a `main()` it never calls gets that called. A script
with neither is refused with a message saying what it lacks.
"""

from __future__ import annotations

import inspect
import runpy
import sys
from pathlib import Path
from typing import Any

import rapidtrain.train.engine as engine_module
from rapidtrain.train.engine import Engine, shutdown_distributed
from rapidtrain.train.finetuner import Finetuner
from rapidtrain.train.pretrainer import PreTrainer
from rapidtrain.train.trainer import Trainer


class UserScriptError(SystemExit):
    """The script cannot run as a rapidtrain white-box script; exits with status 2 and says why."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(2)

    def __str__(self) -> str:
        return self.message


def _templates() -> tuple[type, ...]:
    return Trainer, PreTrainer, Finetuner


def template_subclasses(namespace: dict[str, Any]) -> list[type]:
    """Classes the script defined (module `__main__`) that subclass Trainer, PreTrainer or Finetuner."""
    templates = _templates()
    return [
        value
        for value in namespace.values()
        if inspect.isclass(value)
        and issubclass(value, templates[0])
        and value not in templates
        and value.__module__ == "__main__"
        and not inspect.isabstract(value)
    ]


def _engine_created() -> int:
    return id(engine_module._GLOBAL_ARGS) if engine_module._GLOBAL_ARGS is not None else 0


def run_user_script(script: str | Path, argv: list[str]) -> None:
    """Run `script` with `argv` as its command line; raise UserScriptError when it trains nothing."""
    previous, engine_module.USER_SCRIPT = engine_module.USER_SCRIPT, str(script)
    try:
        _run_user_script(Path(script), argv)
    finally:
        engine_module.USER_SCRIPT = previous


def _run_user_script(script: Path, argv: list[str]) -> None:
    before = _engine_created()
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.resolve().parent))  # as `python FILE` would: its own folder first
    namespace = runpy.run_path(str(script), run_name="__main__")
    if _engine_created() != before:
        return shutdown_distributed()
    main = namespace.get("main")
    if callable(main) and getattr(main, "__module__", None) == "__main__":
        main()
        return shutdown_distributed()
    subclasses = template_subclasses(namespace)
    if len(subclasses) == 1:
        subclasses[0](engine=Engine()).train()
        return shutdown_distributed()
    if subclasses:
        names = ", ".join(c.__name__ for c in subclasses)
        raise UserScriptError(
            f"rapidtrain: --user-script {script} defines several templates ({names}) and no main "
            'code choosing one: add `if __name__ == "__main__": Name(engine=Engine()).train()`.'
        )
    raise UserScriptError(
        f"rapidtrain: --user-script {script} ran without training anything: it defines no subclass of Finetuner, "
        "PreTrainer or Trainer, no main(), and creates no Engine. Subclass a template (copy one of templates/"
        "finetuner_template.py, pretrainer_template.py), or wrap your own loop with engine.compose(...) as in "
        "templates/compose_loop_template.py."
    )
