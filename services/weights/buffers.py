"""Reusable byte buffers for transports: fresh pages (host) and fresh allocations (device) are slow,
and a steady stream of same-sized buckets can reuse the same memory."""

from __future__ import annotations

import torch

# Never hand out less than one int64 word: fingerprints read a buffer as 64-bit words.
_MIN_BYTES = 8


class ByteBuffers:
    """`count` uint8 buffers on one device, kept per slot and grown on demand. The caller decides
    when a slot may be rewritten (after its last reader finished)."""

    def __init__(self, count: int, device: torch.device | str = "cpu", *, pin: bool = False) -> None:
        assert count >= 1, count
        self._bufs: list[torch.Tensor | None] = [None] * count
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cpu"

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of slot `slot` (reallocated when too small)."""
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            # Drop the old buffer before allocating its replacement so that both never coexist.
            buf = self._bufs[slot] = None
            buf = torch.empty(max(nbytes, _MIN_BYTES), dtype=torch.uint8, device=self.device, pin_memory=self.pin)
            self._bufs[slot] = buf
        return buf[:nbytes]

    def release(self) -> None:
        """Hand the memory back to the allocator (once nothing on any stream uses it)."""
        self._bufs = [None] * len(self._bufs)
