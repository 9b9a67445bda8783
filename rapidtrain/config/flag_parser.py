"""The argparse parser rapidtrain's flags live on: errors a person reads first (the problem, a "did you mean" for a
misspelled flag, a pointer to --help), negative numbers with exponents read as values, NaN and infinity refused."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence


def finite_float(text: str) -> float:
    """A float flag's value: nan and infinity are refused (argparse names the flag)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


finite_float.__name__ = "float"  # argparse's "invalid float value" message


class FlagParser(argparse.ArgumentParser):
    """argparse with errors a person reads first: the problem, a "did you mean" for a misspelled flag, and a
    pointer to --help instead of the whole usage block; exit status 2 as argparse."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # argparse (before 3.13) reads `--lr -1e-3` as two flags: its negative-number pattern has no exponent.
        self._negative_number_matcher = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
        # Every float flag (argument groups share the registry): nan and inf pass float() and every range check.
        self.register("type", float, finite_float)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_flags_message(self, extras))
        return namespace

    def error(self, message: str):
        lines = "".join(f"{self.prog}: error: {line}\n" for line in message.splitlines())
        self.exit(2, f"{lines}{self.prog}: `{self.prog} --help` lists every flag.\n")


def unknown_flags_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """`--lr-warmup-iter 5` → "unknown flag --lr-warmup-iter (did you mean --lr-warmup-iters?)", a line per flag."""
    import difflib

    known = [option for action in parser._actions for option in action.option_strings]  # argparse's own list
    parts = []
    for token in extras:
        if not token.startswith("-") or token == "-":
            continue
        flag = token.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        parts.append(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
    values = [token for token in extras if not token.startswith("-") or token == "-"]
    if values and not parts:
        parts.append(f"unexpected value(s) {' '.join(values)}: a value belongs after its flag")
    return "\n".join(parts) if parts else f"unrecognized arguments: {' '.join(extras)}"
