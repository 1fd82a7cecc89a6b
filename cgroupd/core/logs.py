"""Logging: quiet library loggers, and the command line's structlog configuration.

As a library, cgroupd logs like any Python library: through standard-library loggers
named ``cgroupd.<module>``, so the application's logging configuration decides what is
shown. An application that configured nothing sees only warnings and errors (Python's
last-resort handler, on stderr) and nothing of routine events; one that configured
structlog gets cgroupd's events through its structlog configuration instead.

The ``cgroupd`` command configures structlog: JSON lines when stderr is not a terminal
(containers, CI, log shippers), a readable console format when it is. Standard-library
loggers (nats-py, aiohttp) go through the same renderer so a JSON stream stays parseable.
The member runtime already logs its state changes ("state", "became active", "stepped
down", handler failures); the daemon adds "joined", "rebalance" and the lifecycle events,
and never repeats the runtime's.

structlog imports rich (with pygments, ~4 MB resident: a tenth of an idle instance) at
import time, only to draw console tracebacks. This module loads structlog without it; the
console renderer (a terminal) imports rich when it first draws a traceback. A process
that imported structlog or rich before cgroupd keeps what it loaded.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

from cgroupd.core.lazyimport import import_without
from cgroupd.core.redact import redact_text

import_without("structlog", "rich")

import structlog  # noqa: E402 - after the lean load above

LEVELS = ("debug", "info", "warning", "error", "critical")


def get_logger(name: str) -> Any:
    """A structlog-style logger (``log.info("event", key=value)``) for module ``name``.

    Decided at each call, also for loggers made by ``bind()``: the application's structlog
    chain when structlog was configured (the ``cgroupd`` command,
    ``structlog.testing.capture_logs``), otherwise the standard-library logger ``name``,
    silent below WARNING unless the application's logging configuration says otherwise.
    """
    return _LibraryLogger(name, {})


class _LibraryLogger:
    """Lazy proxy that picks structlog's global chain or the stdlib logger per call."""

    def __init__(self, name: str, context: dict[str, Any]) -> None:
        self._name = name
        self._context = context
        self._stdlib: Any = None
        self._configured: tuple[Any, Any] = (None, None)  # (processors, bound logger)

    def _target(self) -> Any:
        if structlog.is_configured():
            processors = structlog.get_config()["processors"]
            if self._configured[0] is not processors:  # (re)configured since last call
                bound = structlog.get_logger(self._name).bind(**self._context)
                self._configured = (processors, bound)
            return self._configured[1]
        if self._stdlib is None:
            self._stdlib = structlog.wrap_logger(
                logging.getLogger(self._name), processors=_STDLIB_CHAIN,
                wrapper_class=structlog.stdlib.BoundLogger).bind(**self._context)
        return self._stdlib

    def bind(self, **values: Any) -> _LibraryLogger:
        return _LibraryLogger(self._name, {**self._context, **values})

    def __getattr__(self, method: str) -> Any:
        return getattr(self._target(), method)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        return repr(value)
    return repr(value) if not value or any(c.isspace() or c in "='\"" for c in value) \
        else value


def _to_stdlib(_logger: Any, _method: str, event: dict[str, Any]) -> Any:
    """Last processor of the stdlib chain: ``event key=value ...`` as the message (what a
    plain formatter shows), the fields as ``record.cgroupd`` (for structured formatters)."""
    fields = dict(event)
    exc_info = fields.pop("exc_info", None)
    stack_info = bool(fields.pop("stack_info", False))
    message = str(fields.pop("event", ""))
    line = " ".join([message, *(f"{key}={_text(value)}" for key, value in fields.items())])
    return (line,), {"exc_info": exc_info, "stack_info": stack_info,
                     "extra": {"cgroupd": {"event": message, **fields}}}


def redact_secrets(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """Hide the userinfo of every URL in a log line's text fields (``server``, ``url``,
    ``error``, the event itself): the last guard, whatever a caller passed in."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redact_text(value)
        elif isinstance(value, BaseException) and key != "exc_info":
            event[key] = redact_text(str(value))
    return event


_STDLIB_CHAIN: list[Any] = [
    structlog.stdlib.filter_by_level,  # first: a filtered-out debug line costs nothing more
    structlog.contextvars.merge_contextvars,
    redact_secrets,
    _to_stdlib,
]


class _ConsoleTraceback:
    """structlog's rich traceback for the console renderer, importing rich on first use
    (the plain traceback where rich is not installed)."""

    def __init__(self, colors: bool) -> None:
        self.colors = colors

    def __call__(self, sio: TextIO, exc_info: Any) -> None:
        try:
            from rich.console import Console
            from rich.traceback import Traceback
        except ImportError:
            structlog.dev.plain_traceback(sio, exc_info)
            return
        sio.write("\n")
        Console(file=sio, color_system="truecolor" if self.colors else None).print(
            Traceback.from_exception(*exc_info, show_locals=True))


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
        redact_secrets,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if json:
        shared.append(structlog.processors.dict_tracebacks)
        renderer = structlog.processors.JSONRenderer()
    else:
        colors = sys.stderr.isatty()
        renderer = structlog.dev.ConsoleRenderer(
            colors=colors, exception_formatter=_ConsoleTraceback(colors))
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
