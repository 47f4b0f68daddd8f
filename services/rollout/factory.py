"""Build a rollout replica (tokenizer, engine, worker) from a MeshConfig."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from meshrl.v1 import common_pb2
from services.common.config import MeshConfig
from services.common.errors import ConfigError
from services.common.logging import get_logger
from services.weights import WeightFetcher

from .engines import RolloutEngine, get_engine_cls
from .worker import Coordinator, RolloutWorker, Scorer, WorkerSettings

log = get_logger(__name__)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load_model_and_tokenizer(cfg: MeshConfig) -> tuple[Any, Any]:
    """The policy checkpoint (actor_rollout_ref.model.path) or, when null, the built-in tiny model
    built from trainer.seed (the trainer builds the same one)."""
    import torch

    m = cfg.actor_rollout_ref.model
    if m.path is None:
        from services.common.tiny import build_tiny_model, build_tokenizer

        tok = build_tokenizer()
        return build_tiny_model("qwen3", tok, seed=cfg.trainer.seed), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code)
    dtype = cfg.actor_rollout_ref.rollout.dtype
    torch_dtype = getattr(torch, _DTYPES[dtype]) if dtype in _DTYPES else "auto"
    model = AutoModelForCausalLM.from_pretrained(m.path, dtype=torch_dtype, trust_remote_code=m.trust_remote_code)
    return model, tok


def max_model_len(cfg: MeshConfig) -> int:
    r = cfg.actor_rollout_ref.rollout
    return r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length


def vllm_engine_args(cfg: MeshConfig, model_path: str, *, device: str | None) -> dict[str, Any]:
    """The AsyncEngineArgs keywords of this config's vLLM engine (vllm_args.py)."""
    from .engines.vllm_args import engine_args_from_config

    r = cfg.actor_rollout_ref.rollout
    return engine_args_from_config(model_path, r, max_model_len=max_model_len(cfg), seed=r.seed, device=device,
                                   lora_rank=cfg.actor_rollout_ref.model.lora_rank,
                                   node_devices=cfg.rollout.n_gpus_per_node)


def build_engine(cfg: MeshConfig, *, model: Any = None, tokenizer: Any = None) -> tuple[RolloutEngine, Any]:
    """The engine named by actor_rollout_ref.rollout.name, not yet started."""
    r = cfg.actor_rollout_ref.rollout
    w = cfg.rollout_worker
    cls = get_engine_cls(r.name)
    if model is None or tokenizer is None:
        model, tokenizer = load_model_and_tokenizer(cfg)
    if r.name == "transformers":
        from services.common.device import detect, torch_device
        from services.common.released import released_layout

        info = detect(w.device)
        layout = released_layout(cfg.actor_rollout_ref.model.path)  # weights arrive under released names
        engine = cls(  # type: ignore[call-arg]
            model, tokenizer, device=torch_device(info), max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens, max_model_len=max_model_len(cfg),
            version=w.initial_policy_version, seed=r.seed, weight_name=layout.to_text if layout else None,
        )
        return engine, tokenizer
    if r.name == "vllm":
        from services.common.device import detect

        from .engines.vllm_engine import save_model_dir

        path = cfg.actor_rollout_ref.model.path or save_model_dir(model, tokenizer)
        # vLLM picks its platform itself; the device kind decides whether its sleep mode
        # (free_cache_engine) is on, which exists on accelerators only.
        device = detect("auto").kind if w.device == "auto" else w.device
        args = vllm_engine_args(cfg, path, device=device)
        return cls(args, tokenizer, version=w.initial_policy_version, free_cache_engine=r.free_cache_engine), tokenizer  # type: ignore[call-arg]
    raise ConfigError(f"no builder for rollout engine {r.name!r}")


def renew_interval_s(cfg: MeshConfig) -> float:
    """The heartbeat: rollout_worker.lease_renew_interval_s, else a quarter of the coordinator's
    replica TTL (a third of the lease timeout without one)."""
    c = cfg.coordinator
    if cfg.rollout_worker.lease_renew_interval_s is not None:
        return cfg.rollout_worker.lease_renew_interval_s
    return min(c.lease_timeout_s / 3, c.replica_ttl_s / 4) if c.replica_ttl_s is not None else c.lease_timeout_s / 3


def worker_settings(cfg: MeshConfig, replica_id: str | None = None) -> WorkerSettings:
    at, w = cfg.async_training, cfg.rollout_worker
    return WorkerSettings(
        replica_id=replica_id or f"rollout-{uuid.uuid4().hex[:8]}",
        concurrent_groups=at.concurrent_samples_per_replica,
        partial_rollout=at.partial_rollout,
        partial_rollout_mode=at.partial_rollout_mode,
        renew_interval_s=renew_interval_s(cfg),
        idle_poll_s=w.idle_poll_s,
        submit_max_retries=w.submit_max_retries,
        weight_load_timeout_s=w.weight_load_timeout_s,
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
        max_resubmits=at.max_resubmits,
        batch_window_s=w.batch_window_ms / 1000.0,
        max_submit_batch=min(w.max_submit_batch, cfg.coordinator.max_groups_per_call),
        max_score_batch=w.max_score_batch,
    )


