"""Ray Serve edges shared by every service's deployment.py.

`grpc_shim(service)` turns a class that holds `self._servicer` (a grpc servicer instance whose
methods take `(request, context)`) into a Serve deployment class with one method per RPC, named
exactly like the RPC and taking Serve's `grpc_context` keyword (the gRPC proxy passes it; a
DeploymentHandle call gets a LocalContext). Unary RPCs return the response; server-streaming RPCs
are async generators.

    @serve.deployment(name="Coordinator")
    @grpc_shim(coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"])
    class CoordinatorDeployment:
        async def __init__(self, ...): self._servicer = ...

`init_ray` starts or joins Ray so that every worker imports the same meshrl code as the driver,
and `start_serve` starts Serve's gRPC ingress with the servicer functions of every meshrl service.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.descriptor import ServiceDescriptor

from services.common.bytecode import worker_env
from services.common.grpc_util import LocalContext

T = TypeVar("T")

SERVICER_FUNCTIONS = [
    # The coordinator's registration passes group bytes through (services/coordinator/wire.py).
    "services.coordinator.wire.add_to_server",
    "meshrl.v1.rollout_pb2_grpc.add_RolloutServiceServicer_to_server",
    "meshrl.v1.reward_pb2_grpc.add_RewardServiceServicer_to_server",
    "meshrl.v1.param_server_pb2_grpc.add_ParamServerServiceServicer_to_server",
    "meshrl.v1.trainer_pb2_grpc.add_TrainerServiceServicer_to_server",
]


def _unary(name: str) -> Callable[..., Any]:
    async def method(self: Any, request: Any, grpc_context: Any = None) -> Any:
        return await getattr(self._servicer, name)(request, grpc_context if grpc_context is not None else LocalContext())

    method.__name__ = method.__qualname__ = name
    return method


def _server_stream(name: str) -> Callable[..., Any]:
    async def method(self: Any, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:
        ctx = grpc_context if grpc_context is not None else LocalContext()
        async for item in getattr(self._servicer, name)(request, ctx):
            yield item

    method.__name__ = method.__qualname__ = name
    return method


def grpc_shim(service: ServiceDescriptor) -> Callable[[type[T]], type[T]]:
    """Add one delegating method per RPC of `service` (unary and server-streaming; client- and
    bidi-streaming RPCs must be written by hand because their argument is a stream)."""

    def decorate(cls: type[T]) -> type[T]:
        for m in service.methods:
            if m.name in cls.__dict__:
                continue  # hand-written (e.g. client streaming)
            if m.client_streaming:
                raise TypeError(f"{service.full_name}.{m.name} is client-streaming; write {cls.__name__}.{m.name} by hand")
            setattr(cls, m.name, _server_stream(m.name) if m.server_streaming else _unary(m.name))
        return cls

    return decorate


def repo_root() -> Path:
    """The directory that holds the `services` and `meshrl` packages of this process."""
    import services

    return Path(services.__file__).resolve().parent.parent


_HANDED_OUT: set[int] = set()
"""Ports free_port returned in this process: nothing is bound to them until their server starts,
so port_is_free alone would hand one out again (the gRPC ingress and the param server alike)."""


def free_port() -> int:
    """A port free on every interface, outside the kernel's ephemeral range and Ray's worker ports
    (10002-19999): Ray's processes, started after this pick, take ephemeral ports and could grab it
    before Serve binds it (seen on a 32-core host: the proxy failed to bind its gRPC port). Never
    one this process was given before."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32000)
        if port not in _HANDED_OUT and port_is_free(port):
            _HANDED_OUT.add(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def port_is_free(port: int) -> bool:
    """Nothing is bound to PORT on any IPv4 or IPv6 address (Serve's proxy binds [::])."""
    import socket

    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (97, 99):  # no IPv6 on this host
                continue
            return False
    return True


SERVE_ENV_DEFAULTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
# The raylet deletes objects whose last reference is gone in batches, every
# free_objects_period_milliseconds (Ray's default 1000). A weight version released by retention
# (the object_store transport) keeps its shared memory that long, so the next puts go to pages
# never touched before (page faults) instead of reusing the released ones. 10 ms still batches
# frees and costs nothing at start-up, unlike pre-touching the store
# (RAY_preallocate_plasma_memory, left off). Measurements: BENCHMARKS.md, issue 21 host transports.
OBJECT_STORE_ENV_DEFAULTS = {"RAY_free_objects_period_milliseconds": "10"}


def init_ray(
    address: str | None = None, *, num_cpus: int | None = None, namespace: str = "meshrl", log_to_driver: bool = True,
    env: dict[str, str] | None = None, bytecode_cache: str = "off",
) -> None:
    """Start a local Ray (address None) or join one, with workers importing this process's code
    (and writing structured logs to MESHRL_LOG_DIR when that is set). ENV: more variables for every
    worker (the run's tokens: the job's runtime_env, never a config). BYTECODE_CACHE:
    `serve.bytecode_cache` (services/common/bytecode.py)."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        # Serve gives a new proxy 5 s to come up and then kills it; on a loaded 2-core machine a
        # fresh worker takes longer than that, and serve.start() then fails with "ProxyActor died
        # ... killed by ray.kill". A local Ray's processes inherit this environment.
        for key, value in {**SERVE_ENV_DEFAULTS, **OBJECT_STORE_ENV_DEFAULTS}.items():
            os.environ.setdefault(key, value)
    root = str(repo_root())
    pythonpath = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)
    os.environ["PYTHONPATH"] = pythonpath  # a local Ray's raylet and workers inherit it
    env_vars = {"PYTHONPATH": pythonpath, "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("MESHRL_LOG_DIR", "MESHRL_LOG_LEVEL", "MESHRL_TOKEN", "MESHRL_ROLLOUT_TOKEN", "MESHRL_TRAINER_TOKEN",
                "MESHRL_OPERATOR_TOKEN", "MESHRL_CACHE_DIR", "OMP_NUM_THREADS"):
        if os.environ.get(key):
            env_vars[key] = os.environ[key]
    env_vars.update({k: v for k, v in (env or {}).items() if v})
    env_vars.update(worker_env(bytecode_cache, local_ray=address is None))  # "" is meant: it turns writing on
    ray.init(
        # "local": always a fresh instance. None would join any Ray found running on this host
        # (another user's, another test's), and our Serve shutdown would then tear theirs down.
        address=address or "local",
        num_cpus=num_cpus,
        namespace=namespace,
        include_dashboard=False,
        runtime_env={"env_vars": env_vars},
        logging_level=logging.WARNING,
        log_to_driver=log_to_driver,
    )


APP_LOGGING: dict[str, Any] = {"enable_access_log": False, "log_level": "WARNING"}
"""How `meshrl train` runs every application and Serve itself: no access-log line per call
(benches deploy with it too, or their replicas would log every handle call that training does not)."""


def start_serve(grpc_port: int, *, http_port: int = 8000, request_timeout_s: float | None = None,
                proxy_location: str = "HeadOnly", wait_for_proxies: bool = True) -> Callable[[], None]:
    """Start Serve with the gRPC ingress serving every meshrl service.

    With WAIT_FOR_PROXIES false this returns once Serve's controller is up and the proxies are
    asked for (a Ray without Serve: `meshrl train`'s own); the caller deploys meanwhile (a replica's
    start needs the controller, not the proxies: their process start and imports took 2.7-3.2 s on
    the GPU host, BENCHMARKS.md) and then calls the returned function, which waits for the proxies
    as `serve.start` does. Otherwise, or where Serve already runs, the wait happens here and the
    returned function does nothing."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    http = HTTPOptions(port=http_port)
    grpc = gRPCOptions(port=grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS, request_timeout_s=request_timeout_s)
    logging_config = dict(APP_LOGGING)
    if not wait_for_proxies:
        started = _start_controller(http, grpc, logging_config, proxy_location)
        if started is not None:
            return started
    serve.start(proxy_location=proxy_location, http_options=http, grpc_options=grpc, logging_config=logging_config)
    return lambda: None


def _start_controller(http: Any, grpc: Any, logging_config: dict[str, Any],
                      proxy_location: str) -> Callable[[], None] | None:
    """`serve.start`'s steps without its wait for the proxies (Ray 2.60's private API, pinned in
    pyproject.toml; `serve.run_many` then finds the client cached here); None where Serve already
    runs or that API is not there (`serve.start` then)."""
    import ray

    try:
        from ray.serve._private import api as serve_api
        from ray.serve._private.client import ServeControllerClient
        from ray.serve._private.constants import HTTP_PROXY_TIMEOUT
        from ray.serve.context import _get_global_client, _set_global_client
        from ray.serve.schema import LoggingConfig
    except ImportError:
        return None
    create = getattr(serve_api, "_create_controller_and_proxy_refs", None)
    coerce = getattr(serve_api, "_coerce_controller_options", None)
    if create is None or coerce is None or _get_global_client(raise_if_no_controller_running=False) is not None:
        return None
    controller, proxy_refs = create(
        http_options=http, grpc_options=grpc, global_logging_config=LoggingConfig(**logging_config),
        global_tracing_config=None, controller_options=coerce(None), proxy_location=proxy_location,
    )
    _set_global_client(ServeControllerClient(controller))

    def proxies_ready() -> None:
        """Wait for the proxies; a proxy that failed (its port taken) raises its error here."""
        if not proxy_refs:
            return
        try:
            ray.get(proxy_refs, timeout=HTTP_PROXY_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"Serve's proxies were not up after {HTTP_PROXY_TIMEOUT} s") from None

    return proxies_ready


def log_init_errors(init: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a deployment's (async) `__init__` so a failure is also logged through structlog (into
    the run directory's logs), not only in Ray's replica log: `meshrl train` reports it."""
    import functools
    import inspect

    from services.common.errors import first_cause
    from services.common.logging import get_logger

    log = get_logger("services.serve")

    def failed(self: Any, exc: BaseException) -> None:
        # the error the replica's code raised, on one line: a rank actor's RayTaskError reads as its
        # whole remote traceback, and `meshrl train` prints the first 500 characters of what is logged
        log.error("replica_init_failed", deployment=type(self).__name__, error=first_cause(exc, limit=2000))

    if inspect.iscoroutinefunction(init):

        @functools.wraps(init)
        async def async_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                await init(self, *args, **kwargs)
            except BaseException as exc:
                failed(self, exc)
                raise

        return async_wrapper

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException as exc:
            failed(self, exc)
            raise

    return wrapper
