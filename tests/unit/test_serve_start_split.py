"""start_serve(wait_for_proxies=False): the controller is created and its client cached at once;
the proxies are waited for only when the returned function is called, and a proxy's failure is
raised there. Ray's private pieces are replaced by fakes here (no Ray); the real start runs in the
integration tier (tests/conftest.py's Serve, tests/integration/test_serve_start.py)."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from ray.serve import context as serve_context

from services.common import serve_util

PROXY_REF = object()


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {"created": [], "cached": [], "waited": [], "started": []}
    from ray.serve._private import api, client

    def create(**kwargs: Any) -> tuple[str, list[object]]:
        seen["created"].append(kwargs)
        return "controller", [PROXY_REF]

    def get(refs: Any, timeout: float | None = None) -> Any:
        seen["waited"].append((refs, timeout))
        if seen.get("proxy_error"):
            raise seen["proxy_error"]
        return [None]

    monkeypatch.setattr(api, "_create_controller_and_proxy_refs", create)
    monkeypatch.setattr(client, "ServeControllerClient", lambda controller: ("client", controller))
    monkeypatch.setattr(serve_context, "_get_global_client", lambda raise_if_no_controller_running=True: seen.get("running"))
    monkeypatch.setattr(serve_context, "_set_global_client", lambda c: seen["cached"].append(c))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray.serve, "start", lambda **kwargs: seen["started"].append(kwargs))
    return seen


def test_the_controller_first_and_the_proxies_when_asked(fake_ray: dict[str, Any]) -> None:
    ready = serve_util.start_serve(9100, http_port=8100, request_timeout_s=5.0, wait_for_proxies=False)
    (created,) = fake_ray["created"]
    assert created["grpc_options"].port == 9100 and created["http_options"].port == 8100
    assert created["grpc_options"].request_timeout_s == 5.0 and created["proxy_location"] == "HeadOnly"
    assert fake_ray["cached"] == [("client", "controller")]  # serve.run_many finds this client
    assert fake_ray["waited"] == [] and fake_ray["started"] == []
    ready()
    assert [refs for refs, _ in fake_ray["waited"]] == [[PROXY_REF]]


def test_a_proxy_that_failed_is_raised_by_the_wait(fake_ray: dict[str, Any]) -> None:
    ready = serve_util.start_serve(9100, wait_for_proxies=False)
    fake_ray["proxy_error"] = ray.exceptions.GetTimeoutError("slow")
    with pytest.raises(TimeoutError, match="proxies were not up"):
        ready()
    fake_ray["proxy_error"] = RuntimeError("Failed to bind to address 0.0.0.0:9100")
    with pytest.raises(RuntimeError, match="bind"):
        ready()


def test_serve_start_where_serve_runs_or_when_asked_to_wait(fake_ray: dict[str, Any]) -> None:
    serve_util.start_serve(9100)  # wait_for_proxies=True: serve.start, which waits itself
    fake_ray["running"] = "a client"
    ready = serve_util.start_serve(9101, wait_for_proxies=False)
    ready()
    assert fake_ray["created"] == [] and fake_ray["waited"] == []
    assert [s["grpc_options"].port for s in fake_ray["started"]] == [9100, 9101]
