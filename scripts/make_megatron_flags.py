"""Write rapidtrain/config/megatron_flags.json: the Megatron family's flag surface, as facts only.

The input is a full extraction (every sampled release's argparse definitions, one record per flag, with the
definitions that differ listed as `variants`). This keeps what rapidtrain's parser needs to accept a flag as its
origins do (option strings, nargs, type, choices in each origin's spelling, default, switch or value) and which
origins have it from which release to which; how rapidtrain treats each flag lives in config/flag_status.py.

    python scripts/make_megatron_flags.py /path/to/megatron_family_flags.json [--scripts launch_scripts.json]

With --scripts, flags that real launch scripts pass and no extracted parser defines (a fork's own parser, a user
script's extra_args_provider) are added too, with the script's origin and date, taking an optional value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "rapidtrain" / "config" / "megatron_flags.json"
SWITCHES = {"store_true", "store_false"}


def _plain(value):
    """A literal default as JSON, anything computed (an expression's source) as None."""
    if isinstance(value, dict) and "expr" in value:
        return None
    return value


def _action(definition: dict) -> str | None:
    action = definition.get("action")
    if isinstance(action, dict):  # BooleanOptionalAction, or bigscience's data-path parsers (values)
        return "optional_bool" if "BooleanOptional" in action["expr"] else "store"
    return action


def _merged_shape(record: dict) -> tuple[str, object]:
    """(action, nargs) that accepts what every origin's definition accepts: the most permissive of them."""
    definitions = [record, *record.get("variants", [])]
    actions = {_action(d) for d in definitions} - {None}  # None: a flag only documented, never defined
    nargs = {json.dumps(d.get("nargs")) for d in definitions if _action(d) == "store"}
    if not actions:
        return "store", "?"
    if actions <= SWITCHES or actions == {"optional_bool"}:
        return _action(record) or sorted(actions)[0], None
    if actions & (SWITCHES | {"optional_bool"}):  # a switch in one origin, a value in another
        return "store", "?"
    for wide in ('"*"', '"+"'):
        if wide in nargs:
            return "store", json.loads(wide)
    if nargs == {"3"}:
        return "store", 3
    if "3" in nargs:  # `--rampup-batch-size` takes three numbers, or any number in one fork
        return "store", "*"
    return "store", None


def _type(record: dict) -> str | None:
    types = {d.get("type") for d in [record, *record.get("variants", [])] if _action(d) == "store"}
    types.discard(None)
    for name in ("str", "float", "int"):  # the widest type every origin's values parse as
        if types == {name} or (name == "float" and types == {"int", "float"}):
            return name
    return "str" if types else None


def _choices(record: dict) -> tuple[list | None, dict | None]:
    by_origin: dict[str, list] = {}
    # The record is the representative definition; with variants, they (each naming its origins) are the whole list.
    for definition in record.get("variants") or [{**record, "origins": list(record["origins"])}]:
        if not isinstance(definition.get("choices"), list):  # none, or computed (an expression's source)
            continue
        for origin in definition["origins"]:
            by_origin.setdefault(origin, [])
            by_origin[origin] += [c for c in definition["choices"] if c not in by_origin[origin]]
    if not by_origin:
        return None, None
    union: list = []
    for values in by_origin.values():
        union += [v for v in values if v not in union]
    differ = len({json.dumps(v) for v in by_origin.values()}) > 1
    return union, (by_origin if differ else None)


def compact(record: dict) -> dict:
    action, nargs = _merged_shape(record)
    choices, choices_by_origin = _choices(record)
    entry = {"flag": record["flag"], "aliases": record.get("aliases", []), "dest": record.get("dest"),
             "action": action, "nargs": nargs, "type": _type(record) if action == "store" else None,
             "choices": choices, "default": _plain(record.get("default")),
             "origins": {origin: [dates[0], dates[-1]] for origin, dates in record["origins"].items()}}
    if choices_by_origin:
        entry["choices_by_origin"] = choices_by_origin
    return entry


def seen_in_scripts(scripts: list[dict], known: set[str]) -> list[dict]:
    """Flags the launch scripts pass that no extracted parser has, with the scripts' origins: a switch when no
    script gives it a value, else a value of the narrowest type every script's value parses as."""
    seen: dict[str, dict] = {}
    values: dict[str, list[str]] = {}
    for script in scripts:
        argv = script["argv"]
        for index, token in enumerate(argv):
            flag = token.split("=", 1)[0]
            if not flag.startswith("--") or flag in known:
                continue
            entry = seen.setdefault(flag, {"flag": flag, "aliases": [], "dest": flag[2:].replace("-", "_"),
                                           "origins": {}, "seen_in_scripts_only": True})
            dates = entry["origins"].setdefault(script["origin"], [script["date"], script["date"]])
            dates[:] = [min(dates[0], script["date"]), max(dates[1], script["date"])]
            following = argv[index + 1] if index + 1 < len(argv) else "--"
            if "=" in token:
                values.setdefault(flag, []).append(token.split("=", 1)[1])
            elif not following.startswith("--"):
                values.setdefault(flag, []).append(following)
    for flag, entry in seen.items():
        given = values.get(flag)
        shape = {"action": "store", "nargs": None, "type": _narrowest_type(given)} if given else \
            {"action": "store_true", "nargs": None, "type": None}
        entry.update(shape, choices=None, default=None if given else False)
    return [{key: entry[key] for key in ("flag", "aliases", "dest", "action", "nargs", "type", "choices", "default",
                                         "origins", "seen_in_scripts_only")} for entry in seen.values()]


def _narrowest_type(values: list[str]) -> str:
    for name, kind in (("int", int), ("float", float)):
        try:
            [kind(value) for value in values]
            return name
        except ValueError:
            continue
    return "str"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the full extraction (megatron_family_flags.json)")
    parser.add_argument("--scripts", help="launch scripts as data (launch_scripts.json)")
    options = parser.parse_args()
    source = json.loads(Path(options.source).read_text())
    origins = {name: {"url": info.get("url"), "releases": [r["date"] for r in info.get("releases", [])]}
               for name, info in source["origins"].items()}
    flags = [compact(record) for record in source["flags"]]
    if options.scripts:
        known = {name for record in flags for name in [record["flag"], *record["aliases"]]}
        flags += seen_in_scripts(json.loads(Path(options.scripts).read_text()), known)
    flags.sort(key=lambda record: record["flag"])
    document = {"about": "Megatron-family argparse flags (facts: names, values, origins); see config/flag_status.py",
                "origins": origins, "flags": flags}
    OUT.write_text(json.dumps(document, indent=None, separators=(",", ":"), ensure_ascii=False)
                   .replace(',{"flag"', ',\n{"flag"') + "\n")
    print(f"{OUT}: {len(flags)} flags")


if __name__ == "__main__":
    main()
