"""docs/operations.md, "Lifecycle, signals and shutdown": the bounds a stop gives its clients are
the code's. The page said a connection was aborted once its client had not let go within 2 s,
while a subscriber that reads nothing, or a call whose request never comes, held the stop for
half of ``shutdown_timeout_s`` first (5 s at the default): that grace was nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import kvrelay
from kvrelay.ops.config import RELAY_KEYS
from kvrelay.ops.daemon import drain_grace_s
from kvrelay.service.h2.closing import CLOSE_WAIT_S
from kvrelay.service.server import REFUSAL_WRITE_S

DOC = Path(kvrelay.__file__).resolve().parent.parent / "docs" / "operations.md"


def _section(title: str) -> str:
    return DOC.read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_stop_grace_the_page_states_is_the_codes() -> None:
    text = _flat(_section("Lifecycle, signals and shutdown"))
    default = RELAY_KEYS["shutdown_timeout_s"].default
    found = re.search(r"for at most its grace: half of `relay\.shutdown_timeout_s`, at least "
                      r"([\d.]+) s \(([\d.]+) s at the default ([\d.]+) s\)", text)  # fmt: skip
    assert found, "the page does not state the stop's grace for clients"
    floor, at_default, said_default = (float(g) for g in found.groups())
    assert said_default == default
    assert drain_grace_s(default) == at_default
    assert drain_grace_s(0.0) == floor and drain_grace_s(2 * floor) == floor
    assert "A subscriber that reads nothing" in text and "never sends its request" in text
    refused = re.search(r"refused \(`UNAVAILABLE` / `PUBLICATION_UNAVAILABLE`, given up to "
                        r"([\d.]+) s more to be written\)", text)  # fmt: skip
    assert refused and float(refused.group(1)) == REFUSAL_WRITE_S
    aborted = re.search(r"aborts one its client has not let go within ([\d.]+) s more", text)
    assert aborted and float(aborted.group(1)) == CLOSE_WAIT_S


def test_the_setting_names_the_grace() -> None:
    row = next(line for line in DOC.read_text().splitlines()
               if line.startswith("| `shutdown_timeout_s` |"))  # fmt: skip
    assert "Half of it (at least 0.1 s) is how long a stop waits for clients" in row, row