def validation_sampling(cfg: MeshConfig) -> common_pb2.SamplingParams:
    """Sampling of the Generate RPC when the request carries none (val_kwargs)."""
    v = cfg.actor_rollout_ref.rollout.val_kwargs
    return common_pb2.SamplingParams(
        n=v.n, temperature=v.temperature if v.do_sample else 0.0, top_p=v.top_p, top_k=v.top_k,
        max_tokens=cfg.data.max_response_length, stop=cfg.actor_rollout_ref.rollout.stop,
    )


def coordinator_address(cfg: MeshConfig) -> str:
    return cfg.rollout_worker.coordinator_address or f"{cfg.coordinator.host}:{cfg.coordinator.port}"


def build_worker(
    cfg: MeshConfig,
    engine: RolloutEngine,
    tokenizer: Any,
    *,
    coordinator: Coordinator | None,
    scorer: Scorer | None,
    fetcher: WeightFetcher | None,
    replica_id: str | None = None,
) -> RolloutWorker:
    settings = worker_settings(cfg, replica_id)
    agent = build_agent(cfg, tokenizer, settings, scorer=scorer)
    return RolloutWorker(engine, tokenizer, coordinator, scorer, fetcher, settings, agent=agent)


def build_agent(cfg: MeshConfig, tokenizer: Any, settings: WorkerSettings, scorer: Scorer | None = None) -> Any:
    """The AgentLoop of a multi-turn run (actor_rollout_ref.rollout.multi_turn.enable), the
    gateway's agent runner with agent.command / agent.endpoint, else None. Loads the tool /
    interaction YAMLs now, so a bad one fails the replica at start."""
    if cfg.agent.enabled:
        from .gateway import build_gateway_agent

        return build_gateway_agent(cfg, tokenizer, scorer=scorer, max_model_len=max_model_len(cfg))
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    from services.environment.factory import build_router

    from .agent.loop import AgentLoop, settings_from_config

    return AgentLoop(tokenizer, build_router(cfg), settings_from_config(
        mt, max_prompt_length=settings.max_prompt_length, truncation=settings.truncation,
        max_resubmits=settings.max_resubmits, reward_source=cfg.environment.reward_source,
        max_json_depth=cfg.security.limits.max_json_depth, max_model_len=max_model_len(cfg),
        max_message_chars=cfg.environment.max_message_chars,
    ))


def default_scorer(cfg: MeshConfig) -> Scorer | None:
    """The reward service this replica calls: a DeploymentHandle to `reward_application` when
    running under Serve, else RewardClient(`reward_address`); None when neither is configured."""
    w = cfg.rollout_worker
    if w.reward_address:
        from services.reward.client import RewardClient

        return RewardClient(w.reward_address, application=w.reward_application)  # type: ignore[return-value]
    if w.reward_application:
        return AppHandleScorer(w.reward_application)
    return None


class AppHandleScorer:
    """A HandleScorer to the Serve application `app`, looked up at the first call and retried
    while the application is not deployed yet (the apps of one `serve deploy` start together).
    Past `wait_s` the call fails like any scorer error: the group's lease goes back."""

    def __init__(self, app: str, wait_s: float = 600.0) -> None:
        self.app = app
        self.wait_s = wait_s
        self._scorer: Any = None
        self._lock = asyncio.Lock()

    async def __call__(self, items: list[Any]) -> list[Any]:
        if self._scorer is None:
            async with self._lock:
                if self._scorer is None:
                    self._scorer = await self._resolve()
        return await self._scorer(items)  # type: ignore[no-any-return]

    async def _resolve(self) -> Any:
        from ray import serve
        from ray.serve.exceptions import RayServeException

        from services.reward.client import HandleScorer

        deadline = time.monotonic() + self.wait_s
        delay = 0.5
        while True:
            try:
                return HandleScorer(serve.get_app_handle(self.app))
            except RayServeException as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("reward_app_not_up_yet", application=self.app, retry_in_s=delay, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)


def default_fetcher(cfg: MeshConfig, replica_id: str) -> WeightFetcher | None:
    """The param server fetcher for this replica (the group's transport), or None when
    rollout_worker.fetch_weights_from_param_server is false."""
    if not cfg.rollout_worker.fetch_weights_from_param_server:
        return None
    from services.weights.transports import make_fetcher

    return make_fetcher(cfg, consumer_id=replica_id)
