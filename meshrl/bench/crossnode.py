"""`meshrl bench weights --cross-node`: the grpc and object_store weight transports between Ray
nodes in separate network namespaces (meshrl/netns_cluster.py), against a raw TCP copy of the
same bytes between the same namespaces, in the same run.

    node a: the param server (Serve app; param_server.host=0.0.0.0, so its data plane listens on
            a's veth and the publisher and fetcher ask the app for the address)
    node c: the publisher (an actor: the trainer's side)       grpc publish   c ──▶ a
    node b: the fetcher (an actor: a rollout's side)            grpc fetch     a ──▶ b
                                                                 object_store  put on c, b pulls c ──▶ b
    raw:    the same bytes over one TCP connection per pair of nodes (sendall from, recv_into,
            pre-touched buffers; the receiver acks each round): c->a, a->b, c->b

Every byte crosses two veths and the bridge, on this machine's CPUs: the ratios say how close a
transport comes to what the wire between these namespaces carries, not what a datacenter link
does. Round 0 is cold; rounds 1..N steady (best and median reported, as `meshrl bench weights`).
Needs root and iproute2 (the cluster is made and removed here, unless one is passed in).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from meshrl.netns_cluster import NetnsCluster

GiB = 1 << 30
MiB = 1 << 20
PS_PORT = 50071  # inside node a's namespace: nothing else listens there
RAW_CHUNK = 4 * MiB
PAIRS = (("c", "a"), ("a", "b"), ("c", "b"))


class BenchSide:
    """One node's side of the benchmark (a Ray actor pinned to the node by its resource)."""

    def __init__(self, config: dict[str, Any], total: int, bucket: int, publishes: bool) -> None:
        from services.common.config import MeshConfig

        self.cfg = MeshConfig.model_validate(config)
        self.total = total
        self.weights = None
        if publishes:
            from meshrl.bench.weights import make_weights

            self.weights = make_weights(total, bucket)
        self._buf = bytearray(total)  # raw copy buffer, touched once
        self._listener: socket.socket | None = None
        self._publishers: dict[str, Any] = {}
        self._fetchers: dict[str, Any] = {}

    def ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    # ---- raw TCP ------------------------------------------------------------------------------

    def raw_listen(self) -> int:
        self._listener = socket.socket()
        self._listener.bind((self.ip(), 0))
        self._listener.listen(1)
        return int(self._listener.getsockname()[1])

    async def raw_receive(self, rounds: int) -> None:
        await asyncio.to_thread(self._raw_receive, rounds)

    def _raw_receive(self, rounds: int) -> None:
        assert self._listener is not None
        conn, _ = self._listener.accept()
        view = memoryview(self._buf)
        with conn:
            for _ in range(rounds):
                got = 0
                while got < self.total:
                    n = conn.recv_into(view[got : got + RAW_CHUNK])
                    if n == 0:
                        raise ConnectionError(f"sender closed after {got} of {self.total} bytes")
                    got += n
                conn.sendall(b"k")
        self._listener.close()

    async def raw_send(self, host: str, port: int, rounds: int) -> list[float]:
        return await asyncio.to_thread(self._raw_send, host, port, rounds)

    def _raw_send(self, host: str, port: int, rounds: int) -> list[float]:
        view = memoryview(self._buf)
        times = []
        with socket.create_connection((host, port), timeout=600) as conn:
            for _ in range(rounds):
                t0 = time.perf_counter()
                for off in range(0, self.total, RAW_CHUNK):
                    conn.sendall(view[off : off + RAW_CHUNK])
                if conn.recv(1) != b"k":
                    raise ConnectionError("no ack from the receiver")
                times.append(time.perf_counter() - t0)
        return times

    # ---- transports ---------------------------------------------------------------------------

    async def _cfg(self) -> Any:
        from services.weights.transports.discovery import with_discovered_address

        return await with_discovered_address(self.cfg)

    async def publish(self, backend: str, version: int) -> tuple[bytes, float]:
        from services.weights.transports import make_publisher

        if backend not in self._publishers:
            self._publishers[backend] = make_publisher(await self._cfg(), backend=backend)
        assert self.weights is not None
        t0 = time.perf_counter()
        ref = await self._publishers[backend].publish(version, self.weights)
        return ref.SerializeToString(), time.perf_counter() - t0

    async def fetch(self, backend: str, ref_bytes: bytes) -> tuple[int, float, int]:
        """(bytes, seconds, buckets the fetcher fingerprinted: object_store checks what crossed nodes)"""
        from meshrl.v1 import common_pb2
        from services.weights.transports import make_fetcher

        if backend not in self._fetchers:
            self._fetchers[backend] = make_fetcher(await self._cfg(), consumer_id=f"bench-{backend}", backend=backend)
        ref = common_pb2.WeightsRef.FromString(ref_bytes)
        fetcher = self._fetchers[backend]
        verified = getattr(fetcher, "verified_buckets", 0)
        t0 = time.perf_counter()
        n = 0
        async for bucket in fetcher.fetch(ref):
            n += sum(t.numel() * t.element_size() for _, t in bucket)
        return n, time.perf_counter() - t0, getattr(fetcher, "verified_buckets", 0) - verified

    async def close(self) -> None:
        for p in [*self._publishers.values(), *self._fetchers.values()]:
            close = getattr(p, "close", None)
            if close is not None:
                await close()


