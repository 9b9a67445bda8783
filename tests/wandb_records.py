"""Read back what a W&B offline run wrote: its `run-ID.wandb` file, records in W&B's own protobuf schema
(`wandb.proto.wandb_internal_pb2.Record`) framed as a LevelDB log (32 KiB blocks of checksum, length, type and
data; a 7-byte ":W&B" header first). wandb 0.31 ships no Python reader for the file (its Go core reads it), so
only the framing is decoded here; each record is parsed by wandb's protobuf classes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # b":W&B" + a 2-byte magic + a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path}: not a W&B data file")
    records, pending, position = [], b"", HEADER
    while position + 7 <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < 7:  # too little room for a record header: the block is padded
            position += left_in_block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:  # zero padding to the block's end
            position += left_in_block
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            records.append(pending)
            pending = b""
    return records


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """{"project", "name", "config": {key: value}, "history": {step: {key: value}}} of one offline run folder."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("run-*.wandb")
    run: dict[str, Any] = {"config": {}, "history": {}}
    for raw in raw_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"], run["name"] = record.run.project, record.run.display_name
            run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.history.item}
            run["history"].setdefault(record.history.step.num, {}).update(values)
    return run
