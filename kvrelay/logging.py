"""Logging setup: structlog JSON for machines, a console renderer for people.

kvrelay's own loggers use native structlog (cheapest path); the root stdlib handler uses a
``ProcessorFormatter`` so grpclib, asyncio and numba records come out in the same shape.
Never log per message: hot paths count, they do not log.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_SHARED: list[structlog.types.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def _renderer(json: bool) -> structlog.types.Processor:
    if json:
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=False)


def configure(
    *, level: str | int = "INFO", json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog and the stdlib root logger.

    ``json=None`` picks JSON unless ``stream`` is a TTY (production under systemd gets JSON,
    an operator at a terminal gets readable lines).
    """
    global _generation
    _generation += 1
    stream = stream if stream is not None else sys.stderr
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")

    structlog.configure(
        processors=[
            *_SHARED,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _renderer(json),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _renderer(json),
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # numba's own debug chatter is not operator information.
    logging.getLogger("numba").setLevel(max(numeric, logging.WARNING))


_generation = 0  # bumped by configure(): bound loggers made before it are rebuilt


class _NamedLogger:
    """A logger bound with ``logger=name`` that follows later ``configure()`` calls.

    Module-level loggers are created at import, before the daemon configures logging; binding
    eagerly would freeze structlog's default processors into them.
    """

    __slots__ = ("_bound", "_gen", "_initial", "_name")

    def __init__(self, name: str, initial: dict[str, Any]) -> None:
        self._name = name
        self._initial = initial
        self._bound: Any = None
        self._gen = -1

    def _logger(self) -> Any:
        if self._gen != _generation:
            self._bound = structlog.get_logger(self._name).bind(logger=self._name, **self._initial)
            self._gen = _generation
        return self._bound

    def bind(self, **values: Any) -> Any:
        return self._logger().bind(**values)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._logger(), attr)


def get_logger(name: str, **initial: Any) -> Any:
    """A structlog logger bound with ``logger=name``."""
    return _NamedLogger(name, initial)
