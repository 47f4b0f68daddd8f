"""A real TCP proxy that can damage or freeze a byte stream, for transport fault tests.

It forwards bytes between a client and a server unchanged, except:
- `corrupt_once(marker, direction)`: the first time `marker` passes in `direction` ("down" =
  server to client, "up" = client to server), one byte inside it is flipped (so the damage lands
  in payload, never in protocol framing);
- `stall(direction, after_bytes)`: after that many bytes in `direction`, stop forwarding (the
  connection stays open: a peer that is stuck, not one that died).
"""

from __future__ import annotations

import asyncio
import contextlib


class FaultyProxy:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.corrupt: dict[str, bytes] = {}
        self.corrupted = 0
        self.stall_after: dict[str, int] = {}
        self.forwarded = {"up": 0, "down": 0}
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.address = ""

    def corrupt_once(self, marker: bytes, direction: str = "down") -> None:
        self.corrupt[direction] = marker

    def stall(self, direction: str, after_bytes: int) -> None:
        self.stall_after[direction] = self.forwarded[direction] + after_bytes

    async def start(self) -> FaultyProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        for src, dst, direction in ((reader, up_writer, "up"), (up_reader, writer, "down")):
            task = asyncio.ensure_future(self._pump(src, dst, direction))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        held = b""
        try:
            while True:
                data = await src.read(1 << 16)
                if not data:
                    break
                data = held + data
                marker = self.corrupt.get(direction)
                keep = 0
                if marker is not None:
                    at = data.find(marker)
                    if at >= 0:
                        buf = bytearray(data)
                        buf[at + len(marker) // 2] ^= 0xFF
                        data = bytes(buf)
                        del self.corrupt[direction]
                        self.corrupted += 1
                    else:
                        keep = _partial_suffix(data, marker)  # the marker may straddle two reads
                out, held = (data[: len(data) - keep], data[len(data) - keep :]) if keep else (data, b"")
                limit = self.stall_after.get(direction)
                if limit is not None and self.forwarded[direction] + len(out) > limit:
                    out = out[: max(0, limit - self.forwarded[direction])]
                    dst.write(out)
                    self.forwarded[direction] += len(out)
                    await asyncio.Event().wait()  # frozen: the peer waits forever
                dst.write(out)
                self.forwarded[direction] += len(out)
                await dst.drain()
            if held:
                dst.write(held)
            dst.close()
        except (ConnectionError, asyncio.CancelledError):
            dst.close()


def _partial_suffix(data: bytes, marker: bytes) -> int:
    """Length of the longest end of `data` that begins `marker` (held back until the next read)."""
    for k in range(min(len(marker) - 1, len(data)), 0, -1):
        if data.endswith(marker[:k]):
            return k
    return 0
