"""Every log event kvrelay emits is a snake_case name listed in docs/operations.md, and every name
listed there is still emitted: the event scheme cannot drift as events are added.

Events are read from the source: each ``log.<level>(`` / ``_log.<level>(`` / ``_LOG.<level>(`` /
``self._log.<level>(`` call must start with a string literal, the event name.
"""

from __future__ import annotations

import re
from pathlib import Path

import kvrelay

ROOT = Path(kvrelay.__file__).resolve().parent
DOC = ROOT.parent / "docs" / "operations.md"

CALL = re.compile(
    r"\b(?:self\.)?_?(?:log|LOG)\.(?:debug|info|warning|error|exception|critical)\(\s*"
    r"(?P<name>\"[^\"\n]*\"|'[^'\n]*')?"
)
SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
DOC_ROW = re.compile(r"^\| `([a-z0-9_]+)`(?:, `([a-z0-9_]+)`)* \|", re.M)


def code_events() -> dict[str, list[str]]:
    """event name → where it is emitted; a call without a literal name is reported as `?`."""
    out: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        text = path.read_text()
        for m in CALL.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            name = m.group("name")
            key = name[1:-1] if name else "?"
            out.setdefault(key, []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return out


def doc_events() -> set[str]:
    section = DOC.read_text().split("### Log events", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in re.findall(r"^\| (`[^|]*`) \|", section, flags=re.M):
        names |= set(re.findall(r"`([^`]+)`", row))
    return names


def test_scanner_is_not_vacuous() -> None:
    events = code_events()
    for known in ("relay_serving", "member_reset", "topic_mismatch", "subscriber_state"):
        assert known in events, known
    assert CALL.search('_log.info(\n    "x_y", a=1)').group("name") == '"x_y"'  # type: ignore[union-attr]
    assert CALL.search("self._log.warning(msg)").group("name") is None  # type: ignore[union-attr]


def test_every_event_is_a_snake_case_literal() -> None:
    events = code_events()
    assert "?" not in events, f"log calls without a literal event name: {events.get('?')}"
    bad = {name: where for name, where in events.items() if not SNAKE.fullmatch(name)}
    assert not bad, f"event names must be snake_case: {bad}"


def test_every_event_is_documented_and_every_documented_event_exists() -> None:
    events, documented = set(code_events()), doc_events()
    assert not events - documented, (
        f"add these to docs/operations.md, 'Log events': {sorted(events - documented)}"
    )
    assert not documented - events, (
        f"documented but never emitted: {sorted(documented - events)}"
    )


def test_operations_md_has_one_event_table() -> None:
    """A second, hand-kept event table elsewhere in the page drifts (one did): only one."""
    text = DOC.read_text()
    assert text.count("| Event | Level | Fields") == 1

