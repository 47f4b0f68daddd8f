"""`meshrl bench weights`, grpc's yardstick: the same bytes in the same chunks between the same two
kinds of process, through grpc.aio with nothing else on either side.

    publish: this process ──bytes(chunk) per message──▶ Sink (a second process: counts them)
    fetch  : Source (a second process: sends one prebuilt chunk N times) ──▶ this process (counts)

The transport's publish does what the sink's caller does (one copy of each chunk into its message)
and more: the param server copies and fingerprints every chunk, checks every bucket, and holds the
version. The transport's fetch copies and fingerprints what the source's caller only counts. So
the ratios transport / bare say what meshrl's own work costs on this machine's cores, apart from
what grpc-python itself can move here (the 1 GB/s target is a number about both).
Both servers use meshrl's server and channel options (message sizes, keepalive), and both processes
tune malloc as the transport's do (`hostmem.tune_malloc`: without it every 4 MiB message is a fresh
mmap whose pages fault in again; on the 2-core sandbox that alone held grpc.aio to ~0.8 GB/s,
against 0.9-1.3 GB/s tuned, which made the transport look closer to its yardstick than it is)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import struct
import time
from typing import Any

import grpc
import grpc.aio

from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, message_options, server_options
from services.weights.hostmem import tune_malloc

SERVICE = "meshrl.bench.BareStream"
SINK = f"/{SERVICE}/Sink"
SOURCE = f"/{SERVICE}/Source"


def _identity(b: bytes) -> bytes:
    return b


async def _sink(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
    n = 0
    async for chunk in requests:
        n += len(chunk)
    return struct.pack("<Q", n)


async def _source(request: bytes, context: grpc.aio.ServicerContext) -> Any:
    total, chunk_bytes = struct.unpack("<QQ", request)
    chunk = bytes(chunk_bytes)  # one prebuilt message body, sent as often as the bytes need
    for off in range(0, total, chunk_bytes):
        yield chunk if total - off >= chunk_bytes else chunk[: total - off]


def _serve(out: Any) -> None:
    tuned = tune_malloc()

    async def main() -> None:
        server = grpc.aio.server(options=server_options(DEFAULT_MAX_MESSAGE_BYTES))
        handlers = {
            "Sink": grpc.stream_unary_rpc_method_handler(_sink, request_deserializer=_identity,
                                                         response_serializer=_identity),
            "Source": grpc.unary_stream_rpc_method_handler(_source, request_deserializer=_identity,
                                                           response_serializer=_identity),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out.put((f"127.0.0.1:{port}", tuned))
        await server.wait_for_termination()

    asyncio.run(main())


def _views(weights: list) -> list[memoryview]:
    """Each bucket's bytes, as the transport streams them: a packed bucket's own buffer
    (packing.PackedBucket), loose tensors packed into one first."""
    from services.weights.layout import host_view
    from services.weights.packing import pack_bucket

    return [host_view((b if hasattr(b, "buffer") else pack_bucket(b)).buffer) for b in weights]


def bench_grpc_bare(weights: list, nbytes: int, rounds: int, chunk_mb: int, warmup: int = 0) -> dict[str, Any]:
    """Rounds (cold, `warmup`, steady) of a publish into the sink and a fetch from the source of
    `nbytes` in `chunk_mb` MiB messages; `_summary`'s fields per direction."""
    from .weights import _summary

    tuned = tune_malloc()  # as GrpcPublisher and GrpcFetcher do in this process
    chunk_bytes = chunk_mb << 20
    views = _views(weights)
    assert sum(len(v) for v in views) == nbytes, "the weights do not hold nbytes"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(q,), daemon=True)
    proc.start()
    try:
        address, server_tuned = q.get(timeout=120)

        async def main() -> list[dict[str, float]]:
            async with grpc.aio.insecure_channel(address, options=message_options(DEFAULT_MAX_MESSAGE_BYTES)) as ch:
                sink = ch.stream_unary(SINK, request_serializer=_identity, response_deserializer=_identity)
                source = ch.unary_stream(SOURCE, request_serializer=_identity, response_deserializer=_identity)

                async def chunks() -> Any:
                    for view in views:
                        for off in range(0, len(view), chunk_bytes):
                            yield bytes(view[off : off + chunk_bytes])  # the one copy the transport makes too

                out = []
                for _ in range(1 + warmup + rounds):
                    t0 = time.perf_counter()
                    (sunk,) = struct.unpack("<Q", await sink(chunks()))
                    t1 = time.perf_counter()
                    got = 0
                    async for msg in source(struct.pack("<QQ", nbytes, chunk_bytes)):
                        got += len(msg)
                    t2 = time.perf_counter()
                    assert sunk == nbytes and got == nbytes, f"bare grpc moved {sunk} / {got} of {nbytes} bytes"
                    out.append({"publish": t1 - t0, "fetch": t2 - t1})
                return out

        return {"where": "grpc.aio alone, a second process, loopback", "malloc_tuned": tuned and server_tuned,
                **_summary(nbytes, asyncio.run(main()), warmup)}
    finally:
        proc.kill()
        proc.join(10)
