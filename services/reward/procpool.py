"""Blocking scorers in worker processes, so that one which overruns its deadline is really stopped.

    pool = ProcessPool(num_workers=2)
    raw = await pool.run(FunctionSpec.builtin("services.reward.scorers.math", "compute_score"),
                         {"solution_str": ...}, timeout_s=10.0)       # ScoreDeadline past 10 s

A Python thread cannot be stopped: a Math-Verify call that times out in the thread pool (pool.py)
keeps a core busy until sympy gives up, seconds later. Here each worker is a process (spawned, so
a fresh interpreter, sharing no locks with this one's gRPC and Ray threads) that serves one call at a time. Timeline
of one call:

    take a free worker ─▶ send (spec, kwargs) ─▶ worker loads the function (cached; not timed)
      ─▶ worker says "started" ─▶ `timeout_s` runs ─▶ result | error | deadline: SIGKILL the
      worker (its CPU is free at once); a fresh one is spawned on the next call

Functions are named, not pickled: a built-in by module and function, a custom reward function by
the `custom_reward_function` path, name and kwargs (the worker loads it as the replica did).
Results and errors come back pickled (a number or a dict, as verl's scorers return).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.logging import get_logger

from .pool import ScoreDeadline

log = get_logger(__name__)

LOAD_TIMEOUT_S = 300.0
"""How long a worker may take to import and load a function (sympy, a user's module) before
its call starts; not counted against the call's deadline."""


@dataclass(frozen=True)
class FunctionSpec:
    """Where a worker finds the function: ("builtin", module, function) or ("custom", path, name)
    with the custom function's kwargs and batch flag."""

    kind: str
    target: str
    name: str
    kwargs: tuple[tuple[str, Any], ...] = field(default=())
    batched: bool = False

    @classmethod
    def builtin(cls, module: str, function: str) -> FunctionSpec:
        return cls("builtin", module, function)

    @classmethod
    def custom(cls, path: str, name: str, kwargs: Mapping[str, Any] | None = None, *, batched: bool = False) -> FunctionSpec:
        return cls("custom", path, name, tuple(sorted((kwargs or {}).items())), batched)

    def load(self) -> Any:
        if self.kind == "builtin":
            return getattr(importlib.import_module(self.target), self.name)
        from .custom import load_custom_function

        return load_custom_function(self.target, self.name, dict(self.kwargs), batched=self.batched).fn


class ScorerCrashed(RuntimeError):
    """The worker process died during a call (e.g. the scorer segfaulted or ran out of memory)."""


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
    """A worker: load (cached) -> "started" -> call -> ("ok", result) | ("err", type, message)."""
    cache: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        spec, kwargs = msg
        try:
            key = repr(spec)  # kwargs may hold lists: not hashable
            fn = cache.get(key)
            if fn is None:
                fn = cache[key] = spec.load()
            conn.send(("started",))
            result = fn(**kwargs)
            try:
                conn.send(("ok", result))
            except Exception as exc:  # noqa: BLE001 -- an unpicklable result is the scorer's error
                conn.send(("err", type(exc).__name__, f"its result cannot be sent back: {exc}"))
        except Exception as exc:  # noqa: BLE001 -- the scorer's error, reported to the caller
            conn.send(("err", type(exc).__name__, str(exc)[:2000]))


class _Worker:
    def __init__(self, name: str) -> None:
        self._name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        # The call's thread and the pool's close() both end a worker: one of them closes its pipe,
        # once (a second close of the fd number could close a descriptor opened meanwhile).
        self._lock = threading.Lock()
        self._in_call = False
        self._stopped = False

    def _ensure(self) -> multiprocessing.connection.Connection:
        # A fresh interpreter (`python -m services.reward.procpool FD`), not multiprocessing's spawn:
        # that would re-run the parent's __main__ (a Ray worker's, a test runner's) in the child.
        with self._lock:  # a close() meanwhile sees the new process, or stops this spawn
            if self.proc is None or self.proc.poll() is not None:
                if self.conn is not None:  # the process died (or close() killed it): its pipe goes with it
                    self.conn.close()
                    self.proc = self.conn = None
                if self._stopped:
                    raise ScorerCrashed("the scorer pool was closed")
                mine, theirs = socket.socketpair()
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "services.reward.procpool", str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                )
                theirs.close()
                self.conn = multiprocessing.connection.Connection(mine.detach())
            assert self.conn is not None
            return self.conn

    def call(self, spec: FunctionSpec, kwargs: Mapping[str, Any], timeout_s: float) -> tuple[str, Any]:
        """Blocking (run in a thread): ("ok", result) | ("err", (type, message)) | ("timeout", None)."""
        with self._lock:
            self._in_call = True
        try:
            return self._call(spec, kwargs, timeout_s)
        finally:
            with self._lock:
                self._in_call = False

    def _call(self, spec: FunctionSpec, kwargs: Mapping[str, Any], timeout_s: float) -> tuple[str, Any]:
        conn = self._ensure()
        try:
            conn.send((spec, dict(kwargs)))
            if not conn.poll(LOAD_TIMEOUT_S):
                self.kill()
                return "err", ("TimeoutError", f"loading {spec.target}:{spec.name} took over {LOAD_TIMEOUT_S:g} s")
            started = conn.recv()
            if started[0] != "started":
                return "err", tuple(started[1:])
            if not conn.poll(timeout_s):
                self.kill()
                return "timeout", None
            reply = conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self.kill()
            raise ScorerCrashed(f"the scorer process exited during the call ({type(exc).__name__})") from None
        return ("ok", reply[1]) if reply[0] == "ok" else ("err", tuple(reply[1:]))

    def kill(self) -> None:
        with self._lock:
            proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        """End the worker from outside its call: a call in flight keeps its pipe (its thread reads
        the end of it, then closes it); an idle worker is killed here."""
        with self._lock:
            self._stopped = True
            proc = self.proc if self._in_call else None
        if proc is None:
            self.kill()
        elif proc.poll() is None:
            proc.kill()


