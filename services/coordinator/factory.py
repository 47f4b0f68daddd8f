"""Build a coordinator (core + servicer) from a MeshConfig."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from meshrl.v1 import common_pb2
from services.common.auth import Authorizer
from services.common.config import MeshConfig, derive
from services.common.data import PromptStream, stream_digest, train_dataset
from services.common.grpc_util import MiB
from services.common.limits import Limits
from services.common.model_arch import vocab_size_of

from .core import CoordinatorCore, CoordinatorSettings
from .ledger import Ledger
from .servicer import CoordinatorServicer


def sampling_from_config(cfg: MeshConfig) -> common_pb2.SamplingParams:
    r = cfg.actor_rollout_ref.rollout
    params = common_pb2.SamplingParams(
        n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        max_tokens=cfg.data.max_response_length, stop=r.stop,
    )
    if r.seed is not None:
        params.seed = r.seed
    return params


def ledger_path(cfg: MeshConfig, run_dir: str | os.PathLike[str]) -> Path:
    return Path(cfg.coordinator.ledger_path) if cfg.coordinator.ledger_path else Path(run_dir) / "ledger.sqlite"


def build_core(
    cfg: MeshConfig, run_dir: str | os.PathLike[str], run_id: str = "", session: str = "", *, resume: bool = False
) -> CoordinatorCore:
    """SESSION: see CoordinatorSettings.session; empty means a fresh one (this process). RESUME:
    the caller continues a run, whose ledger must be there (Ledger's create)."""
    from services.environment.factory import prompt_tools

    dataset = train_dataset(cfg.data, cfg.actor_rollout_ref.model, prompt_tools(cfg))
    derived = derive(cfg, dataset_size=len(dataset))
    at = cfg.async_training
    settings = CoordinatorSettings(
        required_samples=derived.required_samples,
        staleness_threshold=at.staleness_threshold,
        trigger_parameter_sync_step=at.trigger_parameter_sync_step,
        prompts_total=derived.total_rollout_steps,
        lease_timeout_s=cfg.coordinator.lease_timeout_s,
        replica_ttl_s=cfg.coordinator.replica_ttl_s,
        max_consecutive_failures=cfg.coordinator.max_consecutive_failures,
        max_prompt_failures=cfg.coordinator.max_prompt_failures,
        max_staleness_versions=at.max_staleness_versions,
        keep_delivered_payloads=cfg.trainer.save_freq > 0 or cfg.trainer.resume_mode != "disable",
        run_id=run_id,
        session=session or uuid.uuid4().hex,
        data_digest=stream_digest(dataset, shuffle=cfg.data.shuffle, seed=cfg.data.seed),
    )
    prompts = PromptStream(dataset, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    ledger = Ledger(ledger_path(cfg, run_dir), synchronous=cfg.coordinator.ledger_synchronous, create=not resume)
    return CoordinatorCore(settings, prompts, ledger)


def build_servicer(
    cfg: MeshConfig, run_dir: str | os.PathLike[str], run_id: str = "", session: str = "", *, resume: bool = False
) -> CoordinatorServicer:
    return CoordinatorServicer(
        build_core(cfg, run_dir, run_id, session, resume=resume),
        sampling=sampling_from_config(cfg),
        auth=Authorizer.from_config(cfg),
        max_groups_per_call=cfg.coordinator.max_groups_per_call,
        max_response_tokens=cfg.coordinator.max_response_tokens,
        max_message_bytes=cfg.coordinator.max_message_mb * MiB,
        vocab_size=vocab_size_of(cfg.actor_rollout_ref.model.path),
        limits=Limits.from_config(cfg.security.limits),
    )
