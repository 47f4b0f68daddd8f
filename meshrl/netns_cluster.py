"""A Ray cluster of several nodes on one machine, each node in a Linux network namespace of its
own: what the `multinode` tests and `meshrl bench weights --cross-node` run on.

    root namespace: bridge mrl<id>br, 10.231.X.1/24 (this process dials the nodes from here)
      ├─ veth ── netns mrl<id>a  10.231.X.10   ray start --head (GCS :6379, dashboard :8265), {node_a: 1000}
      ├─ veth ── netns mrl<id>b  10.231.X.11   ray start --address=10.231.X.10:6379,         {node_b: 1000}
      └─ veth ── netns mrl<id>c  10.231.X.12   ...                                            {node_c: 1000}

A node's processes (raylet, agents, workers, Serve replicas and proxies) see only their own
namespace's network: the veth and loopback, no default route, so nothing outside the subnet is
reachable and every cross-node byte crosses a veth and the bridge, as between hosts. They share the
filesystem: one run directory every node sees, as a shared mount would give a real cluster. Each
namespace has a port space of its own, so every node can listen on the same fixed ports (Serve's
gRPC ingress, the param server's data plane) as hosts of a cluster do, and nothing here meets
another Ray on this machine (each node also has a temp dir of its own, so no `ray.init()`
elsewhere finds it).

`ray=False` makes the namespaces and their network without Ray (processes enter a node with
`run_in_netns`); `link_mbit=X` gives every node a link of X Mbit/s each way (tc's token bucket on
both ends of its veth), so that a wire, not this machine's CPUs, sets the pace.

Everything is made by `start()` and removed by `close()` (also after a failure; a cluster whose
owner died without closing is removed by the next `start()`, from its state file): the processes
in the namespaces (ours by construction: only what we start enters them), the namespaces, the
veths, the bridge and the temp dirs. Needs root and iproute2 (`unavailable_reason()` says why not).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.logging import get_logger

log = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = Path("/tmp/meshrl-netns")
"""One JSON file per live cluster (its names, its owner's pid): what a later start() sweeps."""
SUBNET_PREFIX = "10.231"
"""Clusters take the first free 10.231.X.0/24 (X = 0..255) not routed in the root namespace."""
GCS_PORT = 6379
DASHBOARD_PORT = 8265
HOST_OFFSET = 10
"""Node i's address is 10.231.X.(10 + i); .1 is the bridge."""
RESOURCE_UNITS = 1000.0
"""Each node's custom resource `node_<name>`: placement asks a fraction of a unit (or one)."""
FAST_FAILURE_DETECTION = {
    # The GCS marks a node dead after `failure_threshold` missed health checks (Ray's defaults:
    # 5 x 3 s, plus a 10 s timeout each). Tests that kill a node wait for that, so make it ~3 s.
    "RAY_health_check_initial_delay_ms": "2000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=timeout)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root (run as root, as CI does)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing: apt-get install iproute2"
    probe = f"mrlprobe{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    veth = f"mrlp{os.getpid() % 100000}"
    made = _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "x"], check=False)
    if made.returncode != 0:
        return f"`ip link add ... type veth` failed: {made.stderr.strip()}"
    _run(["ip", "link", "del", veth], check=False)
    return None


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks the root namespace has addresses in or routes to."""
    nets = []
    for cmd in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for line in _run(cmd).stdout.splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in word or word[:1].isdigit():
                        nets.append(ipaddress.IPv4Network(word, strict=False))
    return nets


def pick_subnet(used: Sequence[ipaddress.IPv4Network] | None = None) -> ipaddress.IPv4Network:
    """The first 10.231.X.0/24 that overlaps nothing the root namespace has or routes (`used`:
    those networks; default: asked of `ip`). A default route (0.0.0.0/0) overlaps nothing."""
    used = _routed_networks() if used is None else used
    for x in range(256):
        net = ipaddress.IPv4Network(f"{SUBNET_PREFIX}.{x}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError(f"no free /24 under {SUBNET_PREFIX}.0.0/16 in the root namespace")


def shape_command(dev: str, mbit: float) -> list[str]:
    """tc's token bucket on `dev`'s egress at `mbit` Mbit/s. The bucket holds at least 256 KiB
    (a veth hands tc 64 KiB segments) and a tick's worth of bytes at a 250 Hz timer."""
    if mbit <= 0:
        raise ValueError(f"link_mbit must be > 0 Mbit/s, got {mbit}")
    burst = max(256 * 1024, int(mbit * 1e6 / 8 / 250))
    return ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit", "burst", str(burst),
            "latency", "100ms"]


