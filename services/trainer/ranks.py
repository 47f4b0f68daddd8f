"""A training group's rank actors (`TrainWorker`), and `spawn`, which asks Ray for them. Light on
purpose (no torch at import): a trainer replica asks for its ranks before its own imports, and a
rank process loads torch and the model libraries while the replica prepares the engine's spec
(BENCHMARKS.md, "Start-up"). `meshrl train` goes further: it asks for the ranks right after Ray
starts, before Serve, and hands them to the trainer replica, which claims them (`SpawnedRanks.claim`:
the first replica only; one that replaces a failed replica takes the orphans down and spawns its
own). `services.trainer.workers.RayTrainGroup` drives the ranks."""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.common.device import ray_resource
from services.common.logging import configure_logging, get_logger
from services.common.net import gloo_interface
from services.common.priority import set_niceness
from services.common.startup import StartupClock

if TYPE_CHECKING:
    import torch

    from services.common.config import MeshConfig
    from services.weights import Bucket, WeightPublisher
    from services.weights.packing import WireBucket

    from .engines.base import EngineSpec, LossFn, SequenceBatch, StepResult, TrainEngine
    from .workers import RankSender, RayTrainGroup

log = get_logger(__name__)

WEIGHTS_GROUP = "weights"  # the rank actor's concurrency group for waiting on a broadcast


def _prewarm() -> None:
    """Import what every engine build imports (torch, its distributed and FSDP parts, transformers'
    model stack): third-party modules only, so this thread never waits on a module the rank's
    call thread is importing."""
    try:
        import torch.distributed.fsdp  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    except ImportError:  # the engine build imports what it needs again and reports what is missing
        return


