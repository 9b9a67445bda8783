"""The Megatron family's whole flag surface on rapidtrain's parser: every flag of megatron_flags.json is accepted with
the values its origins accept, and after parsing each one given works, leaves a plan note, or is refused (exit 2).

The facts come from megatron_flags.json, the treatment from flag_status.py; this module joins them.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidtrain.config import flag_status as status_table
from rapidtrain.core.errors import UserError

DATA_FILE = Path(__file__).with_name("megatron_flags.json")
GIVEN = "megatron_flags_given"  # namespace attribute: (flag, value) of each surface flag on the command line


class FlagRefused(UserError):
    """A Megatron-family flag asks for a feature rapidtrain lacks."""


@dataclass(frozen=True)
class Treatment:
    status: str  # works, no_effect, refused
    note: str
    kind: str  # own (rapidtrain defines it), renamed, sets, handled, listed, pattern


@functools.cache
def surface() -> dict:
    return json.loads(DATA_FILE.read_text())


def surface_flags() -> list[dict]:
    return surface()["flags"]


def classify(flag: str, own_help: dict[str, str] | None = None) -> Treatment | None:
    """How rapidtrain treats `flag` (None: unclassified, which a test forbids)."""
    if own_help is not None and flag in own_help:
        return Treatment(status_table.WORKS, own_help[flag], "own")
    if flag in status_table.RENAMED:
        return Treatment(status_table.WORKS, status_table.RENAMED[flag][1], "renamed")
    if flag in status_table.SETS:
        return Treatment(status_table.WORKS, status_table.SETS[flag][2], "sets")
    if flag in status_table.HANDLED:
        return Treatment(status_table.WORKS, status_table.HANDLED[flag], "handled")
    if flag in status_table.FLAGS:
        status, note = status_table.FLAGS[flag]
        return Treatment(status, note, "listed")
    for pattern, status, note in status_table.PATTERNS:
        if re.fullmatch(pattern, flag):
            return Treatment(status, note, "pattern")
    return None


def own_flags_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option string rapidtrain's parser defines → the first sentence of its help."""
    table = {}
    for action in parser._actions:  # argparse offers its actions only this way
        if isinstance(action, SurfaceAction):
            continue
        help_text = action.help if action.help and action.help != argparse.SUPPRESS else "rapidtrain's flag"
        for option in action.option_strings:
            table[option] = help_text.split(". ")[0].rstrip(".")
    return table


def _lenient_int(text: str) -> int:
    """Megatron's int flags; `1e9` and `2_000` as a shell script may write them."""
    number = float(text.replace("_", ""))
    if not number.is_integer():
        raise argparse.ArgumentTypeError(f"expected an integer, got {text}")
    return int(number)


VALUE_TYPES: dict[str | None, Callable[[str], Any]] = {"int": _lenient_int, "float": float, "str": str, None: str}


class SurfaceAction(argparse.Action):
    """Stores a Megatron-family flag's value (or a switch's) and records that it was given."""

    def __init__(self, option_strings, dest, flag: str = "", switch=None, **kwargs) -> None:
        self.flag, self.switch = flag, switch
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = values
        if self.nargs == 0:
            value = self.switch if not (option_string or "").startswith("--no-") or self.flag.startswith("--no-") \
                else not self.switch
        setattr(namespace, self.dest, value)
        setattr(namespace, GIVEN, [*(getattr(namespace, GIVEN, None) or []), (self.flag, value)])


def _switch_kwargs(record: dict) -> dict | None:
    if record["action"] == "store_true":
        return {"nargs": 0, "switch": True, "default": False}
    if record["action"] == "store_false":
        return {"nargs": 0, "switch": False, "default": True}
    if record["action"] == "optional_bool":
        return {"nargs": 0, "switch": True, "default": record["default"]}
    return None


def _value_kwargs(record: dict) -> dict:
    kwargs = {"nargs": record["nargs"], "type": VALUE_TYPES.get(record["type"], str), "default": record["default"]}
    if record["choices"] and record["type"] in (None, "str"):
        kwargs["choices"] = [str(choice) for choice in record["choices"]]
    return kwargs


