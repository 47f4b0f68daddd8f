"""start_serve(wait_for_proxies=False), as `meshrl train` starts Serve: the controller first, the
proxies' wait after the deploy (the session's Serve, tests/conftest.py, was started this way)."""

from __future__ import annotations

import socket

import ray
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from services.common.serve_util import free_port, start_serve


def test_the_split_start_gives_a_serve_whose_proxies_are_up_and_is_not_repeated(serve_grpc_port: int) -> None:
    # The proxies' wait returned: the gRPC ingress listens (the controller's status may still say STARTING).
    with socket.create_connection(("127.0.0.1", serve_grpc_port), timeout=5):
        pass
    status = serve.status()
    assert len(status.proxies) == 1
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    # Serve runs already: nothing is created, the returned wait does nothing.
    again = start_serve(free_port(), http_port=free_port(), wait_for_proxies=False)
    again()
    assert ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)._actor_id == controller._actor_id
    assert serve.status().proxies.keys() == status.proxies.keys()  # no second proxy
