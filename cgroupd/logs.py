"""Log configuration for the command line: structlog events on stderr.

JSON lines when stderr is not a terminal (containers, CI, log shippers), a readable
console format when it is. Standard-library loggers (nats-py, aiohttp) go through the same
renderer so a JSON stream stays parseable. The member runtime already logs its state
changes ("state", "became active", "stepped down", handler failures); the daemon adds
"joined", "rebalance" and the lifecycle events, and never repeats the runtime's.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")


class _Stderr:
    """Whatever ``sys.stderr`` is at write time (test runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def level_number(level: str) -> int:
    """``"info"`` → ``logging.INFO``; ValueError for an unknown level name."""
    name = level.strip().lower()
    if name == "warn":
        name = "warning"
    if name not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    return int(getattr(logging, name.upper()))


def configure(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger; ``json=None`` decides by TTY."""
    number = level_number(level)
    if json is None:
        json = not sys.stderr.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if json:
        shared.append(structlog.processors.dict_tracebacks)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    root.handlers = [handler]
    # Third-party chatter only from warnings up, unless debugging.
    root.setLevel(number if number <= logging.DEBUG else max(number, logging.WARNING))
