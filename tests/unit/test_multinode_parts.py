"""The parts of multi-node support that run without Ray or namespaces: the param server's address
discovery (the multi-node switch), the subnet choice and the skip reasons of the namespace
cluster, the node address a process reports, the address gloo binds to."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
from pathlib import Path

import pytest

from meshrl import netns_cluster
from services.common.config import MeshConfig
from services.common.config.param_server import data_address, discovers_address
from services.common.errors import Unavailable
from services.common.net import gloo_interface, interface_of, local_ip, source_address
from services.weights.transports import discovery


def _cfg(**ps: object) -> MeshConfig:
    return MeshConfig.model_validate({"param_server": {"port": 50071, **ps}})


def test_the_switch_is_a_wildcard_host_without_an_advertised_address() -> None:
    assert not discovers_address(_cfg().param_server)  # loopback: one node, dialled as configured
    assert discovers_address(_cfg(host="0.0.0.0").param_server)
    assert not discovers_address(_cfg(host="0.0.0.0", advertise_address="10.0.0.5:50071").param_server)
    assert not discovers_address(_cfg(host="10.0.0.5").param_server)


def test_discovery_asks_the_app_once_and_every_consumer_dials_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    async def ask(app_name: str = "param_server") -> str:
        asked.append(app_name)
        return "10.231.0.10:50071"

    monkeypatch.setattr(discovery, "ask_data_address", ask)
    loopback = _cfg()
    assert asyncio.run(discovery.with_discovered_address(loopback)) is loopback and not asked
    found = asyncio.run(discovery.with_discovered_address(_cfg(host="0.0.0.0")))
    assert asked == ["param_server"] and data_address(found.param_server) == "10.231.0.10:50071"
    assert found.param_server.host == "0.0.0.0"  # the bind address is the replica's business


def test_discovery_waits_for_the_app_then_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}

    async def not_yet(app_name: str = "param_server") -> str:
        calls["n"] += 1
        if calls["n"] < 3:
            raise RuntimeError("Application 'param_server' does not exist")
        return "10.0.0.7:50071"

    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(discovery, "ask_data_address", not_yet)
    monkeypatch.setattr(discovery.asyncio, "sleep", no_sleep)
    found = asyncio.run(discovery.with_discovered_address(_cfg(host="0.0.0.0", discover_wait_s=60)))
    assert calls["n"] == 3 and found.param_server.advertise_address == "10.0.0.7:50071"

    calls["n"] = -100
    with pytest.raises(Unavailable, match=r"param_server\.discover_wait_s=0"):
        asyncio.run(discovery.with_discovered_address(_cfg(host="0.0.0.0", discover_wait_s=0)))


def test_the_subnet_is_the_first_free_one_and_a_default_route_blocks_nothing() -> None:
    net = ipaddress.IPv4Network
    assert netns_cluster.pick_subnet([net("0.0.0.0/0"), net("192.0.2.0/24")]) == net("10.231.0.0/24")
    used = [net("10.231.0.0/24"), net("10.231.1.7/32"), net("10.231.2.0/23")]
    assert netns_cluster.pick_subnet(used) == net("10.231.4.0/24")
    with pytest.raises(RuntimeError, match="no free /24"):
        netns_cluster.pick_subnet([net("10.231.0.0/16")])


def test_a_shaped_link_is_a_token_bucket_that_holds_a_segment_and_a_tick() -> None:
    cmd = netns_cluster.shape_command("vethx", 400)
    assert cmd[:7] == ["tc", "qdisc", "add", "dev", "vethx", "root", "tbf"]
    assert cmd[cmd.index("rate") + 1] == "400mbit"
    assert int(cmd[cmd.index("burst") + 1]) == 256 * 1024  # 400 Mbit/s / 250 Hz = 200 KB: the floor wins
    fast = netns_cluster.shape_command("vethx", 10_000)
    assert int(fast[fast.index("burst") + 1]) == 5_000_000  # 10 Gbit/s / 250 Hz
    with pytest.raises(ValueError, match="link_mbit"):
        netns_cluster.shape_command("vethx", 0)


def test_the_sharded_bench_refuses_what_it_cannot_run() -> None:
    from meshrl.bench.weights_sharded import run_benchmark

    with pytest.raises(SystemExit, match="--backend gloo"):
        run_benchmark(backend="nccl", cross_node=True)
    with pytest.raises(SystemExit, match="add --cross-node"):
        run_benchmark(backend="gloo", link_mbit=100)


def test_without_root_or_iproute2_the_tier_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns_cluster.sys, "platform", "linux")
    monkeypatch.setattr(netns_cluster.os, "geteuid", lambda: 1000)
    assert "root" in (netns_cluster.unavailable_reason() or "")
    monkeypatch.setattr(netns_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns_cluster.shutil, "which", lambda name: None)
    assert "iproute2" in (netns_cluster.unavailable_reason() or "")


def test_a_stale_cluster_is_swept_only_when_its_owner_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    removed: list[dict[str, object]] = []
    monkeypatch.setattr(netns_cluster, "STATE_DIR", tmp_path)
    monkeypatch.setattr(netns_cluster, "_remove", lambda **kw: removed.append(kw))
    state = {"bridge": "mrlabcdbr", "temp_root": None, "netns": ["mrlabcda"], "veths": ["mrlabcdah"]}
    (tmp_path / "live.json").write_text(json.dumps({**state, "owner_pid": os.getpid()}))
    (tmp_path / "dead.json").write_text(json.dumps({**state, "owner_pid": 0}))
    assert netns_cluster.sweep_stale() == ["dead"]
    assert [r["netns"] for r in removed] == [["mrlabcda"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.json"]


def test_local_ip_outside_ray_is_an_address() -> None:
    ipaddress.ip_address(local_ip())


def test_source_address_is_the_routes_own_end() -> None:
    assert source_address("127.0.0.1") == "127.0.0.1"
    assert source_address("127.0.0.5") == "127.0.0.1"  # loopback's /8 is reached from 127.0.0.1
    assert source_address("no-such-host.invalid") is None


def test_gloo_binds_where_it_reaches_the_master_unless_the_operator_names_an_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's default resolves the hostname, which is loopback in many containers and on Debian
    (127.0.1.1): peers on other hosts would dial their own loopback."""
    from services.common import net

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    seen: list[str] = []
    monkeypatch.setattr(net, "source_address", lambda host: seen.append(host) or "10.9.8.7")
    assert net.gloo_address("10.9.8.1") == "10.9.8.7" and seen == ["10.9.8.1"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert net.gloo_address("10.9.8.1") is None  # torch reads the variable itself


def test_trainer_ranks_name_the_interface_toward_their_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interface_of("127.0.0.1") == "lo" and gloo_interface("127.0.0.1") == "lo"
    assert interface_of("203.0.113.9") is None  # no interface holds it
    assert interface_of("not an address") is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert gloo_interface("127.0.0.1") is None  # the operator's choice stands
