"""Weight transports, chosen per consumer group by
`actor_rollout_ref.rollout.checkpoint_engine.backend` (grpc | object_store | nccl | hccl | disk;
`gloo` is the CPU twin of nccl, for tests and CPU-only groups).

    publisher = make_publisher(cfg, address=param_server_address)       # trainer rank 0
    ref = await publisher.publish(version, engine.export_weights(bucket_bytes))
    fetcher = make_fetcher(cfg, consumer_id=replica_id)                  # every rollout rank
    async for bucket in fetcher.fetch(ref): engine.load_weights(bucket)

Modules are imported on first use, so Ray (object_store) or torch_npu (hccl) are needed only by
the groups that use them, and a missing one fails with what to install.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

from meshrl.v1 import common_pb2
from services.common.config import MeshConfig
from services.common.config.actor_rollout_ref import COLLECTIVE_BACKENDS
from services.common.config.param_server import data_address
from services.common.errors import ConfigError
from services.common.net import local_ip

from ..protocols import WeightFetcher, WeightPublisher
from ..shards import sender_group

BACKENDS = ("grpc", "object_store", "nccl", "hccl", "disk", "gloo")
_MODULES = {
    "grpc": "services.weights.transports.grpc",
    "object_store": "services.weights.transports.object_store",
    "nccl": "services.weights.transports.collective",
    "hccl": "services.weights.transports.collective",
    "gloo": "services.weights.transports.collective",
    "disk": "services.weights.transports.disk",
}
MiB = 1 << 20

__all__ = ["BACKENDS", "WeightFetcher", "WeightPublisher", "make_fetcher", "make_publisher"]


def _module(backend: str) -> Any:
    if backend not in _MODULES:
        raise ConfigError(
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend!r} is not a transport; use one of {list(BACKENDS)}"
        )
    return importlib.import_module(_MODULES[backend])


def _backend(cfg: MeshConfig, backend: str | None) -> str:
    return backend or cfg.actor_rollout_ref.rollout.checkpoint_engine.backend


def collective_receivers(cfg: MeshConfig) -> int:
    """Ranks of the broadcast group besides the sender: `param_server.collective_receivers`, else
    one per rollout replica (each holds one fetcher, whatever its engine's TP x DP), i.e.
    serve.rollout.num_replicas, or with serve.rollout.autoscaling its replica count (min_replicas ==
    max_replicas: the config refuses a collective transport with a count that changes)."""
    ps, app = cfg.param_server, cfg.serve.rollout
    if ps.collective_receivers:
        return ps.collective_receivers
    return app.num_replicas if app.autoscaling is None else app.autoscaling.max_replicas


def serve_receivers_mismatch(cfg: MeshConfig) -> str | None:
    """Why `param_server.collective_receivers` cannot work with the rollout deployed under Serve
    (`meshrl train`, `meshrl serve-config`, `meshrl plan`), else None. Each Serve rollout replica
    is one receiver of the broadcast group, whose size is fixed (services/param_server/rendezvous.py):
    more receivers than replicas and every broadcast waits for ranks that never check in; fewer and
    the replicas past the count find the group full and get no weights. Not refused at config load:
    rollouts run outside Serve (against `meshrl param-server serve`) set the count to theirs."""
    ps, app = cfg.param_server, cfg.serve.rollout
    if cfg.actor_rollout_ref.rollout.checkpoint_engine.backend not in COLLECTIVE_BACKENDS or not ps.collective_receivers:
        return None
    # autoscaling with a collective transport has min_replicas == max_replicas (refused at load otherwise)
    key, replicas = (("serve.rollout.num_replicas", app.num_replicas) if app.autoscaling is None
                     else ("serve.rollout.autoscaling.max_replicas", app.autoscaling.max_replicas))
    if ps.collective_receivers == replicas:
        return None
    return (f"param_server.collective_receivers={ps.collective_receivers} but {key}={replicas}: under Serve each "
            f"rollout replica is one receiver of the broadcast group, so every broadcast would "
            f"{'wait for receivers that never join' if ps.collective_receivers > replicas else 'miss the replicas past the count (they find the group full)'}; "
            f"remove param_server.collective_receivers (it defaults to {key}) or set it to {replicas}")


def make_publisher(
    cfg: MeshConfig,
    *,
    address: str | None = None,
    backend: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    announce: Callable[[common_pb2.WeightsRef], Awaitable[bool | None]] | None = None,
    directory: Any = None,
    sender_rank: int | None = None,
) -> WeightPublisher:
    """The trainer's publisher for a consumer group. `address`: the param server's data plane
    (default: where `param_server.*` says it is). `sender_rank` (with
    `param_server.collective_sharded`): the trainer rank whose own shards this publisher sends.
    `announce` (collective backends): called with the version's ref before the broadcast starts,
    so receivers learn of it (e.g. the trainer's CommitVersion; False: none will come, skip it); `directory` (object_store): where
    refs are registered (default: the Serve app's deployment handle)."""
    name = _backend(cfg, backend)
    mod = _module(name)
    ps = cfg.param_server
    address = address or data_address(ps)
    if name == "grpc":
        return mod.GrpcPublisher(  # type: ignore[no-any-return]
            address, chunk_bytes=ps.chunk_mb * MiB, timeout_s=ps.transfer_timeout_s,
            stall_timeout_s=ps.stall_timeout_s, sha256=ps.bucket_sha256, max_message_bytes=ps.max_message_mb * MiB,
            tune_malloc=ps.tune_malloc,
        )
    if name == "object_store":
        directory = directory or mod.ServeDirectory.from_app()
        return mod.ObjectStorePublisher(directory, address=address, timeout_s=ps.transfer_timeout_s)  # type: ignore[no-any-return]
    if name == "disk":
        return mod.DiskPublisher(mod.disk_dir(ps, run_dir), address=address, timeout_s=ps.transfer_timeout_s)  # type: ignore[no-any-return]
    sharded = ps.collective_sharded and sender_rank is not None
    return mod.CollectivePublisher(  # type: ignore[no-any-return]
        name, address, receivers=collective_receivers(cfg),
        group=sender_group(ps.collective_group, sender_rank) if sender_rank is not None and sharded else ps.collective_group,
        master_address=ps.collective_master_address or local_ip(), timeout_s=ps.transfer_timeout_s,
        max_attempts=ps.max_fetch_attempts, stall_timeout_s=ps.stall_timeout_s, announce=announce,
        register=not sharded, delta_sync=ps.delta_sync,
        delta_dtype=_wire_dtype(cfg) if ps.delta_sync else None,
    )


def _wire_dtype(cfg: MeshConfig) -> Any:
    """Delta sync: floating-point weights travel in the rollout's dtype when the config names one
    (`actor_rollout_ref.rollout.dtype`; "auto": as the trainer exports them)."""
    import torch

    name = cfg.actor_rollout_ref.rollout.dtype
    return None if name == "auto" else getattr(torch, name)


def make_fetcher(
    cfg: MeshConfig,
    *,
    consumer_id: str,
    address: str | None = None,
    backend: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    directory: Any = None,
) -> WeightFetcher:
    """A rollout rank's fetcher. `consumer_id` names this rank (holds, collective membership);
    `address` is used when a ref carries none (default: where `param_server.*` says the param
    server's data plane is)."""
    name = _backend(cfg, backend)
    mod = _module(name)
    ps = cfg.param_server
    address = address or data_address(ps)
    if name == "grpc":
        return mod.GrpcFetcher(  # type: ignore[no-any-return]
            address, consumer_id=consumer_id, chunk_bytes=ps.chunk_mb * MiB, timeout_s=ps.transfer_timeout_s,
            stall_timeout_s=ps.stall_timeout_s, max_attempts=ps.max_fetch_attempts,
            max_message_bytes=ps.max_message_mb * MiB, tune_malloc=ps.tune_malloc,
        )
    if name == "object_store":
        directory = directory or mod.ServeDirectory.from_app()
        return mod.ObjectStoreFetcher(  # type: ignore[no-any-return]
            directory, consumer_id=consumer_id, verify=ps.object_store_verify, timeout_s=ps.transfer_timeout_s,
            max_attempts=ps.max_fetch_attempts,
        )
    if name == "disk":
        return mod.DiskFetcher(  # type: ignore[no-any-return]
            mod.disk_dir(ps, run_dir), consumer_id=consumer_id, timeout_s=ps.transfer_timeout_s,
            max_attempts=ps.max_fetch_attempts,
        )
    if ps.collective_sharded:
        return mod.ShardedFetcher(  # type: ignore[no-any-return]
            name, address, consumer_id=consumer_id, senders=cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node,
            group=ps.collective_group, timeout_s=ps.transfer_timeout_s, delta_sync=ps.delta_sync,
            stall_timeout_s=ps.stall_timeout_s,
        )
    return mod.CollectiveFetcher(  # type: ignore[no-any-return]
        name, address, consumer_id=consumer_id, group=ps.collective_group, timeout_s=ps.transfer_timeout_s,
        delta_sync=ps.delta_sync, stall_timeout_s=ps.stall_timeout_s,
    )
