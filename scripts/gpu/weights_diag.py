"""Where the nccl weight transport spends its time beyond the raw broadcast, on one GPU: the
per-bucket work the sender and receiver add (the pack copy into a slot, the fingerprint's column
reduction, and the fingerprint with its host sync). Run on the GPU machine from the repo root:

    python3 scripts/gpu/weights_diag.py

Prints ms and GB/s per operation and bucket size (each the mean of 10 after one warm-up)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from services.weights.layout import fingerprint_columns_async, fingerprint_tensor


def _time(fn: Callable[[], object], repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def _ops(buf: torch.Tensor, dst: torch.Tensor, n: int) -> dict[str, Callable[[], object]]:
    return {
        "copy (pack)": lambda: dst.copy_(buf),
        "fingerprint columns (async)": lambda: fingerprint_columns_async(buf, n),
        "fingerprint + host sync": lambda: fingerprint_tensor(buf, n),
    }


def main() -> None:
    dev = torch.device("cuda", 0)
    print("gpu:", torch.cuda.get_device_name(dev), "torch", torch.__version__)
    for mib in (128, 512, 2048):
        n = mib << 20
        buf = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        for name, fn in _ops(buf, torch.empty_like(buf), n).items():
            dt = _time(fn)
            print(f"{mib:5d} MiB  {name:28s} {dt * 1e3:8.3f} ms  {n / dt / 1e9:8.1f} GB/s")


if __name__ == "__main__":
    main()
