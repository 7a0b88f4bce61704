"""Logging setup: structlog JSON for machines, a console renderer for people.

kvrelay's own loggers use native structlog (cheapest path); the root stdlib handler uses a
``ProcessorFormatter`` so grpclib, asyncio and numba records come out in the same shape.
Never log per message: hot paths count, they do not log. Event names are snake_case and listed
in docs/operations.md (a test holds every ``_log.<level>("name"`` call to that list).

Under journald (``JOURNAL_STREAM`` names the stream being written) each line starts with the
syslog priority ``<N>``, which journald strips and stores, so ``journalctl -p warning`` works.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import structlog

_SHARED: list[structlog.types.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


#: structlog level name → syslog priority (sd-daemon(3) prefixes).
SYSLOG_PRIORITY = {
    "debug": 7, "info": 6, "notice": 5, "warning": 4, "warn": 4, "error": 3, "exception": 3,
    "critical": 2,
}


#: The most characters a log line's field carries (an exception's traceback: ``MAX_TRACE_CHARS``);
#: past it the value is cut, ending ``…[N more characters]``. Fields can carry what a peer sent
#: (an engine's model or adapter names in ``pool_identity_changed``, an error's text): a 1 MiB
#: name echoed into a line at each change would fill the disk.
MAX_FIELD_CHARS = 4096
MAX_TRACE_CHARS = 65536
_SCALARS = (bool, int, float, type(None))


def _clip(value: str, limit: int) -> str:
    return f"{value[:limit]}…[{len(value) - limit} more characters]"


def bound_fields(_logger: Any, _method: str, event_dict: Any) -> Any:
    """A processor: every field's text at most ``MAX_FIELD_CHARS`` (bytes, a list, a dict: its
    ``repr``, when that is longer), the ``exception`` at most ``MAX_TRACE_CHARS``."""
    for key, value in event_dict.items():
        if isinstance(value, _SCALARS):
            continue
        limit = MAX_TRACE_CHARS if key == "exception" else MAX_FIELD_CHARS
        if isinstance(value, str):
            if len(value) > limit:
                event_dict[key] = _clip(value, limit)
        elif isinstance(value, (bytes, bytearray, list, tuple, dict, set, frozenset)):
            text = repr(value)
            if len(text) > limit:
                event_dict[key] = _clip(text, limit)
    return event_dict


def _renderer(json: bool) -> structlog.types.Processor:
    if json:
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=False)


def writes_to_journal(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """True when ``stream`` is the journal stream systemd announced in ``JOURNAL_STREAM``
    (``device:inode``); an inherited variable with another stream does not count."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep or not (dev.isascii() and dev.isdigit() and ino.isascii() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class _PriorityPrefix:
    """Wraps the final renderer: ``<N>`` + the rendered line (N from the record's level)."""

    def __init__(self, renderer: structlog.types.Processor) -> None:
        self._renderer = renderer

    def __call__(self, logger: Any, method: str, event_dict: Any) -> Any:
        level = str(event_dict.get("level", method)).lower()
        prefix = f"<{SYSLOG_PRIORITY.get(level, 6)}>"
        line = self._renderer(logger, method, event_dict)
        if isinstance(line, bytes):
            return prefix.encode() + line
        return prefix + str(line)


