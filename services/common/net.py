"""Host addresses."""

from __future__ import annotations

import os
import socket
import sys

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
"""Bind addresses that mean every interface (never an address to dial from another host)."""


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC reads it: an IPv6 literal in brackets (`[::1]:50071`; unbracketed,
    `::1:50071` is taken as a host name without a port)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


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


def interface_of(address: str) -> str | None:
    """The name of this host's network interface whose (primary) IPv4 address is `address`, or
    None (Linux: SIOCGIFADDR; elsewhere, or for IPv6, None)."""
    try:
        import fcntl
        import struct

        packed = socket.inet_aton(address)
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            if got == packed:
                return name
    return None


def gloo_address(master: str) -> str | None:
    """The local address a gloo group member listens on for its peers: the one this host reaches
    the group's master from, on the network the members share. Torch's default resolves the
    hostname instead, which is loopback in many containers and on Debian (127.0.1.1): members on
    other hosts would dial their own loopback. None (leave torch's default) when the operator set
    GLOO_SOCKET_IFNAME or the master has no route."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    return source_address(master)


def gloo_interface(master: str) -> str | None:
    """GLOO_SOCKET_IFNAME for a process group whose master is `master` (torch's default groups
    take an interface, not an address): the interface holding `gloo_address(master)`."""
    address = gloo_address(master)
    return interface_of(address) if address else None
