"""Proto <-> Python for weight manifests and refs (what every transport and the param server share)."""

from __future__ import annotations

from meshrl.v1 import common_pb2, param_server_pb2
from services.common.errors import InvalidArgument

from .adapter import AdapterSpec
from .layout import BucketMeta, Manifest, TensorMeta, dtype_from_proto, dtype_to_proto


def manifest_to_proto(m: Manifest) -> param_server_pb2.Manifest:
    return param_server_pb2.Manifest(
        policy_version=m.policy_version,
        tensors=[
            param_server_pb2.TensorMeta(
                name=t.name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape),  # type: ignore[arg-type]
                bucket_index=t.bucket_index, offset=t.offset, nbytes=t.nbytes,
            )
            for t in m.tensors
        ],
        buckets=[bucket_to_proto(b) for b in m.buckets],
        total_bytes=m.total_bytes,
        checksum=m.checksum,
        created_unix_s=m.created_unix_s,
        transports=list(m.transports),
        adapter=adapter_to_proto(m.adapter) if m.adapter is not None else None,
    )


def manifest_from_proto(p: param_server_pb2.Manifest) -> Manifest:
    tensors = []
    for t in p.tensors:
        if not t.name:
            raise InvalidArgument("manifest.tensors.name", "empty tensor name")
        tensors.append(
            TensorMeta(
                name=t.name, dtype=dtype_from_proto(t.dtype), shape=tuple(int(s) for s in t.shape),
                bucket_index=t.bucket_index, offset=t.offset, nbytes=t.nbytes,
            )
        )
    return Manifest(
        policy_version=p.policy_version,
        tensors=tuple(tensors),
        buckets=tuple(bucket_from_proto(b) for b in p.buckets),
        total_bytes=p.total_bytes,
        checksum=p.checksum,
        created_unix_s=p.created_unix_s,
        transports=tuple(p.transports),
        adapter=adapter_from_proto(p.adapter) if p.HasField("adapter") else None,
    )


def adapter_to_proto(a: AdapterSpec) -> param_server_pb2.AdapterInfo:
    return param_server_pb2.AdapterInfo(
        base_model=a.base_model, rank=a.rank, alpha=a.alpha, target_modules=list(a.target_modules)
    )


def adapter_from_proto(p: param_server_pb2.AdapterInfo) -> AdapterSpec:
    return AdapterSpec(base_model=p.base_model, rank=p.rank, alpha=p.alpha, target_modules=tuple(p.target_modules))


def bucket_to_proto(b: BucketMeta) -> param_server_pb2.BucketMeta:
    return param_server_pb2.BucketMeta(index=b.index, nbytes=b.nbytes, sha256=b.sha256, fingerprint=b.fingerprint)


def bucket_from_proto(p: param_server_pb2.BucketMeta) -> BucketMeta:
    return BucketMeta(index=p.index, nbytes=p.nbytes, fingerprint=p.fingerprint, sha256=p.sha256)


def weights_ref(m: Manifest, address: str) -> common_pb2.WeightsRef:
    """The ref that names version `m` at the param server's data plane `address`."""
    return common_pb2.WeightsRef(
        policy_version=m.policy_version, param_server_address=address,
        manifest_checksum=m.checksum, total_bytes=m.total_bytes,
    )
