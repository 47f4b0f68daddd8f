"""Reading back what a tracker library stored, in its own format."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path
from typing import Any


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history records of an offline wandb run, from its .wandb file (a leveldb-style log of
    protobuf Records: 7-byte file header, 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, head, i, buf, out = 32768, 7, 7, b"", []
    while i + head <= len(data):
        if block - i % block < head:
            i += block - i % block
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + head])
        chunk, i = data[i + head:i + head + length], i + head + length
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                out.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in rec.history.item})
    return out
