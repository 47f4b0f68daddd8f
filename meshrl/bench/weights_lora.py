"""`meshrl bench weights --model ARCH --lora-rank R`: bytes and seconds per weight version of a real
model, full weights against its LoRA adapter, over the same transports.

Versions (built the way the trainer exports them, fp32 like the built-in models train)
  full      every weight of the tiny model ARCH (services/common/tiny.py; qwen3_small is the 25M
            model of the GPU benchmarks), tied weights once
  lora_rR   the adapter alone: the descriptor (services/weights/adapter.py) and peft's lora_A /
            lora_B of rank R on all linear layers (non-zero B, as after training)

Each transport publishes and fetches each version (cold round, then steady rounds), and every
fetched version is checked against what was published: the same tensors byte for byte and, for
the adapter, its descriptor and the manifest's adapter field (the base it applies to). Reported:
bytes per version, the bytes ratio (target: >= 20x fewer at rank 8), seconds per transport.
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import tempfile
import time
from typing import Any

import torch

import services.common.config  # noqa: F401  (config tree first)
from meshrl.v1 import common_pb2
from services.weights import Bucket

from .weights import MiB, _summary, run_collective_pair

Payload = list[Bucket]


def versions(arch: str, lora_rank: int, bucket_bytes: int, device: str = "cpu") -> dict[str, Payload]:
    """{"full": buckets, "lora_r<R>": buckets} for the tiny model `arch` (deterministic)."""
    from peft import LoraConfig, get_peft_model

    from services.common.tiny import build_tiny_model, build_tokenizer
    from services.trainer.engines.fsdp_lora import spec_of
    from services.weights.adapter import base_identity_of_module, descriptor, saved_name
    from services.weights.in_process import model_named_tensors
    from services.weights.layout import group_by_bytes

    model = build_tiny_model(arch, build_tokenizer(), seed=0)
    full = model_named_tensors(model)
    base = base_identity_of_module(model, f"tiny-{arch}")
    peft_model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear",
                                                  lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(1)
    adapter: Bucket = [descriptor(spec_of(peft_model, base, None))]
    for name, p in peft_model.named_parameters():
        if ".lora_" in name:
            adapter.append((saved_name(name), torch.randn(p.shape, generator=g) * 0.01))
    return {kind: [[(n, t.to(device)) for n, t in b] for b in group_by_bytes(named, bucket_bytes)]
            for kind, named in (("full", full), (f"lora_r{lora_rank}", adapter))}


def nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for b in payload for _, t in b)


def check_same(sent: Payload, got: Bucket) -> None:
    """`got` (every fetched tensor, in order) is `sent` byte for byte; an adapter's descriptor
    decodes to the same spec."""
    from services.weights.adapter import split_descriptor

    flat = [x for b in sent for x in b]
    assert [n for n, _ in got] == [n for n, _ in flat], "tensor names or order differ"
    for (name, a), (_, b) in zip(flat, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f"{name} differs"
    assert split_descriptor(got)[0] == split_descriptor(flat)[0]


async def _collect(stream: Any) -> Bucket:
    out: Bucket = []
    async for bucket in stream:
        out.extend((n, t.detach().to("cpu", copy=True)) for n, t in bucket)  # buffers are reused
    return out


async def _rounds(publish: Any, fetch: Any, manifest: Any, payload: Payload, rounds: int, first_version: int
                  ) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Timed publish/fetch rounds; the last fetched version is checked, and its manifest read."""
    from services.weights.adapter import split_descriptor

    out, seen = [], {}
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        ref = await publish(first_version + r, payload)
        t1 = time.perf_counter()
        got = await fetch(ref)
        t2 = time.perf_counter()
        out.append({"publish": t1 - t0, "fetch": t2 - t1, "end_to_end": t2 - t0})
        if r == rounds:
            check_same(payload, got)
            m = await manifest(ref)
            spec = split_descriptor(payload[0])[0]
            if spec is not None:
                assert m is not None and m.adapter is not None and m.adapter.base_model == spec.base_model, m
                seen = {"manifest_adapter_base": m.adapter.base_model, "manifest_adapter_rank": m.adapter.rank}
            seen["verified"] = True
    return out, seen


