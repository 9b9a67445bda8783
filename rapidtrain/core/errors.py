"""User errors: mistakes in flags, files or data that a person fixes, reported as one clear message.

Every error whose message already names the flag or file and the fix subclasses `UserError`; entry points
wrap their `main` with `@user_errors`, which prints that message (on rank 0 only) and exits with status 2.
Tracebacks are for rapidtrain's own bugs: `RAPIDTRAIN_DEBUG=1` or `--debug` shows them for user errors too.
This module imports only the standard library, so every layer can use it.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

EXIT_USER_ERROR = 2  # argparse's status for bad flags; rapidtrain uses it for every user error
DEBUG_ENV = "RAPIDTRAIN_DEBUG"

F = TypeVar("F", bound=Callable[..., Any])


class UserError(Exception):
    """A problem the user fixes (a flag, a file, the data); the message names it and says how."""

    every_rank = False  # True: each rank that meets it says so (its own environment, which other ranks lack)


def debug_requested(argv: Sequence[str] | None = None) -> bool:
    """True when tracebacks were asked for: RAPIDTRAIN_DEBUG=1 (any value but 0/empty) or --debug."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return True
    return "--debug" in (sys.argv[1:] if argv is None else argv)


def process_rank() -> int:
    """This process's global rank: torch.distributed's when it started, else torchrun's RANK, else 0."""
    torch = sys.modules.get("torch")  # imported already if a process group can exist; never import it here
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def format_user_error(error: BaseException, program: str) -> str:
    message = str(error).strip() or type(error).__name__
    if "Original Traceback (most recent call last):" in message:  # raised in a DataLoader worker: its message only
        message = message.splitlines()[-1].split(": ", 1)[-1]
    # Messages written for the rapidtrain command already start with its name.
    return message if message.startswith(f"{program}:") else f"{program}: error: {message}"


def report_user_error(error: BaseException, program: str = "rapidtrain", argv: Sequence[str] | None = None) -> None:
    """Print the error once for the run (every rank of a run meets the same bad flag or file; a file that fails on
    one rank only is still told, by that rank)."""
    from rapidtrain.core.stopped_run import first_to_report, write_error_file

    write_error_file("user_error", format_user_error(error, program))
    told_here = getattr(error, "every_rank", False) or first_to_report("user_error")
    if not told_here and not debug_requested(argv):
        return
    if debug_requested(argv):
        traceback.print_exception(error)
    print(format_user_error(error, program), file=sys.stderr, flush=True)


def user_errors(program: str = "rapidtrain") -> Callable[[F], F]:
    """Decorator for an entry point's `main(argv=None)`: a UserError becomes its message and exit status 2. Under
    torchrun, any other failure becomes the run's story (core/stopped_run.py), and a loop stopped by Ctrl-C ends
    with its resume line and status 130.

    The original exception stays reachable as the SystemExit's `__cause__`; call `main.__wrapped__` to get
    the exception itself (tests that check an error class).
    """

    def decorate(main: F) -> F:
        @functools.wraps(main)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from rapidtrain.core import stopped_run

            try:
                result = main(*args, **kwargs)
            except UserError as error:
                argv = kwargs.get("argv", args[0] if args else None)
                report_user_error(error, program, argv if isinstance(argv, (list, tuple)) else None)
                raise SystemExit(EXIT_USER_ERROR) from error
            except (SystemExit, GeneratorExit):
                raise
            except BaseException as error:
                if not stopped_run.under_torchrun() or debug_requested():
                    raise
                raise SystemExit(stopped_run.rank_failed(error)) from None
            status = stopped_run.signal_stop_status()
            if status:
                raise SystemExit(status)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate
