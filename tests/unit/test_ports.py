"""Two runs on one node must not share a port silently (grpc's SO_REUSEPORT default would
split one server's connections between both)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from meshrl.train import wire
from services.common.config import load_config
from services.common.grpc_util import bind_port, create_server


def test_second_server_on_a_port_in_use_fails_naming_the_key() -> None:
    async def main() -> None:
        first = create_server()
        port = bind_port(first, "127.0.0.1:0", "param_server.port")
        await first.start()
        try:
            with pytest.raises(OSError, match=r"param_server\.port.*in use"):
                bind_port(create_server(), f"127.0.0.1:{port}", "param_server.port")
        finally:
            await first.stop(None)

    asyncio.run(main())


def test_wire_moves_the_param_server_off_a_busy_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = wire(load_config(None, [f"param_server.port={port}"]), 9000)
        assert cfg.param_server.port not in (0, port)
        # An advertised address is the user's statement of where it runs: left alone.
        kept = wire(load_config(None, [f"param_server.port={port}", "param_server.advertise_address=10.0.0.5:1234"]), 9000)
        assert kept.param_server.port == port


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`meshrl train` picks the gRPC ingress, the param server's and the HTTP proxy's ports with
    free_port before any of them is bound: one pick must not be given again to another."""
    import random

    from services.common.serve_util import free_port

    draws = iter([24680, 24680, 24681])
    monkeypatch.setattr(random, "randint", lambda a, b: next(draws))
    first, second = free_port(), free_port()
    assert first != second
