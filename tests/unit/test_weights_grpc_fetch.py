"""The grpc fetcher against the param server's real store and servicer, its gRPC client replaced by
a fake that passes the manifests through their protos (as the wire does) and may damage them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DataLoss
from services.param_server.servicer import ParamServerServicer
from services.param_server.store import StoreSettings, WeightStore
from services.weights import convert
from services.weights.layout import Manifest, dtype_to_proto
from services.weights.transports.grpc import GrpcFetcher

from .test_param_server_store import make_version, upload

ADDRESS = "param-server:1"


class _Call:
    """A FetchWeights call: the servicer's stream, as the raw codec hands it to the fetcher."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.items

    def cancel(self) -> None:
        pass


class FakeClient:
    """ParamServerClient over a servicer in this process; `damage` may alter the manifest
    AcquireVersion answers with (a flipped bit in flight)."""

    def __init__(self, servicer: ParamServerServicer, damage: Callable[[pb.Manifest], None] | None = None) -> None:
        self.servicer = servicer
        self.damage = damage
        self.released: list[tuple[str, int]] = []

    async def acquire(self, consumer_id: str, policy_version: int, *, timeout_s: float | None = None) -> Manifest:
        m = convert.manifest_to_proto(self.servicer.store.acquire(consumer_id, policy_version, 0.0))
        if self.damage is not None:
            self.damage(m)
        return convert.manifest_from_proto(pb.Manifest.FromString(m.SerializeToString()))

    def fetch(self, request: pb.FetchWeightsRequest, *, timeout_s: float) -> _Call:
        return _Call(self.servicer.fetch_items(request))

    async def release(self, consumer_id: str, policy_version: int, *, timeout_s: float | None = None) -> None:
        self.released.append((consumer_id, policy_version))
        self.servicer.store.release(consumer_id, policy_version, 0.0)

    async def close(self) -> None:
        pass


def _serve(version: int) -> tuple[ParamServerServicer, Manifest, list[torch.Tensor]]:
    store = WeightStore(StoreSettings())
    m, buffers = make_version(version)
    upload(store, m, buffers, 0.0, manifest_first=True)
    return ParamServerServicer(store, clock=lambda: 0.0), m, buffers


async def _fetch_all(fetcher: GrpcFetcher, version: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    async for bucket in fetcher.fetch(convert.weights_ref(Manifest(version, (), (), 0, ""), ADDRESS)):
        for name, t in bucket:
            out[name] = t.clone()
    return out


def test_the_fake_client_round_trips_a_version_bit_exact() -> None:
    servicer, m, _ = _serve(3)
    fetcher = GrpcFetcher(consumer_id="rollout-0", tune_malloc=False)
    fetcher._clients[ADDRESS] = FakeClient(servicer)  # type: ignore[assignment]
    got = asyncio.run(_fetch_all(fetcher, 3))
    assert set(got) == {t.name for t in m.tensors}
    assert got["layer0.weight"].dtype == torch.bfloat16


def test_a_manifest_damaged_in_flight_is_data_loss_not_weights_read_as_another_dtype() -> None:
    """The fingerprints cover a bucket's bytes; the manifest says where each tensor lies in them,
    its dtype, shape and name. One flipped bit in the AcquireVersion answer turned a bf16 tensor
    (DType 3) into fp16 (DType 2): the buckets still passed their fingerprints and the fetcher
    yielded the bf16 bytes as fp16 weights (the manifest's checksum field, the only thing
    compared, was intact). The checksum covers that metadata: recomputed, it fails."""
    servicer, _, _ = _serve(3)
    assert dtype_to_proto(torch.bfloat16) ^ 1 == dtype_to_proto(torch.float16)

    def flip_dtype(p: pb.Manifest) -> None:
        t = next(t for t in p.tensors if t.name == "layer0.weight")
        t.dtype ^= 1  # BF16 -> F16

    client = FakeClient(servicer, damage=flip_dtype)
    fetcher = GrpcFetcher(consumer_id="rollout-0", tune_malloc=False)
    fetcher._clients[ADDRESS] = client  # type: ignore[assignment]
    with pytest.raises(DataLoss, match="checksum"):
        asyncio.run(_fetch_all(fetcher, 3))
    assert client.released == [("rollout-0", 3)]  # the hold it took goes too
    assert servicer.store.get(3).holds == {}
