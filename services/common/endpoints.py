"""The resilient client of one external gRPC endpoint: deadlines, bounded retries with backoff and
jitter, a circuit breaker, TLS and a token. Used by every service that calls out of the mesh
(reward.endpoints through services/reward/endpoints.py, environment.endpoints through
services/environment/client.py); settings in services/common/config/endpoint.py.

Timeline of one `call` (one unary RPC):

    acquire breaker ──> RPC(deadline=timeout_s) ──ok──> decode ──> result
         ^                   │ transient failure (UNAVAILABLE, DEADLINE_EXCEEDED, ...)
         │                   v
         │            retry < max_retries? ── yes ──> sleep U(0, min(backoff_max_s, backoff_initial_s·2^k)) ──┐
         │                   │ no: the endpoint is down: trip the breaker, the call *waits*             │
         └───────────────────┴─────────────────────────────────────────────────────────────────────┘

While the breaker is open no call goes out; after `breaker_open_s` one probe is let through
(half-open): success closes it and every waiting call proceeds, failure re-opens it for twice as
long (up to `breaker_max_open_s`). Waiting units (the caller says how many items a call carries)
are counted in `status()`, and the call fails with UNAVAILABLE only after `max_wait_s` (null:
never). Non-transient answers are errors at once, each naming the endpoint: INVALID_ARGUMENT (the
endpoint rejected the request), BadReply (INTERNAL: it sent back something that does not decode or
validate, its fault and not the request's),
NOT_FOUND / FAILED_PRECONDITION (kept: the caller decides), UNAUTHENTICATED / PERMISSION_DENIED
(token), UNIMPLEMENTED, and the rest as EndpointError (INTERNAL). Delivery is at-least-once: a
call that timed out may have been served before it is sent again, so the service must make its
methods idempotent (a pure function, or keyed by an id).
"""

from __future__ import annotations

import asyncio
import enum
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from services.common.config.endpoint import EndpointConfig
from services.common.errors import (
    BadReply,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    Unauthenticated,
    Unavailable,
)
from services.common.grpc_util import bearer_metadata, message_options
from services.common.logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")
R = TypeVar("R", bound=Message)

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
)