def _driver(args: dict[str, Any]) -> dict[str, Any]:
    """Runs on node a (a Ray driver in its namespace): deploy the param server, place the sides,
    time raw copies and transports."""
    import ray
    from ray import serve

    from meshrl.bench.weights import _summary
    from services.common.config import MeshConfig
    from services.common.serve_util import APP_LOGGING
    from services.param_server.deployment import APP_NAME, build_app

    total, bucket, rounds = args["bytes"], args["bucket_bytes"], args["rounds"]
    cfg = MeshConfig.model_validate({
        "param_server": {"host": "0.0.0.0", "port": PS_PORT, "retain_versions": 1, "chunk_mb": args["chunk_mb"],
                         "pool_max_mb": 2 * total // MiB + 64},
        "serve": {"param_server": {"resources": {"node_a": 1}}},
    })
    config = cfg.model_dump(mode="json")
    ray.init(logging_level="ERROR", log_to_driver=False)  # type: ignore[arg-type]  # ray accepts names
    serve.start(http_options={"host": "127.0.0.1", "port": 8000}, logging_config={"enable_access_log": False})
    serve.run(build_app({"config": config}), name=APP_NAME, route_prefix=None, logging_config=APP_LOGGING)
    from meshrl.bench.crossnode import BenchSide as Side  # by reference, not pickled from __main__

    side: Any = ray.remote(Side)
    nodes: dict[str, Any] = {name: side.options(resources={f"node_{name}": 1}, num_cpus=0.5).remote(config, total, bucket, name == "c")
             for name in ("a", "b", "c")}
    ips = {name: ray.get(actor.ip.remote()) for name, actor in nodes.items()}
    result: dict[str, Any] = {"ips": ips, "baselines": {}, "transports": {}}
    for src, dst in PAIRS:
        port = ray.get(nodes[dst].raw_listen.remote())
        receiving = nodes[dst].raw_receive.remote(rounds + 1)
        times = ray.get(nodes[src].raw_send.remote(ips[dst], port, rounds + 1))
        ray.get(receiving)
        result["baselines"][f"raw_tcp_{src}_to_{dst}"] = _summary(total, [{"copy": t} for t in times])["copy"]
    version = 0
    for backend in args["transports"]:
        per_round, verified = [], []
        for _ in range(rounds + 1):
            version += 1
            ref, pub_s = ray.get(nodes["c"].publish.remote(backend, version))
            got, fetch_s, checked = ray.get(nodes["b"].fetch.remote(backend, ref))
            assert got == total, f"{backend}: fetched {got} of {total} bytes"
            per_round.append({"publish": pub_s, "fetch": fetch_s, "end_to_end": pub_s + fetch_s})
            verified.append(checked)
        result["transports"][backend] = {**_summary(total, per_round), "verified_buckets": verified}
    ray.get([a.close.remote() for a in nodes.values()])
    serve.shutdown()
    return result


def _ratios(r: dict[str, Any]) -> dict[str, Any]:
    """Best steady round against the best raw copy on the same path."""
    raw = {k: v["best_GBps"] for k, v in r["baselines"].items()}
    t = r["transports"]
    out: dict[str, Any] = {}
    if "grpc" in t:
        out["grpc_publish_c_to_a_vs_raw"] = round(t["grpc"]["publish"]["best_GBps"] / raw["raw_tcp_c_to_a"], 3)
        out["grpc_fetch_a_to_b_vs_raw"] = round(t["grpc"]["fetch"]["best_GBps"] / raw["raw_tcp_a_to_b"], 3)
    if "object_store" in t:
        out["object_store_fetch_c_to_b_vs_raw"] = round(
            t["object_store"]["fetch"]["best_GBps"] / raw["raw_tcp_c_to_b"], 3)
        out["object_store_end_to_end_vs_raw_c_to_b"] = round(
            t["object_store"]["end_to_end"]["best_GBps"] / raw["raw_tcp_c_to_b"], 3)
    return out


def run_benchmark(
    *,
    size_gb: float = 0.5,
    bucket_mb: int = 256,
    rounds: int = 2,
    transports: tuple[str, ...] = ("grpc", "object_store"),
    chunk_mb: int = 4,
    cluster: NetnsCluster | None = None,
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Make a 3-node namespace cluster (or use `cluster`), run the driver on node a, return JSON."""
    import tempfile

    import torch

    bad = [t for t in transports if t not in ("grpc", "object_store")]
    if bad:
        raise SystemExit(f"--cross-node measures grpc and object_store only, not {bad}")
    total = int(size_gb * GiB) // 4 * 4
    args = {"bytes": total, "bucket_bytes": bucket_mb * MiB, "rounds": rounds, "chunk_mb": chunk_mb,
            "transports": list(transports)}
    own = cluster is None
    if cluster is None:
        work = work_dir or Path(tempfile.mkdtemp(prefix="meshrl-crossnode-"))
        # object store: the publisher's copy on c and the pulled copy on b, with headroom
        store_mb = max(512, int(3 * total / MiB))
        cluster = NetnsCluster(["a", "b", "c"], work_dir=work, num_cpus=4, object_store_mb=store_mb, dashboard=False)
        cluster.start()
    try:
        out = cluster.run_in("a", [sys.executable, "-m", "meshrl.bench.crossnode", json.dumps(args)], timeout=3600)
    finally:
        if own:
            cluster.close()
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"cross-node driver failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    measured = json.loads(lines[-1][len("RESULT "):])
    assert cluster.subnet is not None
    result = {
        "benchmark": "weights_cross_node",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "cluster": {"link": "one veth pair per node on a Linux bridge, one network namespace per Ray node, "
                            "one machine", "subnet": str(cluster.subnet), "ips": measured["ips"]},
        "bytes": total, "bucket_bytes": bucket_mb * MiB, "rounds": rounds, "chunk_mb": chunk_mb,
        "baselines": measured["baselines"], "transports": measured["transports"],
    }
    result["ratios"] = _ratios(result)
    return result


if __name__ == "__main__":  # the driver, run on node a by run_benchmark
    print("RESULT " + json.dumps(_driver(json.loads(sys.argv[1]))), flush=True)
