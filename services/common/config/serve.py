"""`serve.*`: how the services are deployed on Ray Serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import ConfigModel


class AutoscalingConfig(ConfigModel):
    """Ray Serve autoscaling for an application's deployment."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas."""
    max_replicas: int = Field(default=1, ge=1)
    """Most replicas."""
    target_ongoing_requests: float = Field(default=2.0, gt=0)
    """Target in-flight work per replica."""
    upscale_delay_s: float = 30.0
    """Seconds above target before adding a replica."""
    downscale_delay_s: float = 600.0
    """Seconds below target before removing one."""

    @model_validator(mode="after")
    def _range(self) -> AutoscalingConfig:
        # Ray Serve refuses min > max only when the application is deployed.
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"max_replicas={self.max_replicas} is below min_replicas={self.min_replicas}; "
                f"raise max_replicas to at least {self.min_replicas} (or lower min_replicas)"
            )
        return self


class AppDeployConfig(ConfigModel):
    """Replicas and resources of one application's deployment."""

    num_replicas: int = Field(default=1, ge=1)
    """Fixed replicas (ignored when autoscaling is set)."""
    num_cpus: float = Field(default=1.0, ge=0)
    """CPUs per replica."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per replica (CUDA)."""
    resources: dict[str, float] = {}
    """Custom Ray resources per replica, e.g. {"NPU": 1}."""
    autoscaling: AutoscalingConfig | None = None
    """Autoscaling; null: fixed `num_replicas`."""
    max_ongoing_requests: int = Field(default=64, ge=1)
    """Concurrent requests per replica (streams count)."""
    runtime_env: dict[str, Any] = {}
    """Ray runtime_env for the replica."""

    def ray_actor_options(self) -> dict[str, Any]:
        """Serve's `ray_actor_options` for one replica of this app (unset parts left out)."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            actor["num_gpus"] = self.num_gpus
        if self.resources:
            actor["resources"] = dict(self.resources)
        if self.runtime_env:
            actor["runtime_env"] = dict(self.runtime_env)
        return actor


class ServeConfig(ConfigModel):
    """Ray Serve options for the mesh."""

    grpc_port: int = Field(default=9000, ge=0, le=65535)
    """Serve's gRPC ingress port."""
    http_port: int = Field(default=8000, ge=0, le=65535)
    """Serve's HTTP proxy port (always started by Serve)."""
    proxy_location: Literal["HeadOnly", "EveryNode", "Disabled"] = "HeadOnly"
    """Where Serve runs proxies."""
    request_timeout_s: float | None = None
    """End-to-end timeout Serve applies to gRPC requests (streams included)."""
    ray_address: str | None = None
    """Ray cluster address; null: start a local Ray."""
    num_cpus: int | None = None
    """CPUs given to a local Ray; null: all."""
    bytecode_cache: str = "auto"
    """Where the mesh's processes keep compiled byte code: "auto" (a local Ray: under
    $MESHRL_CACHE_DIR/pycache when torch or transformers ships none and the environment would not
    write it, e.g. PYTHONDONTWRITEBYTECODE=1; else as the environment says), "off", or a directory
    (always; made absolute). Without it such an image compiles torch in every process of every run
    (seconds each); services/common/bytecode.py."""
    parallel_deploy: bool = True
    """`meshrl train` deploys every application at once (as `serve deploy` of its serve config
    does); false: one application after the other (the start-up baseline)."""
    coordinator: AppDeployConfig = AppDeployConfig(num_cpus=0.5)
    """The coordinator (always one replica)."""
    rollout: AppDeployConfig = AppDeployConfig()
    """Rollout replicas (autoscaling allowed)."""
    reward: AppDeployConfig = AppDeployConfig(num_cpus=0.5)
    """Reward replicas."""
    param_server: AppDeployConfig = AppDeployConfig(num_cpus=0.5)
    """The param server (always one replica)."""
    trainer: AppDeployConfig = AppDeployConfig()
    """The trainer driver replica (always one; its ranks are separate actors in a placement group)."""

    @model_validator(mode="after")
    def _single_replica_apps(self) -> ServeConfig:
        if self.proxy_location == "Disabled":
            raise ValueError("serve.proxy_location=Disabled: the services talk through Serve's gRPC ingress; "
                             "use HeadOnly or EveryNode")
        # These deployments are built with one replica (the coordinator owns the ledger, the
        # param server the versions, the trainer its ranks): other values would be ignored.
        for name in ("coordinator", "param_server", "trainer"):
            app: AppDeployConfig = getattr(self, name)
            if app.num_replicas != 1 or app.autoscaling is not None:
                raise ValueError(
                    f"serve.{name} runs as exactly one replica; remove serve.{name}.num_replicas / "
                    f"serve.{name}.autoscaling (scale rollout and reward instead)"
                )
        return self

    @field_validator("bytecode_cache", mode="before")
    @classmethod
    def _bytecode_cache(cls, value: Any) -> Any:
        if isinstance(value, bool):  # YAML reads an unquoted off / on as a bool
            return "off" if not value else "auto"
        if isinstance(value, str) and value not in ("auto", "off"):
            if not value.strip():
                raise ValueError('serve.bytecode_cache is empty; use "auto", "off" or a directory')
            return str(Path(value).expanduser().absolute())  # every worker has its own working directory
        return value
