"""GatewayAgent: plays a leased prompt group by handing each of its n samples to a black-box
agent that calls the gateway; the worker sees it as its `agent` (the same `play` contract as the
in-process AgentLoop), so leases, renewal, submission and failures are the worker's as for any
group.

    play(prompt, spec):  open n sessions (id + key each)
        per sample:      wait for an agent slot (agent.max_concurrent per replica)
                         start the agent: agent.command with OPENAI_BASE_URL / OPENAI_API_KEY /
                         MESHRL_SESSION_ID and the prompt JSON on stdin (or POST agent.endpoint)
                         the agent calls the gateway …, then POST /finish {reward?}
                         (a command that exits 0 without /finish finishes with no reward)
        all n finished → trajectories (sessions.py) → TrajectoryGroup; samples with no reward are
                         scored by the reward service on their last answer
        a sample falls past max_staleness_versions (a call refused 409, or a finished sample whose
        tokens fell behind before the group completed) → that sample starts over: its agent is
        stopped, a new session (id + key) of the same index gets a new agent, the other samples
        keep their work (the lease stays ours; the worker renews it). At most
        GatewayLimits.max_sample_restarts (3) per sample, then the group fails as below.
        a sample fails (agent exits non-zero, its deadline agent.sample_timeout_s passes, an
        agent that made no call) → every agent of the group is stopped and play raises
        GatewayGroupFailed: the worker returns the lease, the prompt is re-queued (counted),
        never scored as zero.

The agent's environment is the replica's minus every MESHRL_* variable (the mesh's role tokens
never reach agent code).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from meshrl.v1 import common_pb2, reward_pb2
from services.common.errors import MeshError
from services.common.jsonutil import DEFAULT_MAX_DEPTH
from services.common.logging import get_logger
from services.environment import convert as env_convert

from .. import convert
from ..agent.group import build_group
from ..agent.loop import common_prefix
from ..agent.trajectory import Trajectory
from ..engines.base import SamplingSpec
from .sessions import GenerateFn, GroupSession, SampleSession, SessionRegistry

log = get_logger(__name__)

Scorer = Callable[[list[reward_pb2.ScoreItem]], Any]
Launch = Callable[[str, str, dict[str, Any]], Awaitable[None]]
"""An in-process agent: (base_url, api_key, prompt JSON); returning is finishing like an agent
program that exits 0, raising is failing."""


class GatewayGroupFailed(MeshError):
    """A group played through the gateway failed; the worker returns its lease (not a bad input:
    another attempt may succeed)."""

    code = grpc.StatusCode.ABORTED


@dataclass(frozen=True)
class GatewaySettings:
    command: tuple[str, ...] | None
    endpoint: str | None
    sample_timeout_s: float
    max_concurrent: int
    launch: Launch | None = None
    """Used when neither command nor endpoint is set (tests, Python agents in process)."""
    secret_env: frozenset[str] = frozenset()
    """Environment variables agent programs must not inherit (beside every MESHRL_* one and Ray's
    cluster token): the names the config gives the mesh's role tokens and the reward endpoints'."""
    reward_source: str = "environment"
    """What the worker applies: every response's env_reward is its final reward (play sets it:
    the agent's /finish reward, else the reward service's score)."""
    max_json_depth: int = DEFAULT_MAX_DEPTH
    """security.limits.max_json_depth: a prompt's extra_info nests at most this deep."""


_STDERR_TAIL = 800  # bytes of a failed agent's stderr its sample's error carries
RAY_SECRETS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # Ray's cluster token: the whole cluster's keys


def _secret(name: str, extra: frozenset[str]) -> bool:
    return name.startswith("MESHRL_") or name in RAY_SECRETS or name in extra


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    error: str = ""


