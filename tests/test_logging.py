"""Logging: kvrelay and foreign stdlib loggers come out in the same JSON shape."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import warnings
from pathlib import Path

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


def test_python_warnings_are_log_lines_of_the_same_shape() -> None:
    buf = io.StringIO()
    logging.captureWarnings(False)  # (an earlier test's configure left it on, for its stream)
    kvlog.configure(level="INFO", json=True, stream=buf)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("an old API", DeprecationWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
    [line] = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert line["logger"] == "py.warnings" and line["level"] == "warning", line
    assert "DeprecationWarning: an old API" in line["event"], line


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


def _journal_env(f: object) -> dict[str, str]:
    st = os.fstat(f.fileno())  # type: ignore[attr-defined]
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


def test_priority_prefixes_only_on_the_announced_journal_stream(tmp_path: Path) -> None:
    """journald reads `<N>` and stores N as the priority (journalctl -p warning filters on it)."""
    with open(tmp_path / "journal", "w+") as journal, open(tmp_path / "other", "w") as other:
        assert kvlog.writes_to_journal(journal, _journal_env(journal))
        assert not kvlog.writes_to_journal(other, _journal_env(journal))  # inherited variable
        assert not kvlog.writes_to_journal(journal, {"JOURNAL_STREAM": "garbage"})
        assert not kvlog.writes_to_journal(io.StringIO(), _journal_env(journal))

        kvlog.configure(level="DEBUG", json=True, stream=journal, journal=True)
        log = kvlog.get_logger("kvrelay.test")
        log.debug("d_event")
        log.info("i_event")
        log.warning("w_event")
        log.error("e_event")
        log.critical("c_event")
        logging.getLogger("grpclib.server").warning("foreign %s", "w")
        journal.flush()
        journal.seek(0)
        lines = journal.read().splitlines()
    expected = [("<7>", "d_event"), ("<6>", "i_event"), ("<4>", "w_event"), ("<3>", "e_event"),
                ("<2>", "c_event"), ("<4>", "foreign w")]  # fmt: skip
    assert len(lines) == len(expected)
    for line, (prefix, event) in zip(lines, expected, strict=True):
        assert line.startswith(prefix), line
        assert json.loads(line[len(prefix):])["event"] == event


def test_journal_detection_follows_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open(tmp_path / "journal", "w+") as journal:
        monkeypatch.setenv("JOURNAL_STREAM", _journal_env(journal)["JOURNAL_STREAM"])
        kvlog.configure(level="INFO", json=True, stream=journal)  # journal=None: detect
        kvlog.get_logger("kvrelay.test").warning("detected")
        monkeypatch.delenv("JOURNAL_STREAM")
        kvlog.configure(level="INFO", json=True, stream=journal)
        kvlog.get_logger("kvrelay.test").warning("plain")
        journal.flush()
        journal.seek(0)
        first, second = journal.read().splitlines()
    assert first.startswith('<4>{"') and second.startswith('{"')


def test_grpclib_cancelled_requests_go_to_debug() -> None:
    """A router that disconnects mid-stream makes grpclib log "Request was cancelled" at INFO,
    and a call whose deadline ran out "Deadline exceeded" (the installed grpclib's server.py,
    named here): kvrelay shows both at DEBUG only."""
    import inspect

    import grpclib.server

    source = inspect.getsource(grpclib.server)
    assert kvlog.GRPCLIB_CANCELLED in source and grpclib.server.log.name == "grpclib.server"
    assert f"log.info('{kvlog.GRPCLIB_DEADLINE}')" in source
    for msg in ("Request was cancelled: %s", "Deadline exceeded"):
        _demoted(logging.LogRecord("grpclib.server", logging.INFO, __file__, 1, msg,
                                   ("x",) if "%s" in msg else (), None))  # fmt: skip


def _demoted(record: logging.LogRecord) -> None:
    prefix = str(record.msg).split(":")[0]
    for level, shown in (("INFO", False), ("DEBUG", True)):
        buf = io.StringIO()
        kvlog.configure(level=level, json=True, stream=buf)
        try:
            logging.getLogger("grpclib.server").handle(record)
            logging.getLogger("grpclib.server").info("other grpclib news")
        finally:
            kvlog.configure(level="WARNING", stream=sys.stderr)
        lines = [json.loads(x) for x in buf.getvalue().splitlines()]
        cancelled = [x for x in lines if str(x["event"]).startswith(prefix)]
        assert bool(cancelled) is shown, (level, lines)
        if shown:
            assert cancelled[0]["level"] == "debug"
        assert any(x["event"] == "other grpclib news" and x["level"] == "info" for x in lines)
        record.levelno, record.levelname = logging.INFO, "INFO"  # handle() re-levelled it


def test_two_processes_sharing_an_unbuffered_stderr_never_split_a_line(tmp_path: Path) -> None:
    """A hot upgrade's old and new process write to one inherited stderr, unbuffered under the
    shipped units (PYTHONUNBUFFERED=1): every JSON line must reach the file in one piece."""
    import subprocess

    code = (
        "from kvrelay import logging as L\n"
        "L.configure(level='INFO', json=True)\n"
        "log = L.get_logger('kvrelay.test')\n"
        "for i in range(3000):\n"
        "    log.info('line', i=i, pad='x' * 40)\n"
    )
    out = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with out.open("w") as f:
        procs = [
            subprocess.Popen([sys.executable, "-c", code], stderr=f, env=env,
                             cwd=Path(__file__).resolve().parents[1])
            for _ in range(2)
        ]  # fmt: skip
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = out.read_text().splitlines()
    assert len(lines) == 6000
    assert sorted(json.loads(ln)["i"] for ln in lines) == sorted(list(range(3000)) * 2)


def test_a_peers_megabyte_in_a_field_is_cut_to_a_bounded_line() -> None:
    """A field carrying what a peer sent (an engine's adapter names, an error's text, a foreign
    library's message) is cut at ``MAX_FIELD_CHARS``, saying how much was left out; a traceback
    at ``MAX_TRACE_CHARS``. Scalars and short fields are untouched."""
    buf = io.StringIO()
    kvlog.configure(level="INFO", json=True, stream=buf)
    huge = "x" * (1 << 20)
    kvlog.get_logger("kvrelay.test").warning(
        "pool_identity_changed", old=huge, new=("lora-" + huge,), n=7, short="ok"
    )
    logging.getLogger("grpclib.server").warning("peer said %s", huge)
    try:
        raise ValueError(huge)
    except ValueError:
        kvlog.get_logger("kvrelay.test").exception("rpc_failed", error="ValueError")
    text = buf.getvalue()
    assert len(text) < 3 * kvlog.MAX_FIELD_CHARS + kvlog.MAX_TRACE_CHARS + 2_000
    ours, foreign, failed = (json.loads(line) for line in text.splitlines())
    cut = kvlog.MAX_FIELD_CHARS
    assert ours["old"] == "x" * cut + f"…[{len(huge) - cut} more characters]"
    assert ours["new"].startswith("('lora-xxx") and ours["new"].endswith(" more characters]")
    assert (ours["n"], ours["short"]) == (7, "ok")
    assert len(foreign["event"]) < cut + 40 and foreign["event"].startswith("peer said xxx")
    assert len(failed["exception"]) < kvlog.MAX_TRACE_CHARS + 40
    assert failed["exception"].startswith("Traceback")


def test_a_log_throttle_holds_a_bounded_table_of_keys() -> None:
    """One line per key per period, the next saying how many went unlogged; past
    ``MAX_THROTTLE_KEYS`` keys within the period, new keys share one line; once the period is
    over, the oldest keys make room."""
    from kvrelay.logging import MAX_THROTTLE_KEYS, LogThrottle

    t = LogThrottle(period_s=3600.0)
    assert t.due("a") == 0 and t.due("a") is None and t.due("a") is None
    for i in range(MAX_THROTTLE_KEYS - 1):
        assert t.due(f"k{i}") == 0
    assert t.due("new-1") == 0  # the shared key's first line
    assert t.due("new-2") is None  # shares it
    assert len(t._logged_at) == MAX_THROTTLE_KEYS + 1  # the keys and the shared one, no more
    quick = LogThrottle(period_s=0.0)  # every period over at once: old keys make room
    for i in range(MAX_THROTTLE_KEYS + 10):
        assert quick.due(f"k{i}") == 0
    assert len(quick._logged_at) <= MAX_THROTTLE_KEYS


def test_debug_does_not_log_the_http2_stack_s_headers() -> None:
    """At DEBUG, hpack logged every header it encoded or decoded (about 24 lines a gRPC call,
    request headers' values in clear): a line per message, and any credential in a client's
    metadata in the log. The HTTP/2 stack's loggers stay at WARNING; kvrelay's DEBUG lines
    still come."""
    import hpack

    buf = io.StringIO()
    kvlog.configure(level="DEBUG", json=True, stream=buf)
    try:
        encoded = hpack.Encoder().encode([(":method", "POST"), ("authorization", "Bearer s3cr3t")])
        assert hpack.Decoder().decode(encoded)[1] == ("authorization", "Bearer s3cr3t")
        kvlog.get_logger("kvrelay.test").debug("still_here")
    finally:
        kvlog.configure(level="INFO", json=True, stream=io.StringIO())
    text = buf.getvalue()
    assert "s3cr3t" not in text and "hpack" not in text, text[:500]
    assert "still_here" in text
