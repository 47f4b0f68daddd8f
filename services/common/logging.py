"""structlog setup: JSON lines in services, a readable console on a terminal.

Call `configure_logging(service=...)` once per process (a Serve replica's `__init__`, a Ray actor,
the CLI). Context that holds for the whole process (run, service, replica, rank) is bound once
with `bind(...)`; per-request context uses `structlog.contextvars.bound_contextvars`. The same
chain formats stdlib records (grpc, ray, transformers) so every line has one shape.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured: dict[str, Any] = {}

# Tracebacks without the frames' local variables: a handler's locals hold whole requests
# (megabytes, and what their senders would not want in a log file).
_DICT_TRACEBACKS = structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))


def _shared_processors() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def configure_logging(
    service: str | None = None,
    *,
    json: bool | None = None,
    level: str | int | None = None,
    stream: Any = None,
    **context: Any,
) -> None:
    """Configure structlog + stdlib logging for this process.

    json: None picks JSON unless stderr is a terminal (env MESHRL_LOG_FORMAT=json|console wins).
    level: default from MESHRL_LOG_LEVEL, else INFO.
    context: bound on every line of this process (e.g. run_id=..., replica=...).
    """
    fmt = os.environ.get("MESHRL_LOG_FORMAT")
    if json is None:
        json = fmt == "json" if fmt else not sys.stderr.isatty()
    level = level or os.environ.get("MESHRL_LOG_LEVEL", "INFO")
    renderer: Any
    if json:
        renderer = structlog.processors.JSONRenderer()
        extra = [_DICT_TRACEBACKS]
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False)
        )
        extra = []
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_shared_processors(),
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *extra, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_meshrl", False):
            root.removeHandler(old)
    handler._meshrl = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    log_dir = os.environ.get("MESHRL_LOG_DIR")
    if log_dir:
        # A run directory's structured logs: one JSON-lines file per service process.
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, f"{service or 'meshrl'}.{os.getpid()}.jsonl")
        file_handler = logging.FileHandler(path)
        file_handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=_shared_processors(),
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    _DICT_TRACEBACKS,
                    structlog.processors.JSONRenderer(),
                ],
            )
        )
        file_handler._meshrl = True  # type: ignore[attr-defined]
        root.addHandler(file_handler)
    root.setLevel(level)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_shared_processors(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if service is not None:
        context["service"] = service
    bind(**context)
    _configured.update(service=service, json=json)


def bind(**context: Any) -> None:
    """Bind process-wide context (run_id, service, replica, rank, policy_version ...)."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