def configure(
    *,
    level: str | int = "INFO",
    json: bool | None = None,
    stream: TextIO | None = None,
    journal: bool | None = None,
) -> None:
    """Configure structlog and the stdlib root logger.

    ``json=None`` picks JSON unless ``stream`` is a TTY (production under systemd gets JSON,
    an operator at a terminal gets readable lines). ``journal=None`` adds ``<N>`` priority
    prefixes when ``stream`` is systemd's journal stream.
    """
    global _generation
    _generation += 1
    stream = stream if stream is not None else sys.stderr
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    if journal is None:
        journal = writes_to_journal(stream)

    def renderer() -> structlog.types.Processor:
        r = _renderer(json)
        return _PriorityPrefix(r) if journal else r

    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")

    structlog.configure(
        processors=[
            *_SHARED,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            bound_fields,
            renderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write per line (print() writes the line and its newline apart): a hot upgrade's
        # two processes share one stderr, and unbuffered (PYTHONUNBUFFERED=1, as the units set)
        # their lines would otherwise interleave mid-line
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            bound_fields,
            renderer(),
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # Python's warnings (a library's deprecation, a ResourceWarning) as log lines of this shape
    # (logger ``py.warnings``), not raw text among the JSON lines a log shipper parses
    logging.captureWarnings(True)
    # numba's own debug chatter is not operator information, nor the HTTP/2 stack's: at DEBUG
    # hpack logs every header it encodes or decodes (about 24 lines a call, each request
    # header's value in clear, credentials in metadata included)
    for chatty in CHATTY_LOGGERS:
        logging.getLogger(chatty).setLevel(max(numeric, logging.WARNING))
    grpclib_server = logging.getLogger(GRPCLIB_SERVER_LOGGER)
    for f in [f for f in grpclib_server.filters if isinstance(f, DemoteCancelled)]:
        grpclib_server.removeFilter(f)
    grpclib_server.addFilter(DemoteCancelled(numeric))


#: Third-party loggers kept at WARNING or above whatever the level (see ``configure``).
CHATTY_LOGGERS = ("numba", "hpack", "h2")

#: grpclib's server logs every client that goes away mid-stream, and every call whose deadline
#: ran out, at INFO, under this logger and with these message prefixes (grpclib 0.4's
#: ``server.py``; ``tests/test_logging.py`` checks them against the installed grpclib). A router
#: disconnecting, or a client's own deadline, is routine (a line per call): it goes to DEBUG.
GRPCLIB_SERVER_LOGGER = "grpclib.server"
GRPCLIB_CANCELLED = "Request was cancelled"
GRPCLIB_DEADLINE = "Deadline exceeded"


class DemoteCancelled(logging.Filter):
    """Re-levels grpclib's "Request was cancelled" and "Deadline exceeded" records to DEBUG
    (dropped below it)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        routine = str(record.msg).startswith((GRPCLIB_CANCELLED, GRPCLIB_DEADLINE))
        if routine and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return self.level <= logging.DEBUG
        return True


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


#: How often (seconds) a throttled event is logged per key on the paths input reaches (a
#: malformed engine message, a refused peer): at most one line per key per period.
INPUT_LOG_S = 10.0


#: Keys one ``LogThrottle`` tracks at most; past it, the keys logged longest ago are dropped
#: (their unlogged counts with them) once their period is over, else new keys share one.
MAX_THROTTLE_KEYS = 4096
_SHARED_KEY = "(others)"


class LogThrottle:
    """For an event that input (or a cause that lasts) can repeat at any rate: one line per key
    per ``period_s``, the next one saying how many went unlogged meanwhile. The caller logs (under
    its literal event name) and counts every occurrence itself. Keys come from bounded sets
    (reasons, event names, configured or admitted members), never raw input; the table holds
    at most ``MAX_THROTTLE_KEYS`` of them."""

    __slots__ = ("_logged_at", "_not_logged", "_period_s")

    def __init__(self, period_s: float = INPUT_LOG_S) -> None:
        self._period_s = period_s
        self._logged_at: dict[str, float] = {}
        self._not_logged: dict[str, int] = {}

    def period_s(self) -> float:
        return self._period_s

    def due(self, key: str) -> int | None:
        """The occurrences of ``key`` not logged since its last line, if one is due now; None
        (this one noted as not logged) while ``key`` was logged within the period."""
        now = time.monotonic()
        if key not in self._logged_at and len(self._logged_at) >= MAX_THROTTLE_KEYS:
            key = self._room(now, key)
        last = self._logged_at.get(key)
        if last is not None and now - last < self.period_s():
            self._not_logged[key] = self._not_logged.get(key, 0) + 1
            return None
        self._logged_at.pop(key, None)  # (re)inserted last: the table stays in logging order
        self._logged_at[key] = now
        return self._not_logged.pop(key, 0)

    def _room(self, now: float, key: str) -> str:
        """``key`` once the table has room for it (keys whose period is over dropped, oldest
        first), else the one shared key."""
        for old, at in list(self._logged_at.items()):
            if now - at < self.period_s() or len(self._logged_at) < MAX_THROTTLE_KEYS:
                break
            del self._logged_at[old]
            self._not_logged.pop(old, None)
        return key if len(self._logged_at) < MAX_THROTTLE_KEYS else _SHARED_KEY
