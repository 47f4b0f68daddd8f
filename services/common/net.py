"""Host addresses."""

from __future__ import annotations

import socket
import sys

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
"""Bind addresses that mean every interface (never an address to dial from another host)."""


def local_ip() -> str:
    """This host's address as other hosts see it. Inside a Ray cluster: the node's IP as Ray
    knows it (the operator may have chosen it with `ray start --node-ip-address`, and a node
    without a default route has no other way to tell). Otherwise the address of the interface
    that routes outward (best effort, no traffic sent), or loopback."""
    ray = sys.modules.get("ray")  # only when this process already uses Ray: never import it here
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def source_address(host: str, port: int = 1) -> str | None:
    """The local address this host reaches `host` from (the route's source address: no traffic
    sent), or None when there is no route or `host` does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)
                return str(s.getsockname()[0])
            except OSError:
                continue
    return None
