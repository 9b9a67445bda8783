"""Messages that libraries log and that do not concern the user, handled in this one place: those about optional
pieces rapidtrain does not use are hidden, and a library's message repeated on every forward (bitsandbytes' 8-bit
matmul) is shown once. `--show-library-warnings` (and `rapidtrain generate --show-library-warnings`) shows them all.

The filters sit on the libraries' own loggers, named here: a logger's filter sees each record that logger makes, and
`logging.getLogger(name)` hands the library the same logger object whether it or rapidtrain asks first."""

from __future__ import annotations

import logging

# (logger, start of the message, why the user need not see it)
HIDDEN: tuple[tuple[str, str, str], ...] = (
    ("torchao", "Failed to load ", "torchao's optional CUDA kernels (mxfp8, CUTLASS) do not load on this build; "
     "rapidtrain calls none of them"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward",
     "an optional kernel package (kernels-community); bitsandbytes computes 4-bit matmuls on the CPU without it"),
    ("torch.utils._pytree", "<enum ", "torchao registers its enums the way torch now deprecates; nothing to do "
     "for the user"),
)
# Loggers whose messages are shown once each, however often the library repeats them.
ONCE: tuple[str, ...] = ("bitsandbytes.autograd._functions", "bitsandbytes.nn.modules")


class LibraryMessages(logging.Filter):
    """Drops the HIDDEN messages and repeats of a message already shown."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if any(record.name == name and text.startswith(start) for name, start, _ in HIDDEN):
            return False
        if record.name in ONCE:
            key = (record.name, text)
            if key in self.shown:
                return False
            self.shown.add(key)
        return True


_FILTER = LibraryMessages()


def quiet_library_messages(show: bool = False) -> None:
    """Install the filter on the libraries' loggers (before they log), or remove it when `show` asks for every
    message. Calling it again changes nothing more."""
    for name in {name for name, _, _ in HIDDEN} | set(ONCE):
        logger = logging.getLogger(name)
        if show:
            logger.removeFilter(_FILTER)
        elif _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
