"""Where delta sync's time goes on one GPU (no transport): each device op on one 64 MiB bf16
tensor, then DeltaEncoder.encode and DeltaDecoder.decode over 4 GiB (64 tensors, buckets of 8;
the encode's time includes a clone of every wire entry, standing in for the transport's copy).
Run on the GPU host: PYTHONPATH=$PWD:/tmp/site OUT=/dir python3 scripts/gpu/delta_prof.py
(BENCHMARKS.md, "Delta sync")."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from services.weights.delta import DeltaDecoder, DeltaEncoder, _bits
from services.weights.layout import tensor_columns

DEV = "cuda"
N = 32 * 1024 * 1024  # elements of one tensor: 64 MiB in bf16
TENSORS = 64


def best_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return round(min(out) * 1e3, 3)


def ops() -> dict[str, float]:
    a = torch.randn(N, device=DEV).bfloat16()
    b = a.clone()
    b[::70] += 1
    mask = _bits(a) != _bits(b)
    idx = mask.nonzero().squeeze(1)
    values = a[idx]
    return {
        "compare_ms": best_ms(lambda: _bits(a) != _bits(b)),
        "count_ms": best_ms(lambda: mask.sum()),
        "nonzero_ms": best_ms(lambda: mask.nonzero()),
        "gather_ms": best_ms(lambda: a[idx]),
        "scatter_ms": best_ms(lambda: b.__setitem__(idx, values)),
        "columns_ms": best_ms(lambda: tensor_columns(a)),
        "copy_ms": best_ms(lambda: b.copy_(a)),
    }


def versions(lr: float, count: int = 4) -> dict[str, Any]:
    g = torch.Generator(device=DEV).manual_seed(0)
    master = [torch.randn(N, generator=g, device=DEV) * 0.02 for _ in range(TENSORS)]
    enc, dec = DeltaEncoder(), DeltaDecoder()

    async def agreed() -> int:
        return enc.version

    async def one(version: int) -> tuple[float, float]:
        for w in master:
            w.sub_(torch.randn(w.shape, generator=g, device=DEV).sign_().mul_(lr))
        buckets = [[(f"w{i}", master[i].bfloat16()) for i in range(j, j + 8)] for j in range(0, TENSORS, 8)]
        torch.cuda.synchronize()
        dec.begin(version)
        t0 = time.perf_counter()
        wire = [[(n, t.clone()) for n, t in b] async for b in enc.encode(version, buckets, agreed)]
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for b in wire:
            dec.decode(b)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        enc.commit(version)
        dec.commit()
        return t1 - t0, t2 - t1

    times = [asyncio.run(one(v)) for v in range(1, count + 1)]
    return {"encode_ms": [round(e * 1e3, 2) for e, _ in times], "decode_ms": [round(d * 1e3, 2) for _, d in times],
            "last": enc.last.as_dict()}


def main() -> None:
    result: dict[str, Any] = {"per_64MiB_tensor": ops()}
    for lr in (3e-7, 1e-5):
        result[f"lr={lr:g}"] = versions(lr)
    text = json.dumps(result, indent=1)
    print(text)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "delta_prof.json"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
