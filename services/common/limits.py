"""Bounds on what one request and one client may take: string lengths by field kind, concurrent
RPCs and streams per client identity, and a log line that cannot be turned into a flood.

    check_lengths(request, Limits())          # InvalidArgument("groups[3].lease_id", "... 256 ...")
    release = limiter.acquire(identity.key, streaming=True)   # ResourceExhausted when over

Field kinds are read off the field names, so every message of every service (and any added later)
is covered by the same rules: `*_id`/`*_ids` are ids, `*address*` addresses, `path`/`*_path`/
`*_dir` paths, and a short list of names (tensor names, data sources, roles, checksums ...).
Free text (prompts, responses, ground truths, JSON payloads), map keys (metric names) and bytes
(weight chunks, Echo payloads) are bounded by the message size limit only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from .errors import InvalidArgument, ResourceExhausted
from .logging import get_logger

log = get_logger(__name__)

_NAMES = frozenset({
    "name", "names", "data_source", "ability", "role", "backend", "group", "engine", "transports", "stop",
    "sha256", "fingerprint", "checksum", "manifest_checksum", "finish_reason", "kind", "tool", "tool_name",
    "environment", "env_name",
})


@dataclass(frozen=True)
class Limits:
    """Longest string of each kind, in characters (bytes for `bytes` fields)."""

    max_id_chars: int = 256
    max_address_chars: int = 512
    max_path_chars: int = 4096
    max_name_chars: int = 1024

    @classmethod
    def from_config(cls, limits: Any) -> Limits:
        return cls(limits.max_id_chars, limits.max_address_chars, limits.max_path_chars, limits.max_name_chars)


def field_kind(name: str) -> str | None:
    """The length rule a field falls under by its name (None: free text, bounded by message size)."""
    if name == "id" or name.endswith("_id") or name.endswith("_ids"):
        return "id"
    if "address" in name:
        return "address"
    if name == "path" or name.endswith("_path") or name.endswith("_dir") or name == "uri":
        return "path"
    if name in _NAMES:
        return "name"
    return None


_KEYS = {"id": ("max_id_chars", "security.limits.max_id_chars"),
         "address": ("max_address_chars", "security.limits.max_address_chars"),
         "path": ("max_path_chars", "security.limits.max_path_chars"),
         "name": ("max_name_chars", "security.limits.max_name_chars")}

_STRINGISH = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
_plans: dict[str, tuple[tuple[FieldDescriptor, str | None, bool], ...]] = {}


def _plan(desc: Any, _visiting: frozenset[str] = frozenset()) -> tuple[tuple[FieldDescriptor, str | None, bool], ...]:
    """Per message type: (field, length kind, is a message) for the fields worth a look:
    limited strings, and messages that hold such fields somewhere (a Response, with only free
    text, numbers and a metrics map, is never walked)."""
    plan = _plans.get(desc.full_name)
    if plan is None:
        out = []
        for fd in desc.fields:
            is_msg = fd.type == FieldDescriptor.TYPE_MESSAGE
            if is_msg:
                sub = fd.message_type
                assert sub is not None
                if sub.GetOptions().map_entry:
                    continue  # map keys (metric names) are bounded by the message size, like free text
                if sub.full_name in _visiting or not _plan(sub, _visiting | {desc.full_name}):
                    continue  # recursive, or nothing limited inside
            kind = field_kind(fd.name) if fd.type in _STRINGISH else None
            if kind or is_msg:
                out.append((fd, kind, is_msg))
        plan = _plans[desc.full_name] = tuple(out)
    return plan


def check_lengths(msg: Any, limits: Limits, where: str = "") -> None:
    """Raise InvalidArgument naming the first field (as a path into the request) longer than its
    kind allows. Objects that are not protobuf messages (raw weight chunks) pass."""
    if not isinstance(msg, Message):
        return
    present = {fd.name for fd, _ in msg.ListFields()}
    for fd, kind, is_msg in _plan(msg.DESCRIPTOR):
        if fd.name not in present:
            continue
        path = f"{where}.{fd.name}" if where else fd.name
        value = getattr(msg, fd.name)
        if kind is not None:
            limit = getattr(limits, _KEYS[kind][0])
            items = value if fd.is_repeated else (value,)
            for i, v in enumerate(items):
                if len(v) > limit:
                    at = f"{path}[{i}]" if fd.is_repeated else path
                    raise InvalidArgument(at, f"is {len(v)} characters long; the limit for this kind of field is {limit} "
                                              f"({_KEYS[kind][1]})")
        elif is_msg:
            if fd.is_repeated:
                for i, item in enumerate(value):
                    check_lengths(item, limits, f"{path}[{i}]")
            else:
                check_lengths(value, limits, path)


class ClientLimiter:
    """Counts RPCs and streams in progress per client identity (Identity.key); `acquire` refuses
    with RESOURCE_EXHAUSTED past the bounds. One event loop; entries vanish at zero."""

    def __init__(self, max_rpcs: int, max_streams: int) -> None:
        self.max_rpcs = max_rpcs
        self.max_streams = max_streams
        self._rpcs: dict[str, int] = {}
        self._streams: dict[str, int] = {}

    def acquire(self, key: str, *, streaming: bool) -> Callable[[], None]:
        rpcs = self._rpcs.get(key, 0)
        if rpcs >= self.max_rpcs:
            raise ResourceExhausted(
                f"{rpcs} RPCs of this client ({key}) are in progress (security.limits.max_concurrent_rpcs_per_client="
                f"{self.max_rpcs}); wait for some to finish"
            )
        streams = self._streams.get(key, 0)
        if streaming and streams >= self.max_streams:
            raise ResourceExhausted(
                f"{streams} streams of this client ({key}) are open (security.limits.max_streams_per_client="
                f"{self.max_streams}); close some first"
            )
        self._rpcs[key] = rpcs + 1
        if streaming:
            self._streams[key] = streams + 1
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            _dec(self._rpcs, key)
            if streaming:
                _dec(self._streams, key)

        return release

    def in_progress(self, key: str) -> tuple[int, int]:
        return self._rpcs.get(key, 0), self._streams.get(key, 0)

    @property
    def clients(self) -> int:
        return len(self._rpcs)


def _dec(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


class RateLimitedLog:
    """A warning that appears at most once per `interval_s`, saying how many it stood for: one
    line, however fast a client sends garbage."""

    def __init__(self, event: str, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.event = event
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None
        self._suppressed = 0
        self.emitted = 0

    def __call__(self, **fields: Any) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._suppressed += 1
            return
        log.warning(self.event, suppressed_since_last=self._suppressed, **fields)
        self._last = now
        self._suppressed = 0
        self.emitted += 1


_process: dict[str, Limits] = {}


def set_process_limits(limits: Limits | None) -> None:
    """What grpc_util.rpc_method checks request lengths against in this process (behind Serve's
    proxy; plain servers use their own MeshInterceptor's). None: the defaults."""
    if limits is None:
        _process.pop("limits", None)
    else:
        _process["limits"] = limits


def process_limits() -> Limits:
    return _process.get("limits") or Limits()


class RecentlySeen(OrderedDict[str, float]):
    """id -> when it was last seen, bounded for ids that callers choose: at most `max_entries`
    (the least recently seen leave first) and, at every write, none older than `ttl_s`. A drop-in
    for a plain dict written as `seen[id] = now` (times must not go backwards)."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        super().__init__()
        self.max_entries = max_entries
        self.ttl_s = ttl_s

    def __setitem__(self, key: str, now: float) -> None:
        super().__setitem__(key, now)
        self.move_to_end(key)
        while len(self) > self.max_entries:
            self.popitem(last=False)
        while self:
            oldest = next(iter(self))
            if now - super().__getitem__(oldest) <= self.ttl_s:
                break
            del self[oldest]
