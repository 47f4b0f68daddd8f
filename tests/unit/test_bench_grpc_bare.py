"""The bare grpc yardstick streams each bucket's own bytes, loose tensors packed first."""

from __future__ import annotations

import torch

from meshrl.bench.weights_grpc_bare import _views
from services.weights.packing import pack_bucket


def test_the_yardstick_streams_the_bytes_the_transport_streams() -> None:
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)
    packed = pack_bucket([("a", a), ("b", b)])
    loose = [("a", a), ("b", b)]
    got = _views([packed, loose])
    assert [len(v) for v in got] == [packed.buffer.numel(), packed.buffer.numel()]
    assert bytes(got[0]) == bytes(got[1]) and bytes(got[0])[:24] == a.numpy().tobytes()