def _grpc_case(payloads: dict[str, Payload], rounds: int, chunk_mb: int) -> dict[str, Any]:
    from services.common.config.param_server import ParamServerConfig
    from services.param_server.server import ParamServerServer
    from services.weights.client import ParamServerClient
    from services.weights.transports.grpc import GrpcFetcher, GrpcPublisher

    async def main() -> dict[str, Any]:
        server = ParamServerServer(ParamServerConfig(port=0, retain_versions=2, chunk_mb=chunk_mb))
        await server.start()
        pub = GrpcPublisher(server.address, chunk_bytes=chunk_mb * MiB)
        fetcher = GrpcFetcher(server.address, consumer_id="bench", chunk_bytes=chunk_mb * MiB)
        client = ParamServerClient(server.address)
        try:
            return await _cases(payloads, rounds, lambda v, p: pub.publish(v, p), lambda ref: _collect(fetcher.fetch(ref)),
                                lambda ref: client.get_manifest(ref.policy_version))
        finally:
            await client.close()
            await pub.close()
            await fetcher.close()
            await server.stop()

    return {"where": "param server in this process (plain grpc.aio, loopback)", **asyncio.run(main())}


def _disk_case(payloads: dict[str, Payload], rounds: int) -> dict[str, Any]:
    from services.weights.transports.disk import DiskFetcher, DiskPublisher, read_manifest, version_dir

    root = tempfile.mkdtemp(prefix="meshrl-bench-lora-")

    async def main() -> dict[str, Any]:
        pub, fetcher = DiskPublisher(root), DiskFetcher(root, consumer_id="bench")

        async def manifest(ref: common_pb2.WeightsRef) -> Any:
            return read_manifest(version_dir(pub.root, ref.policy_version))

        try:
            try:
                return await _cases(payloads, rounds, lambda v, p: pub.publish(v, p),
                                    lambda ref: _collect(fetcher.fetch(ref)), manifest)
            finally:
                await fetcher.close()  # the last fetch's release, before the loop ends
        finally:
            await pub.close()
            await fetcher.close()

    try:
        return {"where": f"{root} (local filesystem, page cache)", **asyncio.run(main())}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _object_store_case(payloads: dict[str, Payload], rounds: int) -> dict[str, Any]:
    import ray
    from ray import serve

    from services.common.config import MeshConfig
    from services.common.serve_util import APP_LOGGING, init_ray
    from services.param_server.deployment import APP_NAME, build_app
    from services.weights import convert
    from services.weights.transports.object_store import ObjectStoreFetcher, ObjectStorePublisher, ServeDirectory

    started = not ray.is_initialized()
    init_ray(num_cpus=4)
    serve.start(logging_config={"enable_access_log": False, "log_level": "WARNING"})
    cfg = MeshConfig.model_validate({"param_server": {"port": 0, "retain_versions": 2}})
    serve.run(build_app({"config": cfg.model_dump(mode="json")}), name=APP_NAME, route_prefix="/param_server", logging_config=APP_LOGGING)
    try:
        async def main() -> dict[str, Any]:
            directory = ServeDirectory.from_app()
            await directory.connect()  # the param server's object_refs actor up, as in a run
            pub = ObjectStorePublisher(directory)
            fetcher = ObjectStoreFetcher(directory, consumer_id="bench", verify="remote")

            async def manifest(ref: common_pb2.WeightsRef) -> Any:
                raw, _ = await directory.lookup(ref.policy_version, "bench-manifest")
                await directory.release(ref.policy_version, "bench-manifest")
                return convert.manifest_from_proto(raw)

            try:
                return await _cases(payloads, rounds, lambda v, p: pub.publish(v, p),
                                    lambda ref: _collect(fetcher.fetch(ref)), manifest)
            finally:
                await pub.close()  # the last manifest's way to the param server's store
                await fetcher.close()  # the last fetch's release, before the loop ends

        return {"where": "Ray object store, same node", **asyncio.run(main())}
    finally:
        serve.delete(APP_NAME)
        if started:
            serve.shutdown()
            ray.shutdown()