def rank_environment(rank: int, world_size: int, master_addr: str, master_port: int,
                     spans_nodes: bool = True) -> dict[str, str]:
    """torchrun's variables for one rank and, when the group `spans_nodes`, the interface its CPU
    (gloo) group listens on: the one this node reaches the master from (`gloo_interface`), so that
    ranks on other nodes can dial it; torch's default, the hostname's address, is loopback on many
    hosts. A group on one node keeps torch's default (loopback there is right, and the fastest)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    if spans_nodes and (ifname := gloo_interface(master_addr)):
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


class TrainWorker:
    """One rank. Built lightweight; `init_engine` joins the process group and builds the engine."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.engine: TrainEngine | None = None
        self.spec: EngineSpec | None = None
        self.sender: RankSender | None = None
        self.own_shards = False
        self.owner = ""
        self._clock = StartupClock(f"trainer_rank{rank}")
        # This module is light (no torch) so that a trainer replica can ask for its ranks before
        # its own imports; the libraries the engine needs load here while the replica still
        # prepares the engine's spec, and `init_engine` waits for them.
        self._prewarm = threading.Thread(target=_prewarm, name="rank-imports", daemon=True)
        self._prewarm.start()

    def claim(self, owner: str) -> bool:
        """Whether this rank is OWNER's: true for the first owner that asks, before any engine."""
        if self.owner or self.engine is not None:
            return self.owner == owner and self.engine is None
        self.owner = owner
        return True

    def check_model(self, config: dict[str, Any]) -> None:
        """`factory.check_model` here, where transformers is loaded (`_prewarm`) anyway."""
        self._prewarm.join()
        from services.common.config import MeshConfig

        from .factory import check_model

        check_model(MeshConfig.model_validate(config))

    def node_id(self) -> str:
        """The Ray node this rank runs on (hex)."""
        return str(ray.get_runtime_context().get_node_id())

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port (asked of rank 0 for MASTER_ADDR/PORT)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_engine(
        self, spec: EngineSpec, backend: str, master_addr: str, master_port: int, nice: int | None = None,
        spans_nodes: bool = False,
    ) -> dict[str, int]:
        os.environ.update(rank_environment(self.rank, self.world_size, master_addr, master_port, spans_nodes))
        self._prewarm.join()
        import torch

        from .engines.base import get_engine_cls

        configure_logging("trainer", rank=self.rank)
        set_niceness(nice, key="tuning.nice.trainer_ranks")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.spec = spec
        self._clock.mark("init_engine")
        self.engine = get_engine_cls(backend, spec.device).build(spec)
        self._clock.mark("engine_built")
        return {"dp_rank": self.engine.dp_rank, "dp_size": self.engine.dp_size}

    def _engine(self) -> TrainEngine:
        assert self.engine is not None, "init_engine was not called"
        return self.engine

    def compute_logprobs(
        self, batch: SequenceBatch, temperature: float, reference: bool, proximal: bool, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        engine = self._engine()
        if proximal:
            out = engine.compute_proximal_logprobs(batch, temperature=temperature)
        else:
            out = engine.compute_logprobs(batch, temperature=temperature, with_entropy=with_entropy, reference=reference)
        return out.logprobs, out.entropy

    def train(self, batch: SequenceBatch, loss_fn: LossFn, temperature: float) -> StepResult:
        from .engines.batching import micro_batches_for

        assert self.spec is not None
        return self._engine().train_step(micro_batches_for(self.spec.actor, batch), loss_fn, temperature=temperature)

    def snapshot_proximal(self) -> None:
        self._engine().snapshot_proximal()

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket | WireBucket]:
        from services.weights.packing import to_wire

        # host buckets cross as their bytes, out of band (one copy into the object store, read there
        # without a copy) and with the fingerprint the export took; torch would pickle each
        # view's whole storage in-band (packing.WireBucket)
        for bucket in self._engine().export_weights(bucket_bytes):
            yield to_wire(bucket)

    def start_sender(self, make: Callable[[], WeightPublisher], own_shards: bool = False) -> None:
        """Become a weight sender (`make` builds the publisher, e.g. the collective one): rank 0
        of the whole weights, or with `own_shards` any rank of the rows it owns."""
        from .workers import RankSender

        assert own_shards or self.rank == 0, "only rank 0 sends the whole weights"
        self.sender = RankSender(make)
        self.own_shards = own_shards

    def publish_weights(self, version: int, bucket_bytes: int) -> None:
        """Every rank exports (the all-gathers); rank 0 hands the buckets to its sender (with
        `own_shards`, every rank exports and sends its own rows, no all-gather). Returns once the
        export is done: the broadcast goes on while later calls run."""
        engine = self._engine()
        buckets = engine.export_shards(bucket_bytes) if self.own_shards else engine.export_weights(bucket_bytes)
        if self.sender is None:  # the all-gathers only: run the export to its end, keep nothing
            collections.deque(buckets, maxlen=0)
            return
        self.sender.publish(version, buckets)

    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def published(self, version: int) -> bytes:
        """A sender: blocks until version's publish finished; its WeightsRef, serialized."""
        assert self.sender is not None, "start_sender was not called"
        return self.sender.result(version).SerializeToString()

    def save_checkpoint(self, path: str) -> None:
        self._engine().save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> None:
        self._engine().load_checkpoint(Path(path))

    def save_hf(self, path: str) -> None:
        self._engine().save_hf(Path(path))

    def step(self) -> int:
        return self._engine().step

    def stop_sender(self) -> None:
        """Rank 0: settle and close the sender (its last manifest registration)."""
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class SpawnedRanks:
    """Rank actors asked of Ray (`spawn`), their engines not built yet."""

    def __init__(self, device: str, workers: list[Any], pg: Any) -> None:
        self.device = device
        self.workers = workers
        self.pg = pg

    async def claim(self, owner: str, timeout_s: float = 120.0) -> bool:
        """Make these ranks OWNER's (a trainer replica handed ranks that `meshrl train` spawned).
        False when they are not to be had: another replica claimed them (this one replaces it),
        they died, or they did not come up within TIMEOUT_S; then they are taken down here (their
        owner is the driver, so a failed replica leaves them running) and the caller spawns its own."""
        try:
            got = await asyncio.wait_for(asyncio.gather(*[w.claim.remote(owner) for w in self.workers]), timeout_s)
        except Exception as exc:  # noqa: BLE001 -- a dead or unplaced rank: these ranks are not usable
            log.warning("ranks_not_claimed", owner=owner, error=f"{type(exc).__name__}: {exc}")
            got = []
        if got and all(got):
            return True
        self.kill()
        return False

    def check_model(self, cfg: MeshConfig) -> asyncio.Future[None]:
        """Rank 0 checks the model's config: sent now, so before `start` asks it to build its
        engine. The future raises a rejection as the check raised it (ConfigError naming the fix)."""
        sent = self.workers[0].check_model.remote(cfg.model_dump(mode="json"))

        async def outcome() -> None:
            try:
                await sent
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, Exception):
                    raise cause from None
                raise

        return asyncio.ensure_future(outcome())

    async def start(self, spec: EngineSpec, backend: str, *, nice: int | None = None,
                    timeout_s: float = 600.0) -> RayTrainGroup:
        """Join the process group and build every rank's engine; on any failure (cancellation
        included) the actors and their placement group are gone."""
        from .workers import RayTrainGroup

        workers = self.workers
        try:
            await asyncio.wait_for(self.pg.ready(), timeout=timeout_s)
            addr, port = await workers[0].address.remote()
            nodes = {ip for ip, _ in await asyncio.gather(*[w.address.remote() for w in workers[1:]])} | {addr}
            layout = await asyncio.wait_for(
                asyncio.gather(*[w.init_engine.remote(spec, backend, addr, port, nice, len(nodes) > 1) for w in workers]),
                timeout=timeout_s,
            )
            step = await workers[0].step.remote()
            rank0_node = await workers[0].node_id.remote()
        except BaseException:
            self.kill()
            raise
        log.info("train_group_ready", world_size=len(workers), dp=layout[0]["dp_size"], device=spec.device)
        return RayTrainGroup(workers, self.pg, list(layout), step, rank0_node=rank0_node)

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)