def add_surface(parser: argparse.ArgumentParser) -> None:
    """Every flag of the data file that the parser does not define yet, with its origins' shape; rapidtrain's own
    flags get the other origins' spellings of their values (checked after parsing)."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    own_dests = {action.dest for action in actions.values()}  # once: the parser is built for every plan
    group = parser.add_argument_group("Megatron-family flags", "Accepted for compatibility (docs/megatron-compat.md "
                                      "says what each does here)")
    for record in surface_flags():
        names = [name for name in (record["flag"], *record["aliases"]) if name not in actions]
        if record["flag"] in actions or not names:
            own = actions.get(record["flag"]) or next(actions[n] for n in record["aliases"] if n in actions)
            _widen(own, record)
            for name in names:  # another origin's spelling of a rapidtrain flag
                list.append(own.option_strings, name)  # type: ignore[arg-type]  # a list at run time
                parser._option_string_actions[name] = own
            continue
        group.add_argument(*names, **_surface_kwargs(record, actions, own_dests), help=argparse.SUPPRESS)


def _surface_kwargs(record: dict, actions: dict, own_dests: set[str]) -> dict:
    flag = record["flag"]
    kwargs: dict = {"action": SurfaceAction, "flag": flag, "dest": record["dest"] or flag[2:].replace("-", "_")}
    if flag in status_table.SETS:
        dest, value, _ = status_table.SETS[flag]
        return {**kwargs, "dest": dest, "nargs": 0, "switch": value, "default": argparse.SUPPRESS}
    if flag in status_table.RENAMED:
        target = next(a for a in actions.values() if a.dest == status_table.RENAMED[flag][0])
        if target.nargs == 0:  # a switch: store_true's True, store_false's False, BooleanOptionalAction's positive
            switch = True if target.const is None else target.const
            return {**kwargs, "dest": target.dest, "nargs": 0, "switch": switch, "default": argparse.SUPPRESS}
        kind = _lenient_int if target.type is int else target.type or str
        return {**kwargs, "dest": target.dest, "nargs": target.nargs, "type": kind, "default": argparse.SUPPRESS}
    if kwargs["dest"] in own_dests:  # same name, other meaning: kept apart
        kwargs["dest"] = "megatron_" + kwargs["dest"]
    return {**kwargs, **(_switch_kwargs(record) or _value_kwargs(record))}


# Another origin's spelling of a value rapidtrain's flag has under its own name.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "normalization": {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"},
    "position_embedding_type": {"rotary": "rope", "absolute": "learned_absolute"},
    "tokenizer_type": {"PretrainedFromHF": "HuggingFaceTokenizer", "HFTokenizer": "HuggingFaceTokenizer",
                       "Llama3Tokenizer": "HuggingFaceTokenizer", "MistralTokenizer": "HuggingFaceTokenizer"},
}
# Another origin's value of a rapidtrain flag that rapidtrain does not serve, and why (the refusal names it).
_PAI_OFFLOADING_ADAM = ("Pai-Megatron-Patch's fork's Adam that keeps (a --optimizer-offload-fraction of) the optimizer "
                        "state on the CPU and steps it there; rapidtrain's optimizer offload is --cpu-offload "
                        "(DeepSpeed's CPU Adam under a --zero-* switch, the whole state, no tensor/pipeline/expert "
                        "parallelism): give --optimizer adam --cpu-offload --zero-1-memory-optimization, or "
                        "--optimizer adam to keep the state on the GPU")
VALUE_REFUSALS: dict[str, dict[str, str]] = {
    "optimizer": {"hybridadam": _PAI_OFFLOADING_ADAM, "cpu-adam": _PAI_OFFLOADING_ADAM},
}
# Values a launch script passes that no extracted parser lists (EasyNLP's Rapidformer example): accepted by the
# parser, then refused by name like any value rapidtrain lacks.
EXTRA_VALUES: dict[str, list[str]] = {"--tokenizer-type": ["ChineseBPETokenizer"],
                                      "--optimizer": ["hybridadam", "cpu-adam"]}  # Pai's launch scripts
WIDENED = "megatron_widened"  # parser attribute: dest → rapidtrain's own choices


def _widen(action: argparse.Action, record: dict) -> None:
    """rapidtrain's own flag: accept every origin's values; those rapidtrain lacks are refused after parsing."""
    if action.nargs is None and record["nargs"] in ("+", "*") and action.type in (int, float):
        action.nargs = "+"  # one origin takes a list (Megatron-Core's per-type coefficients): one value is served
        action.rapidtrain_scalar = True  # type: ignore[attr-defined]
    if action.choices is None or not record["choices"]:
        return
    own = list(action.choices)
    offered = [*record["choices"], *EXTRA_VALUES.get(record["flag"], [])]
    extra = [c for c in offered if c not in own and (action.type is None or isinstance(c, str))]
    if extra:
        action.choices = [*own, *extra]
        action.rapidtrain_choices = own  # type: ignore[attr-defined]
        if action.metavar is None:  # --help lists rapidtrain's own values; the others are translated or refused
            action.metavar = "{" + ",".join(map(str, own)) + "}"


def megatron_flags_given(args: argparse.Namespace) -> list[tuple[str, object]]:
    return list(getattr(args, GIVEN, None) or [])


def refusal_applies(flag: str, value: object) -> bool:
    """A refused flag given its origin's default (`--context-parallel-size 1`) asks for nothing."""
    record = record_of(flag)
    if record is None:
        return True
    if value in status_table.NEUTRAL.get(flag, ()):
        return False
    default = record["default"]
    if isinstance(value, list) and not isinstance(default, list):
        return True
    try:
        return VALUE_TYPES.get(record["type"], str)(str(default)) != value if record["type"] else default != value
    except (ValueError, argparse.ArgumentTypeError):
        return True


@functools.cache
def _records() -> dict[str, dict]:
    table = {}
    for record in surface_flags():
        for name in (record["flag"], *record["aliases"]):
            table[name] = record
    return table


def record_of(flag: str) -> dict | None:
    return _records().get(flag)
