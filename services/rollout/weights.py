"""How a rollout replica gets the tensors of a published policy version.

    class WeightFetcher(Protocol):
        def fetch(self, ref: WeightsRef) -> AsyncIterator[list[tuple[str, torch.Tensor]]]

`fetch` is an async generator of buckets of (Hugging Face name, tensor); the engine loads each
bucket as it arrives (RolloutEngine.load_weights). Transports (grpc, object_store, nccl/hccl, disk)
live with the param server and implement this protocol. Here are the two in-process ones that tests
and single-process runs use:

- InMemoryWeightStore: `publish(version, named_tensors)` keeps buckets in a dict; fetch reads them.
- DirectoryWeightFetcher: version v is `<root>/v<v>/bucket-*.safetensors` (written by
  `write_version_dir`), one file per bucket, with `manifest.json` holding each file's sha256; a
  bucket whose bytes do not match raises DataLoss.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from meshrl.v1 import common_pb2
from services.common.errors import DataLoss, NotFound
from services.param_server.layout import group_by_bytes

Bucket = list[tuple[str, torch.Tensor]]


@runtime_checkable
class WeightFetcher(Protocol):
    """Source of published weights, by version."""

    def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        """Buckets of the version `ref.policy_version`, HF-named. Raises NotFound when the version
        is not (or no longer) available, DataLoss on a checksum mismatch."""
        ...


def split_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Group tensors into buckets of at most bucket_bytes (a larger tensor travels alone)."""
    return list(group_by_bytes(named, bucket_bytes))


def model_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A model's weights by HF name, tied aliases once (what a trainer publishes)."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append((name, t.detach().clone()))
    return out


class InMemoryWeightStore:
    """Versions held in this process (tests, the in-process trainer publisher)."""

    def __init__(self, bucket_bytes: int = 1 << 20) -> None:
        self.bucket_bytes = bucket_bytes
        self._versions: dict[int, list[Bucket]] = {}

    def publish(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> common_pb2.WeightsRef:
        buckets = split_buckets(((n, t.detach().cpu().clone()) for n, t in named), self.bucket_bytes)
        self._versions[version] = buckets
        total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        return common_pb2.WeightsRef(policy_version=version, total_bytes=total)

    def versions(self) -> list[int]:
        return sorted(self._versions)

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        buckets = self._versions.get(ref.policy_version)
        if buckets is None:
            raise NotFound(f"policy version {ref.policy_version} is not published (have {self.versions()})")
        for b in buckets:
            yield list(b)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_version_dir(
    root: str | os.PathLike[str], version: int, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 1 << 20
) -> common_pb2.WeightsRef:
    """Write version `version` under root for DirectoryWeightFetcher; returns its WeightsRef
    (manifest_checksum = sha256 of manifest.json)."""
    from safetensors.torch import save_file

    vdir = Path(root) / f"v{version}"
    vdir.mkdir(parents=True, exist_ok=True)
    files = []
    total = 0
    for i, bucket in enumerate(split_buckets(named, bucket_bytes)):
        path = vdir / f"bucket-{i:05d}.safetensors"
        save_file({n: t.detach().cpu().contiguous() for n, t in bucket}, str(path))
        files.append({"file": path.name, "sha256": _sha256(path)})
        total += path.stat().st_size
    manifest = vdir / "manifest.json"
    manifest.write_text(json.dumps({"policy_version": version, "buckets": files}, indent=1))
    return common_pb2.WeightsRef(policy_version=version, manifest_checksum=_sha256(manifest), total_bytes=total)


class DirectoryWeightFetcher:
    """Reads versions written by write_version_dir (a shared filesystem works the same way)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        from safetensors.torch import load_file

        vdir = self.root / f"v{ref.policy_version}"
        manifest = vdir / "manifest.json"
        if not manifest.exists():
            raise NotFound(f"policy version {ref.policy_version} has no manifest under {self.root}")
        if ref.manifest_checksum and _sha256(manifest) != ref.manifest_checksum:
            raise DataLoss(f"{manifest}: checksum does not match the published WeightsRef")
        for entry in json.loads(manifest.read_text())["buckets"]:
            path = vdir / entry["file"]
            if _sha256(path) != entry["sha256"]:
                raise DataLoss(f"{path}: sha256 mismatch")
            yield list(load_file(str(path)).items())
