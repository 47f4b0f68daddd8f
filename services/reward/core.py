"""The reward pipeline: route each sample to a scorer, score, shape. No Ray, no gRPC.

    pipeline = RewardPipeline(custom=None, remotes=[], stages=[], pool=BlockingPool(2))
    pipeline.validate(samples)            # InvalidArgument naming items[i].<field>
    scores = await pipeline.score(samples)

Routing, by data_source (first match wins):
1. a remote endpoint that lists the data_source;
2. the custom reward function, if configured (it takes every data_source, as in verl);
3. a built-in scorer (scorers/);
4. the catch-all remote endpoint (empty data_sources);
otherwise the item is rejected with INVALID_ARGUMENT.

Scoring. Built-in regex scorers run inline; a batch custom function (reward_manager: batch) is
called once with all its items, in the pool, with `item_timeout_s` per item as its deadline; blocking scorers (Math-Verify, sync custom functions)
run in the ProcessPool when one is given (a call past its deadline is killed, procpool.py), else
in the BlockingPool (threads; abandoned, pool.py), with `item_timeout_s` each; async custom functions are awaited with the
same deadline; remote routes get their samples in one call (the endpoint client batches, retries
and waits). A scorer result is normalised like verl does: a number, a dict with `score` (its other
numeric entries become metrics), or a sequence whose first element is the score; a per-item
result that is not a dict is also metric `acc`, as in verl's naive/dapo managers. Metric `score`
always holds the scorer's own score, before shaping. A non-finite score, a missing `score` key or
an exception raised by a scorer (a TimeoutError of its own included) is an error (ScorerError),
never a made-up reward; a call past the deadline (ScoreDeadline) scores the scorer's "wrong" with
metric `timeout`=1 (verl's semantics for Math-Verify timeouts: 0, or -1 for DAPO's +1/-1 scorer).

Concurrency: `score_each` may run concurrently for different batches on one event loop; it keeps
no per-call state outside its own frame.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.common.errors import InvalidArgument, MeshError
from services.common.logging import get_logger

from . import scorers
from .custom import CustomFunction
from .pool import BlockingPool, ScoreDeadline
from .procpool import FunctionSpec, ProcessPool
from .samples import RemoteScorer, Sample, Score
from .shaping import OverlongShaping, Stage

log = get_logger(__name__)

T = TypeVar("T")

# Inline scorers yield to the event loop after this many items, so a huge batch of cheap checks
# does not hold up other requests.
_INLINE_CHUNK = 256
_MAX_CACHED_ROUTES = 4096


class ScorerError(MeshError):
    """A scorer failed or returned something that is not a reward. The message names the scorer,
    the item and the data_source."""


@dataclass(frozen=True)
class RemoteRoute:
    """A remote scorer and the data_sources it takes (empty: catch-all)."""

    scorer: RemoteScorer
    data_sources: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _LocalRoute:
    name: str
    fn: Any
    blocking: bool
    is_async: bool = False
    batched: bool = False
    spec: FunctionSpec | None = None
    """Set: a scorer process can run it (ProcessPool), so a timed-out call is killed."""
    timeout_score: float = 0.0
    """An item past item_timeout_s scores this (BuiltinScorer.timeout_score)."""


@dataclass
class _Totals:
    items: int = 0
    timeouts: int = 0
    errors: int = 0
    by_route: Counter[str] = field(default_factory=Counter)


def _to_float(value: Any) -> float | None:
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def normalize(raw: Any, scorer: str, sample: Sample, *, acc_from_number: bool = False) -> Score:
    """A scorer's return value as a Score (verl's conventions; see module docstring). With
    `acc_from_number` (a per-item call, as verl's naive/dapo reward managers make) a result that is
    not a dict also gives metric `acc` = the score; verl's batch manager adds no `acc`."""
    where = f"reward function {scorer} on item {sample.item_id!r} (data_source {sample.data_source!r})"
    metrics: dict[str, float] = {}
    if isinstance(raw, Mapping):
        if "score" not in raw:
            raise ScorerError(f"{where} returned a dict without 'score' (keys {sorted(raw)}); return {{'score': float, ...}}")
        value = _to_float(raw["score"])
        for key, v in raw.items():
            f = _to_float(v)
            if key != "score" and f is not None and math.isfinite(f):
                metrics[str(key)] = f
    elif isinstance(raw, (list, tuple)) and raw:
        value = _to_float(raw[0])
    else:
        value = _to_float(raw)
    if value is None:
        raise ScorerError(f"{where} returned {type(raw).__name__} {raw!r:.80}; return a number or a dict with 'score'")
    if not math.isfinite(value):
        raise ScorerError(f"{where} returned a non-finite score {value}")
    metrics["score"] = value
    if acc_from_number and not isinstance(raw, Mapping):
        metrics["acc"] = value
    return Score(sample.item_id, value, metrics)


class RewardPipeline:
    """Route, score, shape (see module docstring). Build one with factory.build_pipeline."""

    def __init__(
        self,
        *,
        custom: CustomFunction | None = None,
        remotes: Sequence[RemoteRoute] = (),
        stages: Sequence[Stage] = (),
        pool: BlockingPool | None = None,
        process_pool: ProcessPool | None = None,
        item_timeout_s: float = 10.0,
        max_abandoned_threads: int = 16,
    ) -> None:
        self.custom = custom
        self.remotes = list(remotes)
        self.stages = list(stages)
        self.pool = pool or BlockingPool(2)
        self.process_pool = process_pool
        self.item_timeout_s = item_timeout_s
        self.max_abandoned_threads = max_abandoned_threads
        self._by_source: dict[str, RemoteScorer] = {}
        self._catch_all: RemoteScorer | None = None
        for route in self.remotes:
            if not route.data_sources:
                assert self._catch_all is None, "at most one catch-all endpoint (config validation)"
                self._catch_all = route.scorer
            for ds in route.data_sources:
                assert ds not in self._by_source, f"data_source {ds} routed twice (config validation)"
                self._by_source[ds] = route.scorer
        self._custom_route = (
            _LocalRoute(custom.name, custom.fn, blocking=not custom.is_async, is_async=custom.is_async,
                        batched=custom.batched, spec=custom.source)
            if custom
            else None
        )
        self._builtin_routes: dict[str, _LocalRoute] = {}
        self._routes: dict[str, _LocalRoute | RemoteScorer | None] = {}
        self._totals = _Totals()
        self._started = time.time()

    # ---- routing ---------------------------------------------------------------------------------

    def _route(self, data_source: str) -> _LocalRoute | RemoteScorer | None:
        try:
            return self._routes[data_source]
        except KeyError:
            route = self._find_route(data_source)
            # data_sources come from callers: the cache is bounded, and a source nothing scores is
            # not kept (its request is refused: it leaves no trace, nor takes a good source's place)
            if route is not None and len(self._routes) < _MAX_CACHED_ROUTES:
                self._routes[data_source] = route
            return route

    def _find_route(self, data_source: str) -> _LocalRoute | RemoteScorer | None:
        remote = self._by_source.get(data_source)
        if remote is not None:
            return remote
        if self._custom_route is not None:
            return self._custom_route
        spec = scorers.find(data_source)
        if spec is not None:
            route = self._builtin_routes.get(spec.name)
            if route is None:
                route = _LocalRoute(spec.name, scorers.load(spec), blocking=spec.blocking,
                                    spec=FunctionSpec.builtin(spec.module, spec.function) if spec.blocking else None,
                                    timeout_score=spec.timeout_score)
                self._builtin_routes[spec.name] = route
            return route
        return self._catch_all

    def route_name(self, data_source: str) -> str | None:
        """Which scorer takes `data_source` (None: none)."""
        route = self._route(data_source)
        return None if route is None else route.name

    def validate(self, samples: Sequence[Sample], field_prefix: str = "items") -> None:
        """Reject what cannot be scored, naming the field: an unroutable data_source, or (with
        overlong shaping) a missing token count or a cap shorter than the buffer."""
        overlong = [s for s in self.stages if isinstance(s, OverlongShaping)]
        for i, s in enumerate(samples):
            if self._route(s.data_source) is None:
                raise InvalidArgument(
                    f"{field_prefix}[{i}].data_source",
                    f"no scorer for {s.data_source!r} (built-ins: {', '.join(scorers.known_data_sources())}); "
                    "set custom_reward_function.path or add a reward.endpoints entry for it",
                )
            for stage in overlong:
                if s.response and not s.response_token_ids:
                    raise InvalidArgument(
                        f"{field_prefix}[{i}].response_token_ids",
                        "empty for a non-empty response; reward_model.overlong_buffer needs the response length in tokens",
                    )
                if stage.max_length(s) < stage.buffer_len:
                    raise InvalidArgument(
                        f"{field_prefix}[{i}].max_response_length",
                        f"{stage.max_length(s)} is below reward_model.overlong_buffer.len={stage.buffer_len}",
                    )

    # ---- scoring ---------------------------------------------------------------------------------

    async def score(self, samples: Sequence[Sample]) -> list[Score]:
        """One Score per sample, in order. Raises the first error (a MeshError)."""
        outcomes = await self.score_each(samples)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes  # type: ignore[return-value]

    async def score_each(self, samples: Sequence[Sample]) -> list[Score | MeshError]:
        """One outcome per sample, in order: its Score, or the error that kept it from being
        scored (a batch from several requests fails only the requests whose items failed)."""
        outcomes: list[Score | MeshError | None] = [None] * len(samples)
        remote_groups: dict[int, tuple[RemoteScorer | _LocalRoute, list[int]]] = {}
        inline: list[tuple[int, _LocalRoute]] = []
        waits: list[asyncio.Future[None]] = []
        for i, s in enumerate(samples):
            route = self._route(s.data_source)
            if route is None:
                outcomes[i] = InvalidArgument("data_source", f"no scorer for {s.data_source!r} (item {s.item_id!r})")
            elif isinstance(route, _LocalRoute):
                if route.batched:
                    remote_groups.setdefault(id(route), (route, []))[1].append(i)
                elif route.blocking or route.is_async:
                    waits.append(asyncio.ensure_future(self._score_deferred(route, s, i, outcomes)))
                else:
                    inline.append((i, route))
            else:
                remote_groups.setdefault(id(route), (route, []))[1].append(i)
        for scorer, idx in remote_groups.values():
            if isinstance(scorer, _LocalRoute):
                waits.append(asyncio.ensure_future(self._score_batched(scorer, samples, idx, outcomes)))
            else:
                waits.append(asyncio.ensure_future(self._score_remote(scorer, samples, idx, outcomes)))
        for n, (i, route) in enumerate(inline):
            outcomes[i] = self._call_inline(route, samples[i])
            if n % _INLINE_CHUNK == _INLINE_CHUNK - 1:
                await asyncio.sleep(0)
        if waits:
            await asyncio.gather(*waits)
        result: list[Score | MeshError] = []
        for s, outcome in zip(samples, outcomes, strict=True):
            assert outcome is not None
            if isinstance(outcome, Score):
                try:
                    for stage in self.stages:
                        outcome = stage.apply(s, outcome)
                except MeshError as exc:
                    outcome = exc
            if isinstance(outcome, MeshError):
                self._totals.errors += 1
            else:
                self._totals.items += 1
            result.append(outcome)
        return result

    def _call_inline(self, route: _LocalRoute, sample: Sample) -> Score | MeshError:
        self._totals.by_route[route.name] += 1
        try:
            raw = route.fn(
                data_source=sample.data_source, solution_str=sample.response,
                ground_truth=sample.ground_truth, extra_info=dict(sample.extra_info),
            )
            return normalize(raw, route.name, sample, acc_from_number=True)
        except MeshError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 -- a scorer's bug becomes this item's error, with context
            return self._scorer_failed(route, sample, exc)

    async def _score_deferred(
        self, route: _LocalRoute, sample: Sample, i: int, outcomes: list[Score | MeshError | None]
    ) -> None:
        self._totals.by_route[route.name] += 1
        kwargs = {
            "data_source": sample.data_source, "solution_str": sample.response,
            "ground_truth": sample.ground_truth, "extra_info": dict(sample.extra_info),
        }
        try:
            if route.is_async:
                raw = await _within(route.fn(**kwargs), self.item_timeout_s)
            else:
                raw = await self._run_blocking(route, kwargs, self.item_timeout_s)
            outcomes[i] = normalize(raw, route.name, sample, acc_from_number=True)
        except ScoreDeadline:
            self._totals.timeouts += 1
            log.warning(
                "scorer_timeout", scorer=route.name, item_id=sample.item_id, data_source=sample.data_source,
                timeout_s=self.item_timeout_s,
            )
            outcomes[i] = _timed_out(sample, route)
        except MeshError as exc:
            outcomes[i] = exc
        except (Exception, asyncio.CancelledError, SystemExit) as exc:  # a scorer's bug becomes this item's error
            if _cancelled_from_outside(exc):
                raise
            outcomes[i] = self._scorer_failed(route, sample, exc)

    async def _score_batched(
        self, route: _LocalRoute, samples: Sequence[Sample], idx: list[int], outcomes: list[Score | MeshError | None]
    ) -> None:
        self._totals.by_route[route.name] += len(idx)
        batch = [samples[i] for i in idx]
        kwargs = {
            "data_sources": [s.data_source for s in batch], "solution_strs": [s.response for s in batch],
            "ground_truths": [s.ground_truth for s in batch], "extra_infos": [dict(s.extra_info) for s in batch],
        }
        timeout_s = self.item_timeout_s * len(batch)
        try:
            if route.is_async:
                raw = await _within(route.fn(**kwargs), timeout_s)
            else:
                raw = await self._run_blocking(route, kwargs, timeout_s)
            if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(raw) != len(batch):
                got = len(raw) if isinstance(raw, Sequence) else type(raw).__name__
                raise ScorerError(f"batch reward function {route.name} returned {got} results for {len(batch)} items")
        except ScoreDeadline:
            self._totals.timeouts += len(batch)
            log.warning("scorer_timeout", scorer=route.name, items=len(batch), timeout_s=timeout_s)
            for i, s in zip(idx, batch, strict=True):
                outcomes[i] = _timed_out(s, route)
            return
        except (Exception, asyncio.CancelledError, SystemExit) as exc:  # a scorer's bug becomes its items' error
            if _cancelled_from_outside(exc):
                raise
            err = exc if isinstance(exc, MeshError) else self._scorer_failed(route, batch[0], exc)
            for i in idx:
                outcomes[i] = err
            return
        # One bad result fails its own item only: the Serve deployment batches many rollouts' requests.
        for i, s, r in zip(idx, batch, raw, strict=True):
            try:
                outcomes[i] = normalize(r, route.name, s)
            except MeshError as exc:
                outcomes[i] = exc

    async def _run_blocking(self, route: _LocalRoute, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """A blocking scorer call: in a scorer process when it can be (a timed-out call is killed),
        else on a thread (a timed-out call is abandoned, see pool.py)."""
        if self.process_pool is not None and route.spec is not None:
            return await self.process_pool.run(route.spec, kwargs, timeout_s=timeout_s)
        return await self.pool.run(route.fn, kwargs, timeout_s=timeout_s)

    def _scorer_failed(self, route: _LocalRoute, sample: Sample, exc: BaseException) -> ScorerError:
        log.error("scorer_failed", scorer=route.name, item_id=sample.item_id, data_source=sample.data_source, exc_info=exc)
        return ScorerError(
            f"reward function {route.name} raised {type(exc).__name__}: {exc} on item {sample.item_id!r} "
            f"(data_source {sample.data_source!r})"
        )

    async def _score_remote(
        self, scorer: RemoteScorer, samples: Sequence[Sample], idx: list[int], outcomes: list[Score | MeshError | None],
        *, count: bool = True,
    ) -> None:
        if count:
            self._totals.by_route[scorer.name] += len(idx)
        try:
            scores = await scorer.score([samples[i] for i in idx])
        except InvalidArgument as exc:
            if len(idx) > 1:
                # The endpoint refused the call. Its items are several requests' (the deployment
                # batches many rollout replicas' calls), and a replica stops on InvalidArgument:
                # each item alone says whose it was, so only that request fails.
                log.warning("reward_endpoint_refused_a_batch", endpoint=scorer.name, items=len(idx), error=str(exc),
                            hint="scoring its items one at a time to find the one refused")
                await asyncio.gather(*(self._score_remote(scorer, samples, [i], outcomes, count=False) for i in idx))
                return
            outcomes[idx[0]] = exc
            return
        except MeshError as exc:
            for i in idx:
                outcomes[i] = exc
            return
        assert len(scores) == len(idx), f"remote scorer {scorer.name} broke its contract"
        for i, sc in zip(idx, scores, strict=True):
            metrics = dict(sc.metrics)
            metrics.setdefault("score", sc.score)
            outcomes[i] = Score(sc.item_id, sc.score, metrics)

    # ---- state -------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Counters and per-endpoint state (the breaker, items waiting for a down endpoint)."""
        t = self._totals
        return {
            "uptime_s": round(time.time() - self._started, 3),
            "items_scored": t.items,
            "items_failed": t.errors,
            "items_timed_out": t.timeouts,
            "by_route": dict(t.by_route),
            "pool": {
                "num_workers": self.pool.num_workers,
                "calls": self.pool.calls,
                "timeouts": self.pool.timeouts,
                "abandoned_threads": self.pool.abandoned,
                "processes": self.process_pool.num_workers if self.process_pool else 0,
                "process_calls": self.process_pool.calls if self.process_pool else 0,
                "processes_killed": self.process_pool.killed if self.process_pool else 0,
            },
            "custom_function": self.custom.name if self.custom else None,
            "stages": [s.name for s in self.stages],
            "endpoints": [r.scorer.status() for r in self.remotes],
        }

    def unhealthy_reason(self) -> str | None:
        """Why this pipeline should be replaced, or None. Only runaway scorer threads qualify: a
        down endpoint is not the replica's fault (its items wait)."""
        n = self.pool.abandoned
        if n > self.max_abandoned_threads:
            return f"{n} abandoned scorer threads (timed out, or their caller cancelled) are still running (limit reward.max_abandoned_threads={self.max_abandoned_threads})"
        return None

    async def close(self) -> None:
        for r in self.remotes:
            await r.scorer.close()
        self.pool.close()
        if self.process_pool is not None:
            self.process_pool.close()


async def _within(aw: Awaitable[T], timeout_s: float) -> T:
    """`aw` under the pipeline's deadline: ScoreDeadline once it passed. A TimeoutError the scorer
    raised itself stays its own error (the item fails; it is not a timed-out score)."""
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            return await aw
    except TimeoutError:
        if deadline.expired():
            raise ScoreDeadline(f"ran past {timeout_s:g} s") from None
        raise


def _cancelled_from_outside(exc: BaseException) -> bool:
    """A CancelledError because this task was cancelled (the caller left, a drain): propagate it.
    One a scorer raised itself (a client library's), or its SystemExit, is only its item's error."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _timed_out(sample: Sample, route: _LocalRoute) -> Score:
    return Score(sample.item_id, route.timeout_score, {"score": route.timeout_score, "timeout": 1.0})