def spawn(device: str, world_size: int, *, num_cpus: float = 1.0,
          resources: dict[str, float] | None = None, runtime_env: dict[str, Any] | None = None) -> SpawnedRanks:
    """Ask Ray for WORLD_SIZE rank actors on DEVICE now (their placement group, their processes
    and imports go on in the background); `SpawnedRanks.start` builds the engines. RUNTIME_ENV:
    the trainer replica's, which ranks it spawns itself inherit, for ranks spawned elsewhere."""
    resource = ray_resource(device)
    bundle: dict[str, float] = {"CPU": num_cpus} if num_cpus > 0 else {}
    bundle.update(resources or {})  # custom resources: which nodes may hold a rank
    if resource is not None:
        bundle[resource] = 1.0
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    options: dict[str, Any] = {"num_cpus": num_cpus}
    custom = dict(resources or {})
    if resource == "GPU":
        options["num_gpus"] = 1
    elif resource is not None:
        custom[resource] = 1
    if custom:
        options["resources"] = custom
    if runtime_env:
        options["runtime_env"] = dict(runtime_env)
    actor_cls: Any = ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})(TrainWorker)  # type: ignore[call-overload]
    workers: list[Any] = [
        actor_cls.options(
            **options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r),
        ).remote(r, world_size)
        for r in range(world_size)
    ]
    return SpawnedRanks(device, workers, pg)


def resolve_device(cfg: MeshConfig, cluster_resources: dict[str, float] | None = None) -> str:
    """trainer.device, with `auto` answered by the cluster's resources (GPU > NPU > CPU) when
    known, else by this process's devices."""
    want = cfg.trainer.device
    if want != "auto":
        return want
    if cluster_resources is not None:
        if cluster_resources.get("GPU", 0) > 0:
            return "cuda"
        if cluster_resources.get("NPU", 0) > 0:
            return "npu"
        return "cpu"
    from services.common.device import detect

    return detect("auto").kind


def spawn_for(cfg: MeshConfig, *, outside_replica: bool = False) -> SpawnedRanks:
    """The ranks a trainer of CFG needs (trainer.nnodes x trainer.n_gpus_per_node on
    trainer.device, with `trainer_service.worker_*` shares), asked of Ray now. OUTSIDE_REPLICA:
    asked by `meshrl train`'s driver, so they get the trainer replica's runtime_env themselves."""
    ts = cfg.trainer_service
    return spawn(resolve_device(cfg, ray.cluster_resources()), cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node,
                 num_cpus=ts.worker_num_cpus, resources=ts.worker_resources,
                 runtime_env=cfg.serve.trainer.runtime_env if outside_replica else None)
