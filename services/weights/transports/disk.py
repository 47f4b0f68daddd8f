"""The `disk` transport: safetensors files on a shared filesystem.

    <disk_dir>/v000000000042/
        bucket-00000.safetensors   one file per bucket; its data section is the bucket's bytes
        bucket-00001.safetensors   (layout.py), so any safetensors reader loads it by HF name
        manifest.pb                the version's Manifest (serialized meshrl.v1.Manifest)

The publisher writes into a hidden temporary directory and renames it into place, so a reader
never sees a partial version; it then registers the manifest with the param server (which owns
retention and deletes evicted version directories). The fetcher needs only the directory: it
reads the manifest, checks every file's header against it and every bucket's fingerprint, and
reads a bucket again when it does not match (a torn read on a network filesystem).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import struct
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from google.protobuf.message import DecodeError

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    Unavailable,
)
from services.common.logging import get_logger

from .. import convert
from ..buffers import ByteBuffers
from ..client import ParamServerClient
from ..layout import (
    Fingerprinter,
    Manifest,
    TensorMeta,
    as_bytes,
    dtype_from_safetensors,
    host_view,
    safetensors_dtype,
    unpack,
    validate_manifest,
)
from ..protocols import Bucket, Buckets
from .base import Deadline, ManifestBuilder, PlannedBucket, check_against_manifest, plan_buckets

if TYPE_CHECKING:
    from services.common.config.param_server import ParamServerConfig

log = get_logger(__name__)
TRANSPORT = "disk"
MANIFEST_FILE = "manifest.pb"


def disk_dir(cfg: ParamServerConfig, run_dir: str | os.PathLike[str] | None) -> Path:
    """Where the `disk` transport writes versions."""
    if cfg.disk_dir:
        return Path(cfg.disk_dir)
    if run_dir is None:
        raise ValueError("param_server.disk_dir is not set and there is no run directory; set param_server.disk_dir")
    return Path(run_dir) / "weights"


def version_dir(root: Path, policy_version: int) -> Path:
    return root / f"v{policy_version:012d}"


def bucket_file(directory: Path, index: int) -> Path:
    return directory / f"bucket-{index:05d}.safetensors"


def _header(planned: PlannedBucket, policy_version: int) -> bytes:
    entries: dict[str, object] = {
        "__metadata__": {"format": "pt", "meshrl_policy_version": str(policy_version), "meshrl_bucket": str(planned.index)}
    }
    for m in planned.metas:
        entries[m.name] = {"dtype": safetensors_dtype(m.dtype), "shape": list(m.shape),
                           "data_offsets": [m.offset, m.offset + m.nbytes]}
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_bucket(path: Path, planned: PlannedBucket, policy_version: int) -> str:
    """Write one safetensors file; returns the bucket's fingerprint (its packer's if known,
    packing.py). Worker thread."""
    fp = Fingerprinter(planned.nbytes) if planned.fingerprint is None else None
    ordered = sorted(zip(planned.metas, planned.named, strict=True), key=lambda x: x[0].offset)
    with open(path, "wb") as f:
        f.write(_header(planned, policy_version))
        for meta, (_, t) in ordered:
            if not meta.nbytes:
                continue
            data = host_view(as_bytes(t).cpu())
            if fp is not None:
                fp.update(meta.offset, data)
            f.write(data)
    return fp.hexdigest() if fp is not None else str(planned.fingerprint)


class DiskPublisher:
    """Writes versions under `root`; registers them with the param server when `address` is set."""

    transport = TRANSPORT

    def __init__(self, root: str | os.PathLike[str], *, address: str = "", timeout_s: float = 300.0) -> None:
        self.root = Path(root)
        self.address = address
        self.timeout_s = timeout_s
        self.client = ParamServerClient(address) if address else None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-write")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        self._io.shutdown(wait=False)

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef:
        deadline = Deadline(self.timeout_s, f"publish of version {version} to {self.root}")
        loop = asyncio.get_running_loop()
        self.root.mkdir(parents=True, exist_ok=True)
        final = version_dir(self.root, version)
        tmp = self.root / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        created = registered = False
        try:
            builder = ManifestBuilder(version)
            async for planned in plan_buckets(buckets):
                fut = loop.run_in_executor(self._io, _write_bucket, bucket_file(tmp, planned.index), planned, version)
                fingerprint = await asyncio.wait_for(fut, timeout=deadline.check(f"writing bucket {planned.index}"))
                builder.add(planned, fingerprint)
            manifest = builder.build([TRANSPORT])
            (tmp / MANIFEST_FILE).write_bytes(convert.manifest_to_proto(manifest).SerializeToString())
            if final.exists():
                if _checksum_on_disk(final) != manifest.checksum:
                    await self._replace(final, tmp, manifest, deadline)
                    registered = True
            else:
                os.rename(tmp, final)
                created = True
        except TimeoutError:
            raise deadline.stalled("writing to the shared filesystem", self.timeout_s) from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if self.client is not None and not registered:
            try:
                await self.client.register(manifest, timeout_s=max(deadline.remaining(), 1.0))
            except (Unavailable, DeadlineExceeded):
                raise  # it may have landed: the directory stays for the retry (same content) to register
            except MeshError:
                if created:  # refused: no registration will ever evict it, so nothing may stay behind
                    shutil.rmtree(final, ignore_errors=True)
                raise
        log.info("weights_published", transport=TRANSPORT, policy_version=version, total_bytes=manifest.total_bytes,
                 path=str(final))
        return convert.weights_ref(manifest, self.address)

    async def _replace(self, final: Path, tmp: Path, manifest: Manifest, deadline: Deadline) -> None:
        """`final` holds this version number with other content: the orphan of a trainer that died
        between publish and commit, republished by its successor resumed from a checkpoint (the
        param server's rule, store.py `_commit`). Only the param server knows whether a consumer
        has seen the old content, so it decides first; the files are swapped after it agreed (a
        fetcher that reads in between compares the manifest on disk with the one it acquired and
        waits for the swap, DiskFetcher)."""
        if self.client is None:
            raise FailedPrecondition(
                f"{final} already holds version {manifest.policy_version} with other content, and without a param "
                "server nothing can tell whether a consumer read it; versions are immutable: publish a newer version"
            )
        await self.client.register(manifest, timeout_s=max(deadline.remaining(), 1.0))  # refused: files untouched
        old = final.with_name(f".{final.name}.replaced-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        log.warning("disk_version_replaced", policy_version=manifest.policy_version, path=str(final),
                    checksum=manifest.checksum[:12])


def _checksum_on_disk(directory: Path) -> str:
    """The checksum of the version in `directory` ("" when its manifest is missing or unreadable:
    a directory some other tool left, never one this publisher renamed into place)."""
    try:
        return read_manifest(directory).checksum
    except (MeshError, OSError, DecodeError):
        return ""


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NotFound(
            f"{path} does not exist: the version was not published to this directory, was evicted, or "
            "param_server.disk_dir differs between publisher and fetcher (it must be one shared directory)"
        ) from None
    m = convert.manifest_from_proto(pb.Manifest.FromString(raw))
    validate_manifest(m)
    return m


def newest_on_disk(root: Path) -> int:
    """The newest complete version under `root` (a cold start without a param server)."""
    versions = [int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit() and (p / MANIFEST_FILE).exists()]
    if not versions:
        raise NotFound(f"no version has been published under {root}")
    return max(versions)


def _read_bucket(path: Path, metas: list[TensorMeta], nbytes: int, buf: torch.Tensor) -> str:
    """Read a bucket file into `buf` after checking its header; returns the fingerprint. Worker thread."""
    with open(path, "rb") as f:
        try:  # a torn read hits the header as well as the data: DataLoss, read again like those
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > 100 << 20:
                raise DataLoss(f"{path}: implausible safetensors header of {hlen} bytes")
            header = json.loads(f.read(hlen))
            header.pop("__metadata__", None)
            if set(header) != {m.name for m in metas}:
                raise DataLoss(f"{path}: tensors differ from the manifest's")
            for m in metas:
                e = header[m.name]
                if (dtype_from_safetensors(e["dtype"]) != m.dtype or tuple(e["shape"]) != m.shape
                        or e["data_offsets"] != [m.offset, m.offset + m.nbytes]):
                    raise DataLoss(f"{path}: tensor {m.name} differs from the manifest")
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataLoss(f"{path}: unreadable safetensors header ({exc!r})") from exc
        view = host_view(buf)
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise DataLoss(f"{path}: ends after {got} of {nbytes} data bytes")
            got += n
        if f.read(1):
            raise DataLoss(f"{path}: longer than the manifest says")
    fp = Fingerprinter(nbytes)
    fp.update(0, view)
    return fp.hexdigest()


SWAP_WAIT_S = 5.0
"""How long a fetcher waits for a version directory to match what the param server holds (a
replaced orphan's files are swapped just after the param server accepted the new manifest)."""


class DiskFetcher:
    """Reads versions from `root`; pins them at the param server named in the ref, if any."""

    transport = TRANSPORT

    def __init__(
        self, root: str | os.PathLike[str], *, consumer_id: str, timeout_s: float = 300.0, max_attempts: int = 3,
    ) -> None:
        if not consumer_id:
            raise InvalidArgument("consumer_id", "required (a stable id of this consumer)")
        self.root = Path(root)
        self.consumer_id = consumer_id
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self._bufs = ByteBuffers(2)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-read")
        self._clients: dict[str, ParamServerClient] = {}
        self.reread_buckets = 0

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._io.shutdown(wait=False)

    @staticmethod
    async def _wait_for_swap(directory: Path, manifest: Manifest | None, checksum: str, deadline: Deadline) -> Manifest:
        """The manifest on disk once it is the one the param server handed out (`checksum`);
        `manifest` None: the directory was missing (between the swap's two renames)."""
        waited = 0.0
        while manifest is None or manifest.checksum != checksum:
            if waited >= min(SWAP_WAIT_S, deadline.remaining()):
                if manifest is None:
                    manifest = read_manifest(directory)  # still missing: NotFound, naming the path
                    continue
                raise DataLoss(
                    f"{directory} holds version {manifest.policy_version} with manifest {manifest.checksum[:12]}, the "
                    f"param server holds {checksum[:12]} (after {waited:.1f}s): param_server.disk_dir names another "
                    "directory on this host than on the trainer's, or a publisher without the param server wrote it"
                )
            await asyncio.sleep(0.05)
            waited += 0.05
            with contextlib.suppress(NotFound):  # between the swap's two renames
                manifest = read_manifest(directory)
        return manifest

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        version = ref.policy_version
        deadline = Deadline(self.timeout_s, f"fetch of version {version} from {self.root}")
        client = None
        if ref.param_server_address:
            client = self._clients.setdefault(ref.param_server_address, ParamServerClient(ref.param_server_address))
            acquired = await client.acquire(self.consumer_id, version, timeout_s=deadline.check("AcquireVersion"))
            version = acquired.policy_version
        elif version < 0:
            version = newest_on_disk(self.root)
        try:
            directory = version_dir(self.root, version)
            try:
                found: Manifest | None = read_manifest(directory)
            except NotFound:
                if client is None:
                    raise
                found = None  # between the two renames of a replaced orphan's swap: wait for it
            if client is not None:
                manifest = await self._wait_for_swap(directory, found, acquired.checksum, deadline)
            else:
                assert found is not None
                manifest = found
            check_against_manifest(manifest, ref, f"fetch from {directory}")
            loop = asyncio.get_running_loop()

            def start(index: int) -> asyncio.Future[str]:
                meta = manifest.buckets[index]
                buf = self._bufs.get(index % 2, meta.nbytes)
                return loop.run_in_executor(self._io, _read_bucket, bucket_file(directory, index),
                                            manifest.bucket_tensors(index), meta.nbytes, buf)

            n = len(manifest.buckets)
            pending = start(0) if n else None
            for i in range(n):
                meta = manifest.buckets[i]
                attempts = 0
                while True:
                    assert pending is not None
                    try:
                        fingerprint = await asyncio.wait_for(pending, timeout=max(deadline.remaining(), 0.001))
                    except TimeoutError:
                        raise deadline.stalled(f"reading bucket {i}", self.timeout_s) from None
                    except DataLoss as exc:
                        fingerprint = f"unreadable: {exc}"
                    if fingerprint == meta.fingerprint:
                        break
                    attempts += 1
                    self.reread_buckets += 1
                    if attempts >= self.max_attempts:
                        raise DataLoss(f"{bucket_file(directory, i)}: fails its checksum after {attempts} reads ({fingerprint})")
                    log.warning("bucket_corrupt_rereading", policy_version=version, bucket=i, attempt=attempts)
                    pending = start(i)
                buffer = self._bufs.get(i % 2, meta.nbytes)
                pending = start(i + 1) if i + 1 < n else None  # reads ahead while the consumer loads
                yield unpack(buffer, manifest.bucket_tensors(i))
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.release(self.consumer_id, version, timeout_s=5.0)
