"""Host addresses."""

from __future__ import annotations

import socket


def local_ip() -> str:
    """This host's address as other hosts see it (best effort, no traffic sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
