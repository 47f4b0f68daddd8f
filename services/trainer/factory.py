"""Build the trainer's parts from a MeshConfig: the engine spec (with the LR schedule's total
step count fixed up front), the loop settings, the RL algorithm, the coordinator address."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.config import MeshConfig, derive
from services.common.config.actor_rollout_ref import COLLECTIVE_BACKENDS
from services.common.config.trainer_loop import TrainerLoopConfig
from services.common.config.trainer_service import TrainerServiceConfig
from services.common.errors import MissingDependency
from services.common.grpc_util import MiB
from services.common.model_arch import read_hf_config, vocab_size_of
from services.common.startup import StartupClock
from services.weights import WeightPublisher

from .core import Algorithm, LoopSettings, TrainerLoop
from .engines.base import EngineSpec
from .group import TrainGroup
from .publisher import RankZeroPublisher
from .retry import retry_transient

if TYPE_CHECKING:
    from services.coordinator.client import CoordinatorClient

    from .ranks import SpawnedRanks
    from .servicer import TrainerServicer
    from .workers import RayTrainGroup


def dataset_size(cfg: MeshConfig) -> int:
    from services.common.data import train_dataset
    from services.environment.factory import prompt_tools

    return len(train_dataset(cfg.data, cfg.actor_rollout_ref.model, prompt_tools(cfg)))


def total_local_steps(cfg: MeshConfig, size: int | None) -> int:
    """Local trainer steps of the run (verl: total_train_steps * trigger_parameter_sync_step)."""
    return derive(cfg, dataset_size=size).total_local_steps


def total_optimizer_steps(cfg: MeshConfig, size: int | None) -> int:
    """Optimizer steps the LR schedule spans: optim.total_training_steps if set, else local
    steps x require_batches mini-batches x ppo_epochs."""
    actor = cfg.actor_rollout_ref.actor
    if actor.optim.total_training_steps > 0:
        return actor.optim.total_training_steps
    return total_local_steps(cfg, size) * cfg.async_training.require_batches * actor.ppo_epochs


def built_in_model_init(cfg: MeshConfig) -> Callable[[], Any] | None:
    """With `model.path` null: the built-in tiny Qwen3 (same seed as the rollout's)."""
    if cfg.actor_rollout_ref.model.path is not None:
        return None

    def init() -> Any:
        from services.common.tiny import build_tiny_model, build_tokenizer

        return build_tiny_model("qwen3", build_tokenizer(), seed=0)

    from services.common.logging import get_logger

    get_logger(__name__).warning(
        "model_path_null", hint="training the built-in tiny Qwen3 (random init, seed 0); the rollout must start from "
        "the same weights, or set actor_rollout_ref.model.path",
    )
    return init


def pad_token_id(cfg: MeshConfig) -> int:
    model = cfg.actor_rollout_ref.model
    if model.path is None:
        from services.common.tiny import build_tokenizer

        return int(build_tokenizer().pad_token_id)
    if Path(model.path, "config.json").is_file():  # the checkpoint's own ids, without importing transformers
        raw = read_hf_config(model.path)
        found = _first_token_id(raw.get("text_config") or raw)
        if found is not None:
            return found
    from transformers import AutoConfig  # a hub name, or ids only the config class's defaults give

    hf = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    hf = getattr(hf, "text_config", None) or hf
    return _first_token_id({key: getattr(hf, key, None) for key in ("pad_token_id", "eos_token_id")}) or 0


def _first_token_id(config: dict[str, Any]) -> int | None:
    """pad_token_id, else eos_token_id (the first of a list), of a config's fields."""
    for key in ("pad_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def engine_spec(cfg: MeshConfig, device: str, size: int | None, model_init: Callable[[], Any] | None = None) -> EngineSpec:
    arr = cfg.actor_rollout_ref
    return EngineSpec(
        model=arr.model,
        actor=arr.actor,
        device=device,
        total_training_steps=total_optimizer_steps(cfg, size),
        ref=arr.ref if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward else None,
        log_prob_micro_batch_size_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu,
        seed=cfg.trainer.seed,
        collective_timeout_s=float(arr.nccl_timeout),
        model_init=model_init if model_init is not None else built_in_model_init(cfg),
    )


def checkpoint_dir(loop: TrainerLoopConfig, run_dir: str | os.PathLike[str]) -> Path:
    return Path(loop.default_local_dir) if loop.default_local_dir else Path(run_dir) / "checkpoints"


def loop_settings(
    ts: TrainerServiceConfig, run_dir: str | os.PathLike[str], size: int | None, pad_id: int, vocab_size: int | None,
    session: str = "",
) -> LoopSettings:
    """The loop's settings from the trainer service's own section alone (`ts.loop` holds what
    verl's keys say, mapped at load) plus what only the run knows: its directory, the dataset's
    size (the run's length, `total_steps`, depends on it), the tokenizer's pad id and the
    policy's vocabulary size."""
    loop = ts.loop
    return LoopSettings(
        trainer_id=ts.trainer_id,
        groups_per_step=loop.groups_per_step,
        checkpoint_dir=checkpoint_dir(loop, run_dir),
        mini_batches_per_step=loop.require_batches,
        ppo_epochs=loop.ppo_epochs,
        shuffle=loop.shuffle,
        trigger_parameter_sync_step=loop.trigger_parameter_sync_step,
        total_steps=loop.total_local_steps(size),
        save_freq=loop.save_freq,
        temperature=loop.temperature,
        bypass_mode=loop.bypass_mode,
        use_kl_loss=loop.use_kl_loss,
        filter_metric=loop.filter_metric,
        max_num_gen_batches=loop.max_num_gen_batches,
        bucket_bytes=loop.update_weights_bucket_megabytes << 20,
        fetch_timeout_ms=ts.fetch_timeout_ms,
        pad_token_id=pad_id,
        max_checkpoints_to_keep=ts.max_checkpoints_to_keep,
        metrics_path=Path(run_dir) / ts.metrics_file,
        resume_mode=loop.resume_mode,
        resume_from_path=loop.resume_from_path,
        session=session,
        seed=loop.seed,
        hf_export_dir=Path(run_dir) / ts.hf_export_dir if ts.hf_export_dir else None,
        coordinator_wait_s=ts.coordinator_wait_s,
        overlap=ts.overlap,
        vocab_size=vocab_size,
    )


def algorithm_from_config(cfg: MeshConfig) -> Algorithm:
    """Advantages, loss and the DAPO filter from services.trainer.algos."""
    try:
        from services.trainer import algos  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        raise MissingDependency(
            "services.trainer.algos (advantages and losses)", f"this checkout lacks the RL algorithms: {exc}"
        ) from exc
    algo_cfg = cfg.algorithm
    metric = algo_cfg.filter_groups.metric

    def advantages(batch: Any) -> Any:
        return algos.compute_advantages(batch, algo_cfg)

    def values(seq_tensors: Any) -> Any:
        return algos.dynamic_sampling_values(seq_tensors, metric)

    def correct(batch: Any) -> dict[str, float]:
        return algos.apply_rollout_correction(batch, algo_cfg)  # type: ignore[no-any-return]

    def reward_kl(batch: Any) -> dict[str, float]:
        return algos.apply_kl_in_reward(batch, algo_cfg)  # type: ignore[no-any-return]

    return Algorithm(
        compute_advantages=advantages,
        loss_fn=algos.build_loss_fn(cfg.actor_rollout_ref.actor, algo_cfg),
        keep=algos.dynamic_sampling_keep if algo_cfg.filter_groups.enable else None,
        values=values,
        correct=correct,
        reward_kl=reward_kl if algo_cfg.use_kl_in_reward else None,
    )


def coordinator_address(cfg: MeshConfig) -> str:
    ts = cfg.trainer_service
    return ts.coordinator_address or f"{cfg.coordinator.host}:{cfg.coordinator.port}"


def coordinator_client(cfg: MeshConfig) -> CoordinatorClient:
    """The trainer's coordinator client: the trainer role's token, TLS to a plain coordinator that
    has it."""
    from services.common.auth import TRAINER
    from services.common.security import client_security
    from services.coordinator.client import CoordinatorClient

    ts = cfg.trainer_service
    ingress = ts.coordinator_application is not None
    sec = client_security(cfg, TRAINER)
    return CoordinatorClient(
        coordinator_address(cfg), application=ts.coordinator_application, timeout_s=ts.coordinator_timeout_s,
        max_message_bytes=cfg.coordinator.max_message_mb * MiB,
        security=sec.plaintext() if ingress else sec, tls=bool(cfg.coordinator.tls_cert_file) and not ingress,
    )


async def _abandon(ranks: SpawnedRanks, starting: asyncio.Future[RayTrainGroup] | None) -> None:
    """Take down rank actors whose trainer failed to start: still starting (`start` kills them
    when cancelled), built (closed), or not asked to start yet (killed)."""
    if starting is None:
        ranks.kill()
        return
    starting.cancel()
    await asyncio.wait([starting])
    if not starting.cancelled() and starting.exception() is None:  # built before the failure
        await starting.result().close()
    # else cancelled or failed: `start` has taken them down


def check_model(cfg: MeshConfig, model_init: Callable[[], Any] | None = None) -> None:
    """Reject model/config combinations (packing with gated delta-net layers, Ulysses head
    counts) from the HF config alone (`build_trainer` has rank 0 run it before its engine build,
    `SpawnedRanks.check_model`; with a MODEL_INIT callable, the replica runs it)."""
    from .engines import hf_model

    model = cfg.actor_rollout_ref.model
    if model.path is not None:
        hf = hf_model.load_config(model)
    else:
        init = model_init or built_in_model_init(cfg)
        assert init is not None
        hf = hf_model.config_from_init(model, init)
    hf_model.check_compat(hf, model, cfg.actor_rollout_ref.actor)


@dataclass
class TrainerParts:
    """A built trainer: the loop, its servicer and what they own (closed by `close`)."""

    loop: TrainerLoop
    servicer: TrainerServicer
    group: TrainGroup
    coordinator: CoordinatorClient
    publisher: WeightPublisher | RankZeroPublisher

    async def close(self) -> None:
        try:
            close = getattr(self.publisher, "close", None)  # its connections; object_store: the last manifest's board
            if close is not None:
                await close()
        except Exception as exc:  # noqa: BLE001 -- shutting down: logged, the rest still closes
            from services.common.logging import get_logger

            get_logger(__name__).warning("publisher_close_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            await self.group.close()
            await self.coordinator.close()




def _publisher(
    cfg: MeshConfig, run_dir: str | os.PathLike[str], client: CoordinatorClient
) -> WeightPublisher | RankZeroPublisher:
    """`trainer_service.publisher`: `param_server` publishes through the param server with the
    rollout group's transport (actor_rollout_ref.rollout.checkpoint_engine.backend). The
    collective transports send from rank 0 (they need its device) and announce the version
    through CommitVersion before broadcasting."""
    from .publisher import build_publisher

    ts = cfg.trainer_service
    if ts.publisher != "param_server":
        return build_publisher(ts.publisher, retain_versions=cfg.param_server.retain_versions)
    if cfg.actor_rollout_ref.rollout.checkpoint_engine.backend in COLLECTIVE_BACKENDS:
        every_rank = functools.partial(collective_sender, cfg, str(run_dir)) if cfg.param_server.collective_sharded else None
        return RankZeroPublisher(functools.partial(collective_sender, cfg, str(run_dir)), every_rank,
                                 wanted_again=_send_again_probe(cfg))
    from services.weights.transports import make_publisher

    async def announce(ref: Any) -> bool:
        return not (await client.commit_version(ts.trainer_id, ref)).stopping

    return make_publisher(cfg, run_dir=run_dir, announce=announce)


def _send_again_probe(cfg: MeshConfig) -> Any:
    """RankZeroPublisher.wanted_again: the rendezvous groups rank 0 (or, sharded, every rank)
    sends in, asked with the trainer's token from the loop's process."""
    from services.common.auth import TRAINER
    from services.common.config.param_server import data_address
    from services.common.security import client_security
    from services.weights.shards import sender_group
    from services.weights.transports.collective import SendAgainProbe

    ps = cfg.param_server
    senders = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    groups = [sender_group(ps.collective_group, r) for r in range(senders)] if ps.collective_sharded else [ps.collective_group]
    return SendAgainProbe(data_address(ps), groups, security=client_security(cfg, TRAINER))


def collective_sender(cfg: MeshConfig, run_dir: str, rank: int | None = None) -> WeightPublisher:
    """Rank 0's collective publisher (or, with `rank`, that rank's sender of its own shards),
    announcing each version through a coordinator client of its own. Called on the rank's
    publishing event loop (RankZeroPublisher)."""
    from services.common.auth import TRAINER
    from services.common.security import use_role
    from services.weights.transports import make_publisher

    ts = cfg.trainer_service
    use_role(cfg, TRAINER)  # rank 0's process: its param server clients send the trainer token
    announce = version_announcer(coordinator_client(cfg), ts.trainer_id, wait_s=ts.coordinator_wait_s)
    return make_publisher(cfg, run_dir=run_dir, announce=announce, sender_rank=rank)


def version_announcer(client: Any, trainer_id: str, *, wait_s: float) -> Callable[[Any], Awaitable[bool]]:
    """A collective sender's announce: CommitVersion before the broadcast (False: the run is
    stopping). Retried while the coordinator is being replaced, as the trainer's own commits are
    (idempotent: the same ref again is a no-op); before, one UNAVAILABLE failed the loop."""

    async def announce(ref: Any) -> bool:
        resp = await retry_transient("CommitVersion (announce)", lambda: client.commit_version(trainer_id, ref),
                                     wait_s=wait_s)
        return not resp.stopping

    return announce


async def build_trainer(
    cfg: MeshConfig,
    run_dir: str | os.PathLike[str],
    *,
    algorithm: Algorithm | None = None,
    publisher: WeightPublisher | None = None,
    model_init: Callable[[], Any] | None = None,
    clock: StartupClock | None = None,
    ranks: SpawnedRanks | None = None,
    session: str = "",
) -> TrainerParts:
    """Everything the Serve deployment runs: rank actors (Ray; RANKS: already asked for, see
    `ranks.spawn_for`), the coordinator client, the publisher and the loop. Config problems
    (the algorithm's, the dataset's, the model's HF config) fail here while the rank actors
    start, which are then taken down."""
    from services.common.auth import Authorizer

    from .ranks import spawn_for
    from .servicer import TrainerServicer

    # The ranks' start-up (a process each, its imports, the process group, the model build) is
    # the longest part of a trainer's start: Ray is asked for them first (the Serve replica asks
    # before its own imports: `ranks`), so that their spawn and imports overlap everything below
    # (the dataset's size, the model's config, the clients).
    if ranks is None:
        ranks = spawn_for(cfg)
        if clock is not None:
            clock.mark("ranks_requested")
    device = ranks.device
    ts = cfg.trainer_service
    starting: asyncio.Future[RayTrainGroup] | None = None
    checked: asyncio.Future[None] | None = None
    try:
        # The model's config is checked on rank 0, which has transformers' model stack loaded by
        # now (this replica would spend seconds importing it), before its engine build.
        checked = ranks.check_model(cfg) if model_init is None else None
        algorithm = algorithm or algorithm_from_config(cfg)
        size = dataset_size(cfg)
        spec = engine_spec(cfg, device, size, model_init)
        settings = loop_settings(ts, run_dir, size, pad_token_id(cfg), vocab_size_of(cfg.actor_rollout_ref.model.path),
                                 session)
        # The engines build while this replica builds its clients and publisher.
        starting = asyncio.ensure_future(
            ranks.start(spec, cfg.actor_rollout_ref.actor.strategy, nice=cfg.tuning.nice.trainer_ranks))
        if checked is not None:
            await checked
        else:  # a model_init callable (tests, built-in models): checked here
            await asyncio.to_thread(check_model, cfg, model_init)
        if clock is not None:
            clock.mark("model_checked")
        client = coordinator_client(cfg)
        if publisher is None and ts.publisher == "param_server":
            from services.weights.transports.discovery import with_discovered_address

            cfg = await with_discovered_address(cfg)  # param_server.host=0.0.0.0: ask the app where it is
        pub = publisher or _publisher(cfg, run_dir, client)
    except BaseException:
        if checked is not None:
            checked.cancel()
        await _abandon(ranks, starting)
        raise
    if clock is not None:
        clock.mark("publisher_built")
    group = await starting
    if clock is not None:
        clock.mark("ranks_ready")
    if isinstance(pub, RankZeroPublisher):
        try:
            await group.start_sender(pub.make, pub.every_rank)
        except BaseException:
            await group.close()
            raise
    loop = TrainerLoop(settings, group, client, pub, algorithm)
    servicer = TrainerServicer(
        loop, trainer_id=ts.trainer_id, engine=cfg.actor_rollout_ref.actor.strategy, auth=Authorizer.from_config(cfg)
    )
    return TrainerParts(loop, servicer, group, client, pub)