async def _cases(payloads: dict[str, Payload], rounds: int, publish: Any, fetch: Any, manifest: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    version = 1
    for kind, payload in payloads.items():
        timed, seen = await _rounds(publish, fetch, manifest, payload, rounds, version)
        version += rounds + 1
        out[kind] = {**_summary(nbytes(payload), timed), **seen}
    return out


def _collective_worker(role: str, backend: str, address: str, total: int, bucket: int, rounds: int,
                       barrier: Any, out: Any, raw_port: int, arch: str, lora_rank: int) -> None:
    """run_collective_pair's worker: both sides build the same versions; the sender broadcasts
    each (rounds + 1 times), the receiver times and checks them."""
    from services.weights.client import ParamServerClient
    from services.weights.transports.collective import CollectiveFetcher, CollectivePublisher

    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(0 if role == "sender" else 1)
        device = "cuda"
    payloads = versions(arch, lora_rank, bucket, device if role == "sender" else "cpu")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    async def main() -> dict[str, Any]:
        results: dict[str, Any] = {"role": role}
        pub = CollectivePublisher(backend, address, receivers=1, group="bench-lora", timeout_s=600) if role == "sender" else None
        fetcher = None if pub else CollectiveFetcher(backend, address, consumer_id="bench-lora-1", group="bench-lora",
                                                     timeout_s=600)
        v = 0
        for kind, payload in payloads.items():
            times = []
            for r in range(rounds + 1):
                v += 1
                await asyncio.to_thread(barrier.wait)
                t0 = time.perf_counter()
                if pub is not None:
                    await pub.publish(v, payload)
                    sync()
                    times.append(time.perf_counter() - t0)
                    await pub.settle()
                    if r == rounds:  # the manifest the param server registered says what the version is
                        async with ParamServerClient(address) as client:
                            m = await client.get_manifest(v)
                        results[f"{kind}_adapter_base"] = m.adapter.base_model if m.adapter is not None else None
                else:
                    assert fetcher is not None
                    got = await _collect(fetcher.fetch(common_pb2.WeightsRef(policy_version=v)))
                    times.append(time.perf_counter() - t0)
                    if r == rounds:
                        check_same(payload, got)
            results[kind] = times
        if pub is not None:
            await pub.close()
        if fetcher is not None:
            await fetcher.close()
        return results

    out.put(asyncio.run(main()))


def _collective_case(backend: str, arch: str, lora_rank: int, bucket: int, rounds: int,
                     sizes: dict[str, int]) -> dict[str, Any]:
    got = run_collective_pair(backend, 0, bucket, rounds, worker=_collective_worker, extra=(arch, lora_rank))
    out: dict[str, Any] = {"where": "two processes" + (", GPU 0 -> GPU 1" if backend == "nccl" else ", CPU")}
    for kind, size in sizes.items():
        per_round = [{"broadcast": max(a, b)} for a, b in zip(got["sender"][kind], got["receiver"][kind], strict=True)]
        out[kind] = {**_summary(size, per_round), "verified": True}
        base = got["sender"].get(f"{kind}_adapter_base")
        if base is not None:
            out[kind]["manifest_adapter_base"] = base
    return out


def run_model_benchmark(
    *,
    arch: str = "qwen3_small",
    lora_rank: int = 8,
    bucket_mb: int = 256,
    rounds: int = 2,
    transports: tuple[str, ...] = ("grpc", "object_store", "disk", "gloo"),
    chunk_mb: int = 4,
) -> dict[str, Any]:
    bucket = bucket_mb * MiB
    payloads = versions(arch, lora_rank, bucket)
    sizes = {kind: nbytes(p) for kind, p in payloads.items()}
    full, lora = sizes["full"], sizes[f"lora_r{lora_rank}"]
    result: dict[str, Any] = {
        "benchmark": "weights_lora",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                    if torch.cuda.is_available() else []},
        "model": arch, "lora_rank": lora_rank, "bucket_bytes": bucket, "rounds": rounds,
        "versions": {kind: {"bytes": size, "tensors": sum(len(b) for b in payloads[kind])} for kind, size in sizes.items()},
        "bytes_ratio_full_over_lora": round(full / lora, 2),
        "transports": {},
    }
    cases = {"grpc": lambda: _grpc_case(payloads, rounds, chunk_mb), "disk": lambda: _disk_case(payloads, rounds),
             "object_store": lambda: _object_store_case(payloads, rounds)}
    for name in transports:
        try:
            if name in cases:
                result["transports"][name] = cases[name]()
            elif name in ("gloo", "nccl"):
                result["transports"][name] = _collective_case(name, arch, lora_rank, bucket, rounds, sizes)
            else:
                result["transports"][name] = {"error": f"unknown transport {name!r}"}
        except Exception as exc:  # noqa: BLE001 -- one transport failing must not lose the others
            result["transports"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    result["targets"] = {"lora_bytes_ge_20x_fewer": {"ratio": result["bytes_ratio_full_over_lora"],
                                                     "met": full >= 20 * lora}}
    return result
