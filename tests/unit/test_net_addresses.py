"""host:port strings for IPv6 hosts: gRPC reads `::1:50071` as a host name (no port), so an IPv6
literal must be bracketed wherever a host and a port are joined."""

from __future__ import annotations

import pytest

from services.common import net
from services.common.config.param_server import ParamServerConfig, data_address


@pytest.mark.parametrize(("host", "want"), [
    ("127.0.0.1", "127.0.0.1:50071"), ("localhost", "localhost:50071"), ("0.0.0.0", "0.0.0.0:50071"),
    ("::", "[::]:50071"), ("[::]", "[::]:50071"), ("::1", "[::1]:50071"), ("fd00::5", "[fd00::5]:50071"),
])
def test_host_port_brackets_ipv6_literals(host: str, want: str) -> None:
    assert net.host_port(host, 50071) == want


def test_the_param_server_data_address_of_an_ipv6_host_is_dialable() -> None:
    assert data_address(ParamServerConfig(host="::1", port=50071)) == "[::1]:50071"


def test_an_ipv6_node_address_is_advertised_bracketed(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.param_server import server

    monkeypatch.setattr(server, "local_ip", lambda: "fd00::5")
    assert server.advertised(ParamServerConfig(host="::", port=50071), 50071) == "[fd00::5]:50071"


def test_a_param_server_on_the_ipv6_wildcard_binds() -> None:
    """`::` is one of net.WILDCARD_HOSTS (the multi-node switch); the server must bind it."""
    import asyncio

    from services.param_server.server import ParamServerServer

    async def main() -> int:
        return ParamServerServer(ParamServerConfig(host="::", port=0)).port

    assert asyncio.run(main()) > 0
