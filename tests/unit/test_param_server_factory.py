"""Transports are chosen from the config: one publisher and one fetcher per backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import MeshConfig
from services.common.errors import ConfigError, MissingDependency
from services.weights.transports import WeightFetcher, WeightPublisher, make_fetcher, make_publisher


def cfg(backend: str, **ps: object) -> MeshConfig:
    return MeshConfig.model_validate({
        "actor_rollout_ref": {"rollout": {"checkpoint_engine": {"backend": backend}}},
        "rollout": {"nnodes": 2, "n_gpus_per_node": 4},
        "serve": {"rollout": {"num_replicas": 8}},  # one broadcast receiver per rollout replica
        "param_server": {"disk_dir": "/tmp/meshrl-weights-test", **ps},
    })


@pytest.mark.parametrize("backend", ["grpc", "disk", "gloo"])
def test_each_backend_builds_a_publisher_and_a_fetcher(backend: str) -> None:
    c = cfg(backend, chunk_mb=8, collective_master_address="10.0.0.1")
    pub = make_publisher(c, address="ps:50061")
    fetcher = make_fetcher(c, consumer_id="rollout-3")
    assert isinstance(pub, WeightPublisher) and isinstance(fetcher, WeightFetcher)
    assert pub.transport == fetcher.transport == backend  # type: ignore[attr-defined]
    if backend == "grpc":
        assert pub.chunk_bytes == 8 << 20  # type: ignore[attr-defined]
    if backend == "disk":
        assert pub.root == Path("/tmp/meshrl-weights-test")  # type: ignore[attr-defined]
    if backend == "gloo":
        assert pub.receivers == 8 and pub.master_address == "10.0.0.1"  # type: ignore[attr-defined]


def test_unknown_or_unavailable_backends_say_what_to_do() -> None:
    with pytest.raises(ConfigError, match="not a transport"):
        make_publisher(cfg("grpc"), address="x", backend="carrier-pigeon")
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependency, match="torch_npu"):
            make_fetcher(cfg("hccl"), consumer_id="r")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(MissingDependency, match="cuda"):
            make_publisher(cfg("nccl"), address="x")


def test_config_cross_checks_name_the_fix() -> None:
    with pytest.raises(ValueError, match="max_message_mb"):
        MeshConfig.model_validate({"param_server": {"chunk_mb": 64}})
    with pytest.raises(ValueError, match="stall_timeout_s"):
        MeshConfig.model_validate({"param_server": {"stall_timeout_s": 500, "transfer_timeout_s": 100}})
    with pytest.raises(ValueError, match=r"hold_ttl_s=60\.0 is below param_server\.transfer_timeout_s=300\.0"):
        MeshConfig.model_validate({"param_server": {"hold_ttl_s": 60}})
    MeshConfig.model_validate({"param_server": {"hold_ttl_s": 60, "transfer_timeout_s": 60, "stall_timeout_s": 30}})


def test_publishers_satisfy_the_trainers_protocol() -> None:
    from services.trainer.publisher import WeightPublisher as TrainerPublisher

    for backend in ("grpc", "disk", "gloo"):
        assert isinstance(make_publisher(cfg(backend), address="ps:50071"), TrainerPublisher), backend