class EndpointError(MeshError):
    """An endpoint answered with a non-transient error we have no better class for."""


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """closed --(failure_threshold consecutive failures, or trip())--> open --(open_s)--> half-open:
    one probe --success--> closed / --failure--> open for twice as long (<= max_open_s).

    `acquire()` returns when a call may go out (True: this call is the probe): at once when
    closed; when open it waits for the probe time; while a probe is in flight everyone else waits
    for its outcome. The probe's caller must report on_success/on_failure, or `release_probe()` if
    it ended without an outcome (cancelled). Use from one event loop."""

    def __init__(
        self, *, failure_threshold: int, open_s: float, max_open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failure_threshold = failure_threshold
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.open_s = open_s
        self.opened_at = 0.0
        self.down_since: float | None = None
        self.times_opened = 0
        self.name = ""
        self._changed: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        self._event().set()
        self._changed = asyncio.Event()

    async def acquire(self) -> bool:
        while True:
            if self.state is BreakerState.CLOSED:
                return False
            event = self._event()
            if self.state is BreakerState.OPEN:
                wait_s = self.opened_at + self.open_s - self.clock()
                if wait_s <= 0:
                    self.state = BreakerState.HALF_OPEN
                    self._notify()
                    return True
                try:
                    await asyncio.wait_for(event.wait(), wait_s)
                except TimeoutError:
                    pass
            else:  # HALF_OPEN: a probe is out
                await event.wait()

    def on_success(self) -> None:
        if self.state is not BreakerState.CLOSED:
            log.info("endpoint_recovered", endpoint=self.name,
                     down_for_s=round(self.clock() - (self.down_since or self.clock()), 3))
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.open_s = self.base_open_s
        self.down_since = None
        self._notify()

    def on_failure(self) -> None:
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._open(min(self.open_s * 2, self.max_open_s))
        elif self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold:
            self._open(self.base_open_s)

    def release_probe(self) -> None:
        """The probe ended without an outcome: let the next caller probe at once."""
        if self.state is BreakerState.HALF_OPEN:
            self.state = BreakerState.OPEN
            self.opened_at = self.clock() - self.open_s
            self._notify()

    def trip(self) -> None:
        """Open now (a call used up its retries: the endpoint is down)."""
        if self.state is BreakerState.CLOSED:
            self._open(self.base_open_s)

    def _open(self, open_s: float) -> None:
        now = self.clock()
        self.state = BreakerState.OPEN
        self.open_s = open_s
        self.opened_at = now
        self.times_opened += 1
        if self.down_since is None:
            self.down_since = now
        self._notify()


def backoff_s(attempt: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff before retry number `attempt` (1-based)."""
    return rng.uniform(0.0, min(max_s, initial_s * 2 ** (attempt - 1)))


class ResilientEndpoint:
    """Calls to one endpoint `cfg` (see the module docstring). `source` names it in every error
    ("reward endpoint 'judge' (127.0.0.1:50061, reward.endpoints[0])"); `service` is the full
    gRPC service name the endpoint must implement ("meshrl.v1.RewardService"); `payloads` names
    what a method carries, for messages ({"Score": "items"}: "rejected the items: ...")."""

    def __init__(
        self,
        cfg: EndpointConfig,
        *,
        source: str,
        service: str,
        payloads: Mapping[str, str] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.label
        self.source = source
        self.service = service
        self.payloads = dict(payloads or {})
        self.clock = clock
        self.rng = rng or random.Random()
        self.breaker = CircuitBreaker(
            failure_threshold=cfg.breaker_failure_threshold, open_s=cfg.breaker_open_s,
            max_open_s=cfg.breaker_max_open_s, clock=clock,
        )
        self.breaker.name = self.name
        # Only the endpoint's own token: an endpoint is someone else's code, and a role token of
        # this process would let it call the mesh's RPCs.
        token = cfg.token or (os.environ.get(cfg.token_env) if cfg.token_env else None)
        if cfg.token_env and not token:
            log.warning("endpoint_token_missing", endpoint=self.name, env=cfg.token_env)
        self._metadata = tuple(bearer_metadata(token))
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[str, Any] = {}
        self._slots: asyncio.Semaphore | None = None
        self.calls = 0
        self.failed_attempts = 0
        self.retries = 0
        self.succeeded = 0
        self.waiting = 0
        self.last_error: str | None = None

    def _callable(self, method: str) -> Any:
        if self._channel is None:
            cfg = self.cfg
            options = message_options()  # its short reconnect backoff: a recovered endpoint is seen by the next probe
            if cfg.tls:
                roots = Path(cfg.ca_file).read_bytes() if cfg.ca_file else None
                if cfg.tls_server_name:
                    options.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
                creds = grpc.ssl_channel_credentials(root_certificates=roots)
                self._channel = grpc.aio.secure_channel(cfg.address, creds, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(cfg.address, options=options)
            self._slots = asyncio.Semaphore(cfg.max_concurrent_calls)
        if method not in self._calls:
            assert self._channel is not None
            # Raw bytes back: a reply that does not decode is the endpoint's fault, reported as such
            # (a deserializer error would surface as an anonymous INTERNAL).
            self._calls[method] = self._channel.unary_unary(
                f"/{self.service}/{method}", request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=None,
            )
        return self._calls[method]

    async def call(
        self, method: str, request: Message, reply_type: type[R], check: Callable[[R], T], *, units: int = 1
    ) -> T:
        """`method` of the endpoint's service with `request`; the reply is decoded as `reply_type`
        and `check(reply)` turns it into the result (it raises BadReply(self.source, ...) for
        a reply that does not fit the request; one that does not decode is reported the same way).
        `units`: how many items the call carries, for the waiting count in status()."""
        call = self._callable(method)
        assert self._slots is not None
        attempt = 0
        first_failure: float | None = None
        waiting = False
        try:
            while True:
                if not waiting and self.breaker.state is not BreakerState.CLOSED:
                    waiting = True  # held back by an open breaker: these units wait
                    self.waiting += units
                probe = await self.breaker.acquire()
                try:
                    async with self._slots:
                        self.calls += 1
                        raw = await call(request, timeout=self.cfg.timeout_s, metadata=self._metadata)
                except grpc.aio.AioRpcError as exc:
                    code, details = exc.code(), exc.details() or ""
                    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "Received message larger than max" in details:
                        # Over the gRPC message limit: the endpoint answers a retry with the same
                        # (stored) reply, so retrying would only trip the breaker all its calls share.
                        self.breaker.on_success()  # it answered
                        raise BadReply(self.source, f"{method}: a message over the gRPC size limit, which no retry "
                                                    f"changes ({details})") from None
                    if code not in RETRYABLE:
                        self.breaker.on_success()  # it answered: reachable, but the answer is an error
                        raise self._fatal(method, code, details) from None
                    self.breaker.on_failure()
                else:
                    self.breaker.on_success()
                    try:
                        reply = reply_type.FromString(raw)
                    except DecodeError as exc:
                        name = reply_type.DESCRIPTOR.full_name
                        raise BadReply(self.source, f"sent a reply that is not a {name} ({exc})") from None
                    result = check(reply)
                    self.succeeded += 1
                    return result
                finally:
                    if probe:
                        self.breaker.release_probe()  # no-op once an outcome was recorded
                # A transient failure: retry, or wait for the endpoint to come back.
                self.failed_attempts += 1
                self.last_error = f"{code.name}: {details}"
                now = self.clock()
                if first_failure is None:
                    first_failure = now
                if not waiting:
                    waiting = True
                    self.waiting += units
                if self.cfg.max_wait_s is not None and now - first_failure >= self.cfg.max_wait_s:
                    raise Unavailable(
                        f"{self.source} has been failing for {now - first_failure:.1f}s "
                        f"(max_wait_s={self.cfg.max_wait_s}); last error {self.last_error}"
                    )
                attempt += 1
                if attempt > self.cfg.max_retries:
                    if self.breaker.state is BreakerState.CLOSED:
                        log.warning("endpoint_down", endpoint=self.name, error=self.last_error, waiting=self.waiting)
                    self.breaker.trip()
                    attempt = 0
                    continue
                self.retries += 1
                await asyncio.sleep(backoff_s(attempt, self.cfg.backoff_initial_s, self.cfg.backoff_max_s, self.rng))
        finally:
            if waiting:
                self.waiting -= units

    def _fatal(self, method: str, code: grpc.StatusCode, details: str) -> MeshError:
        self.last_error = f"{code.name}: {details}"
        log.error("endpoint_error", endpoint=self.name, method=method, code=code.name, details=details)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(self.source, f"rejected the {self.payloads.get(method, method + ' request')}: {details}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return Unauthenticated(f"{self.source} refused the call ({code.name}: {details}); check its token / token_env")
        if code is grpc.StatusCode.UNIMPLEMENTED:
            return FailedPrecondition(f"{self.source} does not implement {self.service}/{method} ({details})")
        if code is grpc.StatusCode.NOT_FOUND:
            return NotFound(f"{self.source}: {method}: {details}")
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            return FailedPrecondition(f"{self.source}: {method}: {details}")
        return EndpointError(f"{self.source} failed with {code.name}: {details}")

    def status(self) -> dict[str, Any]:
        b = self.breaker
        return {
            "name": self.name,
            "address": self.cfg.address,
            "state": b.state.value,
            "consecutive_failures": b.consecutive_failures,
            "down_for_s": None if b.down_since is None else round(self.clock() - b.down_since, 3),
            "times_opened": b.times_opened,
            "waiting": self.waiting,
            "calls": self.calls,
            "failed_attempts": self.failed_attempts,
            "retries": self.retries,
            "succeeded": self.succeeded,
            "last_error": self.last_error,
        }

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._calls = {}
