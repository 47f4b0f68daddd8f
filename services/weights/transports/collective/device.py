"""Streams, events and pinned host buffers of one device kind, for the collective transport; on
CPU everything is synchronous."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from services.common.device import backend_device_kind, import_torch_npu
from services.common.errors import InvalidArgument, MissingDependency


def device_kind(backend: str) -> str:
    try:
        return backend_device_kind(backend)
    except ValueError:
        raise InvalidArgument("actor_rollout_ref.rollout.checkpoint_engine.backend",
                              f"{backend!r} is not a collective backend (nccl, hccl, gloo)") from None


class Device:
    """Streams, events and host copies for one device kind; on CPU everything is synchronous."""

    def __init__(self, backend: str) -> None:
        self.kind = device_kind(backend)
        if self.kind == "npu":
            import_torch_npu()  # fails fast with what to install
        if self.kind == "cpu":
            self.mod: Any = None
            self.device = torch.device("cpu")
            return
        self.mod = getattr(torch, self.kind)
        if not self.mod.is_available():
            raise MissingDependency(f"{self.kind} device", f"the {backend} transport needs a visible {self.kind} device")
        self.device = torch.device(self.kind, self.mod.current_device())
        self.comm_stream = self.mod.Stream(device=self.device)
        self.verify_stream = self.mod.Stream(device=self.device)
        self.host_stream = self.mod.Stream(device=self.device)  # small reads of finished results only
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def accelerator(self) -> bool:
        return self.mod is not None

    def comm(self) -> contextlib.AbstractContextManager[Any]:
        """Context for launching collectives (they then wait only for what this stream waits for)."""
        return self.mod.stream(self.comm_stream) if self.accelerator else contextlib.nullcontext()

    def verify(self) -> contextlib.AbstractContextManager[Any]:
        return self.mod.stream(self.verify_stream) if self.accelerator else contextlib.nullcontext()

    def after_default(self) -> None:
        """Order the comm stream after everything queued so far on the default stream (buffer reuse)."""
        if self.accelerator:
            self.comm_stream.wait_stream(self.mod.current_stream(self.device))

    def pinned(self, key: tuple[str, int], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer kept for `key` (grown on demand), instead of a pinned allocation
        per step. Callers key them by slot or by step modulo RING, so that a buffer is rewritten
        only after its last copy completed."""
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=True)
            self._pinned[key] = buf
        return buf[:numel]

    def read_later(self, t: torch.Tensor, work: Any, key: tuple[str, int]) -> tuple[torch.Tensor, Any]:
        """Queue a copy of `t`, the output of the collective `work`, to host memory for when the
        work finishes; returns (host tensor, event). Read it after `work` completed and the event
        synchronized (on CPU: the tensor itself, no event)."""
        if not self.accelerator:
            return t, None
        with self.mod.stream(self.host_stream):
            work.wait()  # the host stream (not the host) waits for the collective
            host = self.pinned(key, t.numel(), t.dtype)
            host.copy_(t, non_blocking=True)
            event = self.mod.Event()
            event.record()
        t.record_stream(self.host_stream)
        return host, event

    def from_host(self, values: list[int], key: tuple[str, int]) -> torch.Tensor:
        """int64 values as a tensor to copy to the device (non_blocking) on the current stream."""
        if not self.accelerator:
            return torch.tensor(values, dtype=torch.int64)
        host = self.pinned(key, len(values), torch.int64)
        host.numpy()[:] = values
        return host

    def bytes_from_host(self, data: bytes, key: tuple[str, int]) -> torch.Tensor:
        if not self.accelerator:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        host = self.pinned(key, len(data), torch.uint8)
        host.numpy()[:] = memoryview(data)
        return host

    def pinned_copy(self, t: torch.Tensor, key: tuple[str, int]) -> torch.Tensor:
        """Start copying `t` into host memory on the current stream (read it after an event)."""
        if not self.accelerator:
            return t
        host = self.pinned(key, t.numel(), t.dtype)
        host.copy_(t.reshape(-1), non_blocking=True)
        return host

    def record(self) -> Any:
        """An event after the current stream's work so far (None on CPU: already done)."""
        if not self.accelerator:
            return None
        event = self.mod.Event()
        event.record()
        return event

    def synchronize(self) -> None:
        if self.accelerator:
            self.mod.synchronize(self.device)
