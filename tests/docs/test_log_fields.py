"""The fields and level of each log event in docs/operations.md ("Log events") are those the code
logs it with. tests/test_log_events.py holds the event names to the table; this holds the rest of
each row: operators filter on a field (`why`, `plane`, `rule`, `during`) only if they know it is
there, and on a level only if it is the one the line carries.

Fields are the keyword arguments of each literal log call; those a logger was bound with
(`pool`, `engine`, `dp_rank` of a source) are not checked here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvrelay

ROOT = Path(kvrelay.__file__).resolve().parent
DOC = ROOT.parent / "docs" / "operations.md"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
LOGGERS = {"log", "_log", "LOG", "_LOG"}


def code_calls() -> dict[str, list[tuple[str, set[str], str]]]:
    """event → (level, keyword fields, where) for every literal log call in kvrelay/."""
    out: dict[str, list[tuple[str, set[str], str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in LEVELS:
                continue
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name not in LOGGERS or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            level = "error" if node.func.attr == "exception" else node.func.attr
            fields = {k.arg for k in node.keywords if k.arg and k.arg != "exc_info"}
            where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
            out.setdefault(first.value, []).append((level, fields, where))
    return out


def doc_rows() -> dict[str, tuple[str, set[str]]]:
    """event → (level cell, fields named in the fields cell) from the one event table."""
    section = DOC.read_text().split("### Log events", 1)[1].split("\n## ", 1)[0]
    out: dict[str, tuple[str, set[str]]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) < 4:
            continue
        fields = set(re.findall(r"`([^`]+)`", cells[2]))
        for event in re.findall(r"`([^`]+)`", cells[0]):
            out[event] = (cells[1], fields)
    return out


def test_scanner_sees_keyword_fields() -> None:
    calls = code_calls()
    assert any("exit_code" in f for _, f, _ in calls["relay_stopped"])
    assert doc_rows()["member_reset"][1] >= {"pool", "engine", "dp_rank", "reason"}


def test_every_logged_field_is_documented() -> None:
    rows = doc_rows()
    missing = [
        f"{event}: {sorted(fields - rows[event][1])} ({where})"
        for event, calls in code_calls().items() if event in rows
        for _, fields, where in calls if fields - rows[event][1]
    ]  # fmt: skip
    assert not missing, f"fields not in docs/operations.md's event table: {missing}"


def test_every_logged_level_is_documented() -> None:
    rows = doc_rows()
    wrong = [
        f"{event}: logged at {level}, documented {rows[event][0]!r} ({where})"
        for event, calls in code_calls().items() if event in rows
        for level, _, where in calls if level not in rows[event][0]
    ]  # fmt: skip
    assert not wrong, wrong