class GatewayAgent:
    """The worker's agent for `agent.command` / `agent.endpoint` runs. `base_url(session_id)` is
    set once the gateway server listens (server.py)."""

    def __init__(self, tokenizer: Any, registry: SessionRegistry, settings: GatewaySettings,
                 scorer: Scorer | None = None) -> None:
        self.tok = tokenizer
        self.registry = registry
        self.s = settings
        self.scorer = scorer
        self._slots = asyncio.Semaphore(settings.max_concurrent)
        self.base_url: Callable[[str], str] | None = None
        self.start_server: Callable[[], Any] | None = None
        self._starting = asyncio.Lock()
        self.stop_server: Callable[[], Any] | None = None
        self.counters = {"groups": 0, "groups_failed": 0, "agents_started": 0, "agents_failed": 0, "deadlines": 0,
                         "samples_restarted": 0}
        self._tls: Any = None
        """agent.endpoint's TLS context, made once: building one per sample (what a fresh httpx client
        does) costs ~20 ms of replica CPU. A client per sample on it costs ~0.3 ms; one pooled client
        does not do: its pool scans every waiting request on each event, and with hundreds of POSTs
        held open for whole samples that took ~40% of the replica (the tool task at 256 samples)."""

    async def ensure_server(self) -> None:
        """Start the HTTP server once: the first groups of a replica arrive together, and a second
        start would bind a second listener (or, on a fixed port, fail the replica's loop)."""
        if self.base_url is None and self.start_server is not None:
            async with self._starting:
                if self.base_url is None:
                    await self.start_server()

    async def play(
        self,
        prompt: common_pb2.Prompt,
        spec: SamplingSpec,
        rid: str,
        lease_id: str,
        replica_id: str,
        generate: GenerateFn,
        *,
        cancelled: Callable[[], bool],
        version: Callable[[], int],
    ) -> common_pb2.TrajectoryGroup:
        await self.ensure_server()
        assert self.base_url is not None, "the gateway server is not started"
        t0 = time.monotonic()
        # The worker passes its request id as the lease id when no lease is held (the Generate RPC:
        # validation); such a group is not trained on, so the staleness bound does not apply to it.
        g = self.registry.open_group(rid, spec, generate, version, check_staleness=lease_id != rid)
        loop = asyncio.get_running_loop()
        tasks = {s.index: loop.create_task(self._run_sample(s, prompt), name=f"agent-{s.id[:8]}") for s in g.samples}
        retired: list[asyncio.Task[_Outcome]] = []
        restarts: dict[int, int] = {}
        try:
            while True:
                if cancelled():
                    g.fail("the group was cancelled (lease lost or replica draining)")
                    break
                # Per-sample re-queue: a sample past max_staleness_versions (refused with 409 on a
                # call, or finished with tokens that have since fallen behind) starts over in a new
                # session within this lease; its agent is stopped and started again, the others go on.
                for s in list(g.samples):
                    if s.restart is None and s.state == "finished":
                        s.restart = self.registry.stale_reason(s)
                    if s.restart is None:
                        continue
                    restarts[s.index] = restarts.get(s.index, 0) + 1
                    if restarts[s.index] > self.registry.limits.max_sample_restarts:
                        g.fail(f"sample {s.index} started over {self.registry.limits.max_sample_restarts} times and "
                               f"fell behind again: {s.restart}")
                        break
                    tasks[s.index].cancel()
                    retired.append(tasks[s.index])
                    new = self.registry.restart_sample(s)
                    self.counters["samples_restarted"] += 1
                    log.info("gateway_sample_restarted", lease_id=lease_id, sample=s.index, reason=s.restart[:200])
                    tasks[s.index] = loop.create_task(self._run_sample(new, prompt), name=f"agent-{new.id[:8]}")
                if g.failure is not None:
                    break
                for t in tasks.values():
                    if t.done():
                        exc = t.exception()
                        if exc is not None:
                            g.fail(f"starting the agent failed: {exc!r}")
                        elif not t.result().ok:
                            g.fail(t.result().error)
                if g.done:
                    break
                g.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(g.changed.wait(), 0.5)
            if g.failure is None:
                empty = [s for s in g.samples if not s.segments]
                if empty:
                    # an agent that caught a refusal and exited 0 did call: the refusal is the reason
                    refused = next((s for s in empty if s.refused), None)
                    g.fail(f"the agent of sample(s) {[s.index for s in empty]} finished without calling the model"
                           if refused is None else f"the agent of sample(s) {[s.index for s in empty]} finished "
                           f"with no call the model answered; sample {refused.index}'s was refused: {refused.refused}")
        finally:
            for t in [*tasks.values(), *retired]:
                t.cancel()
            await asyncio.gather(*tasks.values(), *retired, return_exceptions=True)
            self.registry.close_group(g)
        # the group's prompt: what its samples' last segments' prompts share
        shared = common_prefix([s.segments[-1].prompt_ids for s in g.samples]) if g.failure is None else 0
        if g.failure is None and not shared:
            # an empty one reached the trainer, which cannot train a sequence without a prompt
            # token, and stopped the run
            g.fail("its samples' prompts share no leading token, so the group has no prompt to train on: start "
                   "every sample's prompt with the same text (a fixed system prompt or instruction; /v1/completions "
                   "prompts are encoded without a BOS token)")
        if g.failure is not None:
            self.counters["groups_failed"] += 1
            raise GatewayGroupFailed(f"gateway group {lease_id}: {g.failure}")
        group = self._build(g, prompt, shared, lease_id, replica_id, version(), time.monotonic() - t0)
        await self._rewards(group, g, spec)
        self.counters["groups"] += 1
        return group

    def _build(self, g: GroupSession, prompt: common_pb2.Prompt, shared: int, lease_id: str, replica_id: str,
               version: int, gen_s: float) -> common_pb2.TrajectoryGroup:
        """The group; `shared`: how many leading tokens its samples' last prompts share (its prompt)."""
        last = [s.segments[-1] for s in g.samples]
        prompt_ids = last[0].prompt_ids[:shared]
        trajectories = []
        for s, seg in zip(g.samples, last, strict=True):
            t = Trajectory(index=s.index)
            t.add_environment(seg.prompt_ids[len(prompt_ids):])
            _append(t, seg.traj)
            t.finish_reason = seg.traj.finish_reason
            t.num_turns = seg.traj.num_turns
            t.tool_calls, t.tool_errors = seg.tool_calls, seg.tool_errors
            t.final_text = seg.last_text
            t.text = str(self.tok.decode(t.token_ids, skip_special_tokens=False))
            t.add_metrics({"gateway_calls": float(s.calls), "gateway_stitch_mismatches": float(s.stitch_mismatches)})
            trajectories.append(t)
        return build_group(lease_id=lease_id, prompt=prompt, prompt_ids=prompt_ids, trajectories=trajectories,
                           replica_id=replica_id, fallback_version=version, generation_s=gen_s)

    async def _rewards(self, group: common_pb2.TrajectoryGroup, g: GroupSession, spec: SamplingSpec) -> None:
        """env_reward of every response = its final reward: the agent's, else the reward service's."""
        if any(s.reward is None for s in g.samples):
            if self.scorer is None:
                raise GatewayGroupFailed(
                    f"gateway group {group.lease_id}: samples finished without a reward and no reward service is "
                    "configured; POST {\"reward\": x} to /finish or configure the reward service"
                )
            text = str(self.tok.decode(list(group.prompt_token_ids), skip_special_tokens=False))
            results = await self.scorer(convert.score_items(group, text, spec.max_tokens))
            convert.apply_scores(group, results)
        for r, s in zip(group.responses, g.samples, strict=True):
            r.env_reward = s.reward if s.reward is not None else r.reward

    # ---- agents -----------------------------------------------------------------------------------

    async def _run_sample(self, s: SampleSession, prompt: common_pb2.Prompt) -> _Outcome:
        assert self.base_url is not None
        async with self._slots:
            if s.state != "open":
                return _Outcome(True)
            url = self.base_url(s.id)
            payload = _prompt_json(prompt, s, self.s.max_json_depth)
            self.counters["agents_started"] += 1
            try:
                if self.s.command is not None:
                    deadline = asyncio.get_running_loop().time() + self.s.sample_timeout_s
                    out = await asyncio.wait_for(self._run_command(s, url, payload, deadline), self.s.sample_timeout_s)
                elif self.s.endpoint is not None:
                    out = await asyncio.wait_for(self._call_endpoint(s, url, payload), self.s.sample_timeout_s)
                else:
                    out = await asyncio.wait_for(self._run_launch(s, url, payload), self.s.sample_timeout_s)
            except TimeoutError:
                self.counters["deadlines"] += 1
                if s.state == "finished":  # it called /finish in time (then lingered): its sample stands
                    return _Outcome(True)
                out = _Outcome(False, f"sample {s.index} passed agent.sample_timeout_s={self.s.sample_timeout_s}; "
                                      "its lease is returned")
            if not out.ok:
                self.counters["agents_failed"] += 1
            return out

    async def _run_command(self, s: SampleSession, url: str, payload: dict[str, Any], deadline: float) -> _Outcome:
        assert self.s.command is not None
        env = {k: v for k, v in os.environ.items() if not _secret(k, self.s.secret_env)}
        env.update(OPENAI_BASE_URL=url, OPENAI_API_KEY=s.key, MESHRL_SESSION_ID=s.id)
        argv = list(self.s.command)
        if argv[0] in ("python", "python3"):  # the replica's own interpreter (its packages, its venv)
            argv[0] = sys.executable
        # Only the tail of its stderr is kept, however much it writes. The pipe is the runner's own
        # (not asyncio's): a process the agent started inherits it, and asyncio would wait for
        # every holder of its pipes before reporting the agent's exit.
        read_fd, write_fd = os.pipe()
        stream = asyncio.StreamReader()
        try:
            pipe, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(read_fd, "rb", 0))
        except BaseException:
            os.close(write_fd)
            raise
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, stderr=write_fd,
                env=env, start_new_session=True,
            )
        except BaseException:
            pipe.close()
            raise
        finally:
            os.close(write_fd)
        tail = bytearray()

        async def keep_tail() -> None:
            while chunk := await stream.read(1 << 16):
                tail.extend(chunk)
                del tail[:-_STDERR_TAIL]

        reader = asyncio.ensure_future(keep_tail())
        rc: int | None = None
        try:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(json.dumps(payload).encode())
                await proc.stdin.drain()
                proc.stdin.close()
            rc = await proc.wait()
        finally:
            # however the agent ended (exit, crash, deadline, cancellation), what it started (tool
            # servers, sandboxes) ends with it: they ran on for the replica's life otherwise
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                await proc.wait()
            if rc is not None and rc != 0:
                # the failure's message is the tail: read what is left. A process that left the
                # group may still hold the pipe, so the tail read within a second will do, and
                # well before the deadline (the exit, not a deadline, is what failed). Only here:
                # an agent that succeeded, or a deadline, waits for no one.
                left = deadline - asyncio.get_running_loop().time()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader, max(0.0, min(1.0, left / 2)))
            reader.cancel()
            pipe.close()
        if rc != 0:
            # it reaches the coordinator's failure messages and logs: never the session's key
            text = tail.decode(errors="replace").strip().replace(s.key, "<the session's key>")
            return _Outcome(False, f"the agent of sample {s.index} exited with {rc}: {text}")
        if s.state == "open":  # exited 0 without /finish: its last answer is scored
            await self.registry.finish(s, None)
        return _Outcome(True)

    async def _run_launch(self, s: SampleSession, url: str, payload: dict[str, Any]) -> _Outcome:
        assert self.s.launch is not None, "GatewaySettings needs command, endpoint or launch"
        try:
            await self.s.launch(url, s.key, payload)
        except Exception as exc:  # noqa: BLE001 - the agent's failure is the sample's, reported with the group
            # as for a command's stderr: the message reaches the coordinator's failures and logs
            return _Outcome(False, f"the agent of sample {s.index} failed: {exc!r}".replace(s.key, "<the session's key>"))
        if s.state == "open":
            await self.registry.finish(s, None)
        return _Outcome(True)

    async def _call_endpoint(self, s: SampleSession, url: str, payload: dict[str, Any]) -> _Outcome:
        import httpx

        assert self.s.endpoint is not None
        body = {"prompt": payload, "base_url": url, "api_key": s.key, "session_id": s.id}
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        async with httpx.AsyncClient(timeout=self.s.sample_timeout_s, verify=self._tls) as client:
            resp = await client.post(self.s.endpoint, json=body)
        if resp.status_code >= 300:
            text = resp.text.replace(s.key, "<the session's key>")[:300]  # an endpoint may echo the body it got
            return _Outcome(False, f"agent.endpoint answered {resp.status_code} for sample {s.index}: {text}")
        # The service runs the agent and finishes the session; wait for that.
        while s.state == "open":
            s.group.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.group.changed.wait(), 1.0)
        return _Outcome(True)

    async def aclose(self) -> None:
        if self.stop_server is not None:
            await self.stop_server()

    def status(self) -> dict[str, Any]:
        return {**self.counters, **self.registry.counters}


def _append(t: Trajectory, src: Trajectory) -> None:
    """Append src's segments (policy / environment runs, by its turn starts) to t."""
    bounds = [*src.turn_starts, len(src)]
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        if src.loss_mask[a]:
            t.add_policy(src.token_ids[a:b], src.logprobs[a:b], src.versions[a:b])
        else:
            t.add_environment(src.token_ids[a:b])


def _prompt_json(prompt: common_pb2.Prompt, s: SampleSession, max_json_depth: int) -> dict[str, Any]:
    p = env_convert.prompt_from_proto(prompt, max_depth=max_json_depth)
    messages: Sequence[Any] = [m.as_dict() for m in p.messages] or [{"role": "user", "content": p.text}]
    return {"prompt_id": p.prompt_id, "data_source": p.data_source, "messages": list(messages), "text": p.text,
            "extra_info": dict(p.extra_info), "sample_index": s.index, "session_id": s.id}
