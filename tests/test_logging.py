"""Logging: kvrelay and foreign stdlib loggers come out in the same JSON shape."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvrelay import logging as kvlog


@pytest.fixture(autouse=True)
def _restore_root() -> object:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_shape_is_shared_by_structlog_and_stdlib() -> None:
    buf = io.StringIO()
    kvlog.configure(level="INFO", json=True, stream=buf)
    kvlog.get_logger("kvrelay.test").info("member_cleared", member="w1:0", reason="gap")
    logging.getLogger("grpclib.server").warning("connection lost %s", "peer")
    logging.getLogger("grpclib.server").debug("not shown")
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert len(lines) == 2
    ours, foreign = lines
    assert ours["event"] == "member_cleared" and ours["member"] == "w1:0"
    assert ours["level"] == "info" and ours["logger"] == "kvrelay.test"
    assert foreign["event"] == "connection lost peer"
    assert foreign["level"] == "warning" and foreign["logger"] == "grpclib.server"
    assert {"timestamp", "level", "event"} <= set(ours) & set(foreign)


def test_console_renderer_when_not_json() -> None:
    buf = io.StringIO()
    kvlog.configure(level="DEBUG", json=False, stream=buf)
    kvlog.get_logger("kvrelay.test").debug("hello", x=1)
    text = buf.getvalue()
    assert "hello" in text and "x=1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_bad_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        kvlog.configure(level="LOUD", stream=io.StringIO())


def test_module_level_logger_follows_later_configuration() -> None:
    early = kvlog.get_logger("kvrelay.early")  # as at import time, before configure()
    buf = io.StringIO()
    kvlog.configure(level="INFO", json=True, stream=buf)
    early.warning("after_configure", n=2)
    (line,) = buf.getvalue().splitlines()
    record = json.loads(line)
    assert record["event"] == "after_configure" and record["logger"] == "kvrelay.early"
