"""start_serve(wait_for_proxies=False) where Serve runs already (the session's Serve,
tests/conftest.py, was started that way and checked to listen once its wait returned): nothing is
created a second time."""

from __future__ import annotations

import ray
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from services.common.serve_util import free_port, start_serve


def test_a_second_start_creates_no_second_controller_or_proxy(serve_grpc_port: int) -> None:
    status = serve.status()
    assert len(status.proxies) == 1
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    # Serve runs already: nothing is created, the returned wait does nothing.
    again = start_serve(free_port(), http_port=free_port(), wait_for_proxies=False)
    again()
    assert ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)._actor_id == controller._actor_id
    assert serve.status().proxies.keys() == status.proxies.keys()  # no second proxy
