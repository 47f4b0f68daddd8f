"""Reading back what a tracker library stored, in its own format."""

from __future__ import annotations

import glob
import json
import struct
import time
from pathlib import Path
from typing import Any


def _wandb_records(path: str) -> tuple[list[Any], bool]:
    """The Records of a .wandb file (a leveldb-style log of protobuf Records: 7-byte file header,
    32 KiB blocks, 7-byte record headers) and whether the run's `exit` record ends them. A record
    cut short (its writer still appending) ends the read as not complete."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, head, i, buf, out = 32768, 7, 7, b"", []
    while i + head <= len(data):
        if block - i % block < head:
            i += block - i % block
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + head])
        chunk, i = data[i + head:i + head + length], i + head + length
        if kind == 0 or len(chunk) < length:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            try:
                rec.ParseFromString(buf)
            except DecodeError:
                return out, False
            out.append(rec)
    return out, bool(out) and out[-1].WhichOneof("record_type") == "exit"


def wandb_history(run_dir: Path, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The history records of an offline wandb run, from its .wandb file. wandb's writer (its own
    process) may still be appending when `finish()` returns on a loaded machine (CI read a half-written
    record once): the file is read again until the run's `exit` record ends it."""
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    records, complete = _wandb_records(path)
    while not complete and time.monotonic() < deadline:
        time.sleep(0.2)
        records, complete = _wandb_records(path)
    assert complete, f"{path}: no exit record after {timeout_s} s ({len(records)} records readable)"
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            for rec in records if rec.WhichOneof("record_type") == "history"]
