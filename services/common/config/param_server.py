"""`param_server.*`: what the param server can be told."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.net import WILDCARD_HOSTS, host_port

from .base import ConfigModel


class ParamServerConfig(ConfigModel):
    """Versioned weight store."""

    retain_versions: int = Field(default=2, ge=1)
    """Newest versions kept (plus any version a consumer still holds)."""
    chunk_mb: int = Field(default=4, ge=1)
    """Chunk size of the grpc transport."""
    transfer_timeout_s: float = Field(default=300.0, gt=0)
    """Deadline of one whole transfer (publish or fetch)."""
    disk_dir: str | None = None
    """Shared directory for the `disk` transport; null: `<run_dir>/weights`."""
    host: str = "127.0.0.1"
    """Bind address of the param server's gRPC data plane (plain server, or inside the Serve replica).
    Loopback (the default) is one node. `0.0.0.0` is the multi-node switch: the data plane listens
    on every interface of whichever node the replica lands on and advertises that node's IP;
    publishers and fetchers under Ray ask the param server app for it (`discover_wait_s`), so
    nothing pins the replica to a node and no address is written by hand."""
    port: int = Field(default=50071, ge=0, le=65535)
    """Port of that data plane; 0 picks a free one (coordinator 50051, reward 50061)."""
    advertise_address: str | None = None
    """host:port consumers should dial (put into WeightsRef); null: `host:port` as bound (with this
    node's IP when bound to 0.0.0.0). Set it only when that IP is not what consumers reach (NAT)."""
    discover_wait_s: float = Field(default=600.0, ge=0)
    """With `host` 0.0.0.0 and no `advertise_address`: how long a publisher or fetcher under Ray
    retries asking the param server app where its data plane is (the apps of one `serve deploy`
    start together); 0: fail at once."""
    stall_timeout_s: float = Field(default=60.0, gt=0)
    """A transfer that makes no progress for this long fails with DEADLINE_EXCEEDED (a stuck peer);
    an upload stalled this long is dropped. nccl/hccl/gloo: a step of a broadcast that waits this
    long on a peer fails the version (the sender's steps once every receiver checked in, a
    receiver's after step 0), and the trainer sends it again (TrainerLoop); a receiver silent this
    long while the sender waits for it gives its place in the group to a new receiver that asks (a
    replaced rollout replica; services/param_server/rendezvous.py)."""
    hold_ttl_s: float = Field(default=600.0, gt=0)
    """AcquireVersion pins a version for this long; consumers renew by acquiring again. At least
    `transfer_timeout_s`: a fetch may take that long."""
    max_fetch_attempts: int = Field(default=3, ge=1)
    """Attempts per bucket when received bytes fail their checksum (the bucket is fetched again)."""
    bucket_sha256: bool = False
    """Also put a sha256 per bucket in manifests (and check it): the grpc transport only; the others
    rely on the always-on fingerprint, which already catches corruption. sha256 costs about
    1.5 GB/s of one core on each side."""
    object_store_verify: Literal["always", "remote"] = "remote"
    """`object_store` fetch: fingerprint every bucket (`always`) or only buckets not put on the
    fetcher's node (`remote`: a read of an object the publisher put on this node maps its shared
    memory, nothing was transferred; a copy pulled from another node is checked by every reader,
    also when another consumer here pulled it first). Sizes, names and dtypes are always checked
    against the manifest."""
    max_message_mb: int = Field(default=64, ge=1)
    """gRPC message size limit (both directions)."""
    max_concurrent_uploads: int = Field(default=4, ge=1)
    """PublishWeights streams open at once; more are answered UNAVAILABLE (a slot frees within
    stall_timeout_s), which publishers retry with backoff."""
    max_upload_mb: int | None = Field(default=None, ge=1)
    """Largest version one upload may announce or send; null: this host's physical memory (a
    bigger one could never be held)."""
    max_holders_per_version: int = Field(default=4096, ge=1)
    """Consumers that may pin one version at once (AcquireVersion); more are refused."""
    tune_malloc: bool = True
    """Raise glibc's mmap/trim thresholds in processes that stream weights over grpc (param
    server, publishers, fetchers) so per-chunk buffers are reused, not page-faulted each time
    (on a VM the page faults cost more than the copy). Process-wide; see services/weights/hostmem.py."""
    pool_max_mb: int = Field(default=8192, ge=0)
    """Host memory of evicted versions kept to receive the next upload (fresh pages are slow)."""
    collective_group: str = "rollout"
    """Name of the nccl/hccl/gloo broadcast group (one per consumer group)."""
    collective_receivers: int | None = Field(default=None, ge=1)
    """Ranks that receive the broadcast: one per rollout replica (its fetcher, whatever the engine's
    TP x DP); null: serve.rollout.num_replicas (with serve.rollout.autoscaling: its max_replicas, which
    must equal min_replicas with these transports). A count the replicas do not match stalls every
    broadcast: `meshrl train`, `serve-config` and `plan` refuse one other than the Serve rollout's
    replicas; set it for rollouts run outside Serve."""
    collective_master_address: str | None = None
    """Address the trainer's rank 0 listens on for the broadcast group; null: this host's IP."""
    collective_sharded: bool = False
    """nccl/hccl/gloo: every trainer rank broadcasts the part it owns (its FSDP shard; megatron's
    TP / expert-TP slices, experts and pipeline stage, replicas sending nothing) in a group of its
    own and the rollout ranks rebuild whole tensors, instead of rank 0 gathering and sending every
    byte (services/weights/transports/collective/sharded.py); not with LoRA."""
    delta_sync: bool = False
    """nccl/hccl/gloo: send each version as the elements that changed since the version every
    receiver holds (bitwise), whole tensors when a receiver holds another version or none.
    Floating-point weights travel in `actor_rollout_ref.rollout.dtype` when it names one (set
    bfloat16: in bf16 a step changes few elements; in fp32 nearly all). It pays where the link is
    slow next to the devices (between nodes); over NVLink within a host whole versions are faster
    (BENCHMARKS.md, "Delta sync"). Costs a copy of the weights on the sender's and on every
    receiver's device (services/weights/delta.py)."""

    @model_validator(mode="after")
    def _check(self) -> ParamServerConfig:
        if self.chunk_mb >= self.max_message_mb:
            raise ValueError(
                f"param_server.chunk_mb={self.chunk_mb} must be below param_server.max_message_mb={self.max_message_mb}"
            )
        if self.stall_timeout_s > self.transfer_timeout_s:
            raise ValueError(
                f"param_server.stall_timeout_s={self.stall_timeout_s} exceeds param_server.transfer_timeout_s="
                f"{self.transfer_timeout_s}; lower it (it bounds silence within one transfer)"
            )
        if self.hold_ttl_s < self.transfer_timeout_s:
            raise ValueError(
                f"param_server.hold_ttl_s={self.hold_ttl_s} is below param_server.transfer_timeout_s="
                f"{self.transfer_timeout_s}; raise it to at least that (a fetch that outlives its hold can find "
                "its version evicted between buckets)"
            )
        return self


def data_address(cfg: ParamServerConfig) -> str:
    """Where publishers and fetchers dial the param server's data plane (for a wildcard `host`
    without `advertise_address` this is this node only: consumers on other nodes discover the
    address, services/weights/transports/discovery.py)."""
    return cfg.advertise_address or host_port(cfg.host, cfg.port)


def discovers_address(cfg: ParamServerConfig) -> bool:
    """True when consumers learn the data plane's address from the running param server (a
    wildcard `host`, no `advertise_address`): the multi-node switch."""
    return not cfg.advertise_address and cfg.host in WILDCARD_HOSTS