def _named_error(type_name: str, message: str) -> Exception:
    """An exception that reads like the worker's (`ValueError: ...`) in the pipeline's errors."""
    cls = type(type_name if type_name.isidentifier() else "ScorerError", (RuntimeError,), {})
    return cls(message)  # type: ignore[no-any-return]


class ProcessPool:
    """See the module docstring. Use from one event loop; `close()` ends the workers."""

    def __init__(self, num_workers: int, *, name: str = "reward-scorer") -> None:
        assert num_workers >= 1
        self.num_workers = num_workers
        self.name = name
        self._workers = [_Worker(f"{name}-{i}") for i in range(num_workers)]
        self._free: asyncio.Queue[_Worker] | None = None
        self._threads = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix=f"{name}-wait")
        self.calls = 0
        self.timeouts = 0
        self.killed = 0
        self.abandoned = 0  # a timed-out call is killed, never left running
        self._closed = False

    def _queue(self) -> asyncio.Queue[_Worker]:
        if self._free is None:
            self._free = asyncio.Queue()
            for w in self._workers:
                self._free.put_nowait(w)
        return self._free

    async def run(self, spec: FunctionSpec, kwargs: Mapping[str, Any], *, timeout_s: float) -> Any:
        """fn(**kwargs) in a worker process. ScoreDeadline when it runs past `timeout_s` (the worker
        is killed); a RuntimeError naming the scorer's exception when it raised."""
        if self._closed:
            raise ScorerCrashed("the scorer pool was closed")
        free = self._queue()
        worker = await free.get()
        self.calls += 1
        call = asyncio.get_running_loop().run_in_executor(self._threads, worker.call, spec, kwargs, timeout_s)
        try:
            status, value = await asyncio.shield(call)
        except asyncio.CancelledError:
            # Its thread still talks to the worker over the pipe: the worker is free again only
            # when that call has ended, or the next call's replies would cross with this one's.
            def release(done: asyncio.Future[tuple[str, Any]]) -> None:
                if not done.cancelled():
                    done.exception()  # retrieved: nobody awaits it any more
                free.put_nowait(worker)

            call.add_done_callback(release)
            raise
        except BaseException:
            free.put_nowait(worker)
            raise
        free.put_nowait(worker)
        if status == "timeout":
            self.timeouts += 1
            self.killed += 1
            log.warning("scorer_process_killed", pool=self.name, function=f"{spec.target}:{spec.name}", timeout_s=timeout_s)
            raise ScoreDeadline(f"{spec.target}:{spec.name} ran past {timeout_s:g} s; its process was killed")
        if status == "err":
            etype, message = value
            raise _named_error(etype, message)
        return value

    def close(self) -> None:
        self._closed = True
        for w in self._workers:
            w.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def pids(self) -> list[int]:
        """PIDs of live workers (tests)."""
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.poll() is None]


if __name__ == "__main__":
    _worker_main(multiprocessing.connection.Connection(int(sys.argv[1])))