CLONE_NEWNET = 0x40000000


def enter_netns(netns: str) -> None:
    """Move the calling thread into a namespace `ip netns` made (threads it starts afterwards
    inherit it; sockets keep the namespace they were made in). For a process started with
    `spawn` to run on a node without Ray: `run_in_netns` as its target."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the network namespace {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in_netns(netns: str, target: Any, *args: Any) -> Any:
    """A process's target: enter `netns` first, then run `target(*args)`."""
    enter_netns(netns)
    return target(*args)


def namespace_pids(netns: str) -> list[int]:
    """Processes inside a network namespace."""
    out = _run(["ip", "netns", "pids", netns], check=False)
    return [int(x) for x in out.stdout.split() if x.isdigit()]


@dataclass
class Node:
    """One Ray node: a namespace, its address, the `ray start --block` process that owns it."""

    name: str
    index: int
    netns: str
    veth: str
    ip: str
    num_cpus: int
    head: bool
    starts: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def resource(self) -> str:
        return f"node_{self.name}"


@dataclass
class NetnsCluster:
    """A Ray cluster of `nodes` on this machine, one network namespace per node (module docstring).

        with NetnsCluster(["a", "b", "c"], work_dir=tmp) as cluster:
            cluster.run_in("a", ["serve", "deploy", ...])        # a command on node a
            cluster.kill_node("b"); cluster.start_node("b")      # lose node b, let it rejoin
    """

    names: Sequence[str] = ("a", "b", "c")
    work_dir: Path = field(default_factory=lambda: Path("/tmp"))
    num_cpus: int | dict[str, int] = 4
    object_store_mb: int = 512
    dashboard: bool = True
    env: dict[str, str] = field(default_factory=dict)
    fast_failure_detection: bool = True
    ray: bool = True
    """False: the namespaces and their network only (processes enter them with `run_in_netns`)."""
    link_mbit: float | None = None
    """Each node's link, both ways (tc tbf on the two ends of its veth): a NIC of this many Mbit/s
    on a non-blocking switch (the bridge). None: the veths' own speed (the machine's CPUs)."""
    nodes: dict[str, Node] = field(default_factory=dict, init=False)
    subnet: ipaddress.IPv4Network | None = field(default=None, init=False)
    token: str = field(default_factory=lambda: secrets.token_hex(2), init=False)
    temp_root: Path | None = field(default=None, init=False)
    auth_token: str = field(default_factory=lambda: secrets.token_hex(32), init=False, repr=False)
    _saved_env: dict[str, str | None] = field(default_factory=dict, init=False, repr=False)

    # ---- names --------------------------------------------------------------------------------

    @property
    def bridge(self) -> str:
        return f"mrl{self.token}br"

    @property
    def head(self) -> Node:
        return next(n for n in self.nodes.values() if n.head)

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    def ip(self, name: str) -> str:
        return self.nodes[name].ip

    @property
    def bridge_ip(self) -> str:
        """The root namespace's address on the nodes' subnet (a server here is reachable from every node)."""
        assert self.subnet is not None
        return str(next(self.subnet.hosts()))

    def _state_file(self) -> Path:
        return STATE_DIR / f"{self.token}.json"

    # ---- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout_s: float = 300.0) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        if self.link_mbit is not None and shutil.which("tc") is None:
            raise RuntimeError("link_mbit needs the `tc` command (iproute2): apt-get install iproute2")
        sweep_stale()
        self.subnet = pick_subnet()
        hosts = list(self.subnet.hosts())
        self.temp_root = Path(f"/tmp/mrl{self.token}")  # short: Ray's socket paths have a length limit
        self.temp_root.mkdir(parents=True, exist_ok=False)
        for i, name in enumerate(self.names):
            cpus = self.num_cpus[name] if isinstance(self.num_cpus, dict) else self.num_cpus
            self.nodes[name] = Node(name=name, index=i, netns=f"mrl{self.token}{name}", veth=f"mrl{self.token}{name}h",
                                    ip=str(hosts[HOST_OFFSET - 1 + i]), num_cpus=cpus, head=i == 0)
        self._write_state()
        # Ray's token authentication with a token of this cluster's own, also in this process
        # (alive_nodes() asks the GCS from here); close() puts the environment back.
        for key, value in self.auth_env().items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        try:
            self._make_network(hosts[0])
            for node in self.nodes.values() if self.ray else ():
                self.start_node(node.name)
                if node.head:
                    self.wait_for_nodes(1, timeout_s)
            if self.ray:
                self.wait_for_nodes(len(self.nodes), timeout_s)
        except BaseException:
            self.close()
            raise
        log.info("netns_cluster_up", subnet=str(self.subnet), nodes={n.name: n.ip for n in self.nodes.values()})

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps({
            "owner_pid": os.getpid(), "bridge": self.bridge, "temp_root": str(self.temp_root),
            "netns": [n.netns for n in self.nodes.values()], "veths": [n.veth for n in self.nodes.values()],
        }))

    def _make_network(self, bridge_ip: ipaddress.IPv4Address) -> None:
        assert self.subnet is not None
        plen = self.subnet.prefixlen
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{bridge_ip}/{plen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes.values():
            inner = node.veth[:-1] + "n"
            _run(["ip", "netns", "add", node.netns])
            _run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", inner, "netns", node.netns])
            _run(["ip", "link", "set", node.veth, "master", self.bridge])
            _run(["ip", "link", "set", node.veth, "up"])
            ns = ["ip", "netns", "exec", node.netns]
            _run([*ns, "ip", "link", "set", "lo", "up"])
            _run([*ns, "ip", "addr", "add", f"{node.ip}/{plen}", "dev", inner])
            _run([*ns, "ip", "link", "set", inner, "up"])
            if self.link_mbit is not None:
                _run([*ns, *shape_command(inner, self.link_mbit)])  # the node's uplink
                _run(shape_command(node.veth, self.link_mbit))  # its downlink (the bridge's port)

    def auth_env(self) -> dict[str, str]:
        """What a process needs to talk to this cluster (Ray's token authentication: the GCS, the
        dashboard and `serve deploy` refuse calls without it)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.auth_token}

    def node_env(self) -> dict[str, str]:
        """Environment of every process started in a namespace."""
        from services.common.serve_util import SERVE_ENV_DEFAULTS

        env = dict(os.environ)
        for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            env.pop(key, None)
        pythonpath = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
        env.update(PYTHONPATH=pythonpath, RAY_USAGE_STATS_ENABLED="0")
        for key, value in SERVE_ENV_DEFAULTS.items():
            env.setdefault(key, value)
        env.update(self.auth_env())
        if self.fast_failure_detection:
            env.update(FAST_FAILURE_DETECTION)
        env.update(self.env)
        return env

    def start_node(self, name: str) -> None:
        """`ray start --block` in the node's namespace (again, after `kill_node`: the node rejoins
        with the same address and resource, a new Ray node id and a fresh temp dir)."""
        assert self.temp_root is not None
        node = self.nodes[name]
        node.starts += 1
        temp_dir = self.temp_root / f"{name}{node.starts}"
        node.log_path = self.work_dir / f"ray_{name}{node.starts}.log"
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats",
               f"--node-ip-address={node.ip}", f"--num-cpus={node.num_cpus}",
               f"--resources={json.dumps({node.resource: RESOURCE_UNITS})}",
               f"--object-store-memory={self.object_store_mb * (1 << 20)}", f"--temp-dir={temp_dir}"]
        if node.head:
            cmd += ["--head", f"--port={GCS_PORT}", f"--include-dashboard={str(self.dashboard).lower()}"]
            if self.dashboard:
                cmd += [f"--dashboard-host={node.ip}", f"--dashboard-port={DASHBOARD_PORT}"]
        else:
            cmd += [f"--address={self.gcs_address}"]
        with node.log_path.open("wb") as out:
            node.proc = subprocess.Popen(["ip", "netns", "exec", node.netns, *cmd], cwd=ROOT, env=self.node_env(),
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        log.info("netns_node_starting", node=name, ip=node.ip, netns=node.netns, start=node.starts)

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL every process of the node (all of its namespace: the raylet, its agents, its
        workers and replicas): a machine that lost power. Returns the pids killed."""
        node = self.nodes[name]
        killed = _kill_all(node.netns)
        if node.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(30)
        log.info("netns_node_killed", node=name, pids=len(killed))
        return killed

    def close(self) -> None:
        """Stop every node and remove what start() made (idempotent)."""
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        deadline = time.monotonic() + 30
        for node in self.nodes.values():
            if node.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(max(0.1, deadline - time.monotonic()))
        keep = os.environ.get("MESHRL_NETNS_KEEP_LOGS")  # debugging: keep the nodes' Ray logs
        _remove(bridge=self.bridge, netns=[n.netns for n in self.nodes.values()],
                veths=[n.veth for n in self.nodes.values()], temp_root=None if keep else self.temp_root)
        with contextlib.suppress(FileNotFoundError):
            self._state_file().unlink()
        for key, old in self._saved_env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        self._saved_env.clear()

    # ---- using it -----------------------------------------------------------------------------

    def command(self, name: str, cmd: Sequence[str]) -> list[str]:
        """`cmd` as run inside the node's namespace."""
        return ["ip", "netns", "exec", self.nodes[name].netns, *cmd]

    def run_in(self, name: str, cmd: Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
               check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run a command on a node (in its namespace, with the nodes' environment and RAY_ADDRESS)."""
        full_env = {**self.node_env(), "RAY_ADDRESS": self.gcs_address, **(env or {})}
        return subprocess.run(self.command(name, cmd), cwd=ROOT, env=full_env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def python_in(self, name: str, code: str, *, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return self.run_in(name, [sys.executable, "-c", code], timeout=timeout)

    def alive_nodes(self) -> dict[str, str]:
        """{node ip: node id} of the nodes the GCS reports alive (asked from this namespace)."""
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        client = GcsClient(address=self.gcs_address)
        infos = client.get_all_node_info(timeout=5)
        out = {}
        for node_id, info in infos.items():
            if info.state == 0:  # GcsNodeInfo.ALIVE
                out[info.node_manager_address] = node_id.hex()
        return out

    def wait_for_nodes(self, count: int, timeout_s: float = 300.0, *, without: Sequence[str] = ()) -> dict[str, str]:
        """Until `count` nodes are alive (and none of `without`, by name); returns alive_nodes()."""
        deadline = time.monotonic() + timeout_s
        gone = {self.nodes[n].ip for n in without}
        alive: dict[str, str] = {}
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                if node.proc is not None and node.proc.poll() is not None and node.ip not in gone:
                    raise RuntimeError(f"ray start on node {node.name} exited {node.proc.returncode}:\n"
                                       f"{self.tail(node.name)}")
            try:
                alive = self.alive_nodes()
            except Exception:  # noqa: BLE001 -- the GCS is not up yet: poll again until the deadline
                alive = {}
            if len(alive) >= count and not gone & set(alive):
                return alive
            time.sleep(1.0)
        raise TimeoutError(f"{len(alive)} of {count} nodes alive after {timeout_s:.0f}s "
                           f"(alive: {sorted(alive)}, waiting for {sorted(gone)} to be gone)")

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.nodes[name].log_path
        if path is None or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def logs_dir(self, name: str) -> Path:
        """The node's current Ray logs directory (session_latest/logs of its temp dir)."""
        assert self.temp_root is not None
        return self.temp_root / f"{name}{self.nodes[name].starts}" / "session_latest" / "logs"


def _kill_all(netns: str, rounds: int = 5) -> list[int]:
    """SIGKILL every process in a namespace (repeatedly: a dying parent may still fork)."""
    killed: list[int] = []
    for _ in range(rounds):
        pids = namespace_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
        time.sleep(0.2)
    return killed


def _remove(*, bridge: str, netns: Sequence[str], veths: Sequence[str], temp_root: Path | None) -> None:
    existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    for ns in netns:
        if ns in existing:
            _kill_all(ns)
            _run(["ip", "netns", "del", ns], check=False)
    for dev in [*veths, bridge]:  # a veth goes with its namespace; these are leftovers only
        if _run(["ip", "link", "show", dev], check=False).returncode == 0:
            _run(["ip", "link", "del", dev], check=False)
    if temp_root is not None:
        shutil.rmtree(temp_root, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove clusters whose owner process is gone (a test killed before it could clean up).
    Only what this module made and recorded in STATE_DIR is touched."""
    removed = []
    for path in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []:
        try:
            state: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(state.get("owner_pid", 0))):
            continue
        _remove(bridge=state["bridge"], netns=state["netns"], veths=state["veths"],
                temp_root=Path(state["temp_root"]) if state.get("temp_root") else None)
        path.unlink(missing_ok=True)
        removed.append(path.stem)
    if removed:
        log.info("netns_stale_clusters_removed", clusters=removed)
    return removed


@contextlib.contextmanager
def netns_cluster(names: Sequence[str] = ("a", "b", "c"), **kwargs: Any) -> Iterator[NetnsCluster]:
    cluster = NetnsCluster(names, **kwargs)
    with cluster:
        yield cluster
