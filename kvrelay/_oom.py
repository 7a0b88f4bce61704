"""Which of the relay's processes the kernel's OOM killer takes first: the disposable ones.

Why: a forked child (a scrub pass, a hot upgrade's cut) maps the relay's pages copy-on-write,
so the kernel counts the whole image against it as much as against the relay, and a fan-out
worker is restarted by its supervisor in a moment while its routers reconnect. The ingest
process holds the exact state every router depends on: under memory pressure it should be the
last to go. A process may raise its own ``oom_score_adj`` without privilege; nothing here lowers it
below what the process was started with (a score an operator or the kubelet set higher stays).
"""

from __future__ import annotations

import os

#: A forked child: its work is retried (a failed scrub pass or upgrade; the relay serves on).
CHILD = 1000
#: A fan-out worker: restarted by the supervisor; its routers reconnect to another worker.
WORKER = 500
#: A hot upgrade's new process until it takes over (the old one serves on if it goes).
SUCCESSOR = 500
_PATH = "/proc/self/oom_score_adj"


def current() -> int | None:
    """This process's ``oom_score_adj`` (None where there is none to read). Only ``os`` calls,
    here and in ``_write``: they run in forked children too."""
    try:
        fd = os.open(_PATH, os.O_RDONLY)
    except OSError:  # not Linux, or /proc not mounted
        return None
    try:
        return int(os.read(fd, 32).strip() or b"0")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _write(score: int) -> bool:
    try:
        fd = os.open(_PATH, os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, str(score).encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def restore(score: int | None) -> bool:
    """Put back a score :func:`current` read before :func:`prefer_killing` raised it (allowed
    without privilege down to what the process was started with)."""
    return score is not None and _write(score)


def prefer_killing(score: int) -> bool:
    """Raise this process's ``oom_score_adj`` to ``score`` (never lower it); whether it is at
    least ``score`` now."""
    now = current()
    if now is None:
        return False
    return now >= score or _write(score)
