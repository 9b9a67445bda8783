"""Fine-tuning data from local files only (`--data-dir`, `--data-name`): GLUE-style .tsv/.csv/.jsonl
split files, or a Hugging Face datasets folder written by `save_to_disk`. Never the network."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Literal

from rapidtrain.data.indexed import DataFileError

SPLIT_FILE_EXTENSIONS = (".tsv", ".csv", ".jsonl")
# GLUE names its validation file dev.tsv; everything is exposed under the Hugging Face names.
SPLIT_ALIASES = {"dev": "validation", "valid": "validation", "val": "validation"}


class DatasetNotFoundLocallyError(DataFileError):
    """A fine-tuning dataset name that is no local folder; the message says how to supply one."""


def _convert_column(values: list[str]) -> list[Any]:
    # The same inference the datasets csv loader makes: a column of integers is int, of numbers float.
    for kind in (int, float):
        try:
            return [kind(v) for v in values]
        except ValueError:
            continue
    return values


def _read_delimited(path: Path, delimiter: str) -> list[dict[str, Any]]:
    with open(path, newline="", encoding="utf-8") as f:
        # GLUE .tsv files contain unbalanced quotes inside sentences: tabs are the only structure.
        quoting: Literal[0, 1, 2, 3] = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
        reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
        header = next(reader, None)
        if header is None:
            return []
        rows = [row for row in reader if row]
    for line, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise DataFileError(
                f"{path}, line {line}: {len(row)} fields but the header has {len(header)} "
                f"({', '.join(header)}); fix the row or quote fields that contain the separator"
            )
    columns = {name: _convert_column([row[i] for row in rows]) for i, name in enumerate(header)}
    return [{name: columns[name][i] for name in header} for i in range(len(rows))]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataFileError(f"{path}, line {line_number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise DataFileError(f"{path}, line {line_number}: a JSON {type(record).__name__}, not an object of "
                                    "column → value; write one record a line")
            records.append(record)
    return records


def read_split_file(path: str | os.PathLike) -> list[dict[str, Any]]:
    """One split file as a list of records (.tsv and .csv need a header row)."""
    path = Path(path)
    readers = {".tsv": lambda: _read_delimited(path, "\t"), ".csv": lambda: _read_delimited(path, ","),
               ".jsonl": lambda: _read_jsonl(path)}
    if path.suffix not in readers:
        raise DataFileError(f"{path}: unsupported file type; use .tsv, .csv or .jsonl")
    try:
        return readers[path.suffix]()
    except UnicodeDecodeError as error:
        raise DataFileError(f"{path}: not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    except csv.Error as error:
        raise DataFileError(f"{path}: not readable as {path.suffix[1:]} ({error}); fix or re-export it") from None
    except OSError as error:
        raise DataFileError(f"{path}: cannot read it ({error.strerror or error})") from None


def _split_files(folder: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix in SPLIT_FILE_EXTENSIONS:
            split = SPLIT_ALIASES.get(path.stem, path.stem)
            if split in files:
                raise DataFileError(
                    f"{folder}: both {files[split].name} and {path.name} give the {split!r} split; keep one"
                )
            files[split] = path
    return files if "train" in files or "validation" in files or "test" in files else {}


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _candidate_folders(data_dir: str | None, data_name: str | None) -> list[Path]:
    name = Path(*data_name.replace(":", "/").split()) if data_name else None
    if not data_dir:
        return [name] if name else []
    return [Path(data_dir) / name, Path(data_dir)] if name else [Path(data_dir)]


def _not_found(data_dir: str | None, data_name: str | None, looked: list[Path]) -> DataFileError:
    name = data_name or "<name>"
    hub_args = ", ".join(repr(part) for part in name.replace("/", " ").split())
    return DatasetNotFoundLocallyError(
        f"fine-tuning dataset {name!r} not found locally (looked in: {', '.join(map(str, looked))}). "
        "rapidtrain never downloads data. Put train/dev/test .tsv, .csv or .jsonl files in "
        f"--data-dir/{name}/, or, on a machine with network, run "
        f"`python -c \"import datasets; datasets.load_dataset({hub_args}).save_to_disk('DIR')\"`, "
        "copy DIR here and pass --data-dir DIR"
    )


def load_finetune_dataset(data_dir: str | None, data_name: str | None = None):
    """The splits of a local fine-tuning dataset.

    Looks in `data_dir/data_name/`, then `data_dir` itself. A folder of split files gives
    {"train": [...], "validation": [...], "test": [...]} (lists of dicts, dev renamed validation);
    a `save_to_disk` folder gives its `datasets.DatasetDict` (a single saved Dataset becomes "train").
    """
    looked = _candidate_folders(data_dir, data_name)
    for folder in looked:
        if not folder.is_dir():
            continue
        if _is_saved_dataset(folder):
            return _load_saved(folder)
        files = _split_files(folder)
        if files:
            return {split: read_split_file(path) for split, path in files.items()}
    raise _not_found(data_dir, data_name, looked)


def _load_saved(folder: Path):
    """The folder's splits, each Arrow table checked whole: `datasets` memory-maps the .arrow files and trusts their
    offsets, so a damaged one would fail (or read out of bounds) only when a row is read, deep in training."""
    import datasets
    import pyarrow

    try:
        loaded = datasets.load_from_disk(str(folder))
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict({"train": loaded})
        for split in loaded.values():
            split.data.table.validate(full=True)  # offsets in bounds, strings UTF-8: O(size), once
    # Damage meets load_from_disk as whatever its JSON, path and Arrow code raise on it.
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, pyarrow.ArrowException) as error:
        reason = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        raise DataFileError(
            f"--data-dir {folder}: a damaged datasets save_to_disk folder ({reason}); save it again with "
            "save_to_disk, or give the splits as .tsv, .csv or .jsonl files") from None
    return loaded
