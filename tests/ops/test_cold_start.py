"""A first start with an empty kernel cache, then a start with the cache it filled.

``kvrelay serve`` runs as a subprocess with its own ``NUMBA_CACHE_DIR`` and a test-owned
NOTIFY_SOCKET, so this compiles every kernel for real (10-40 s on 2 shared cores): what systemd
hears (STATUS per step, EXTEND_TIMEOUT_USEC while compiling, READY once) and what the log says.
How long it takes is measured in benchmarks/bench_start.py, not here.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kvrelay import _jit
from kvrelay.ops.warmup import LOCAL_STEP
from kvrelay.ops.warmup import _import as import_step
from tests.ops.test_daemon import Notifications
from tests.support.commands import REPO, clean_env, static_config
from tests.support.timing import scaled

STEPS = ("hashing", "ingest", "pool")


async def _start(tmp: Path, cache: Path, name: str) -> tuple[list[str], list[dict[str, Any]]]:
    """One start to READY and a clean SIGTERM; the notifications and the JSON log lines."""
    notes = Notifications(tmp / f"{name}.sock")
    env = clean_env(NOTIFY_SOCKET=str(tmp / f"{name}.sock"), NUMBA_CACHE_DIR=str(cache))
    cfg = static_config(tmp / f"{name}.toml", "dc-cold")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg),
        env=env, cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await notes.wait_for("READY=1", timeout=400)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), scaled(30))
        assert proc.returncode == 0, err.decode()[-2000:]
        return notes.messages, [json.loads(x) for x in err.decode().splitlines() if x]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()


def _before_ready(messages: list[str]) -> list[str]:
    i = next(i for i, m in enumerate(messages) if m.startswith("READY=1"))
    assert sum(m.startswith("READY=1") for m in messages) == 1
    return messages[:i]


def _done(log: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per step, its last ``done`` report in the daemon itself (not one relayed from a worker)."""
    return {e["group"]: e for e in log if e.get("event") == "kernels_progress"
            and e["state"] == "done" and "worker" not in e}


def _compiled(log: list[dict[str, Any]], step: str) -> int:
    """Kernels of ``step`` compiled anywhere: in the daemon or in a worker it started."""
    return sum(e["compiled"] for e in log if e.get("event") == "kernels_progress"
               and e["state"] == "done" and e["group"] == step)


async def test_first_start_compiles_with_progress_and_the_next_loads(tmp_path: Path) -> None:
    for step in STEPS:  # every step's modules, so that its declared kernels are listed
        import_step(step)  # (nothing compiled here: ``make test`` runs this test first)
    # steps with declared kernels that a first start reports cold (the daemon's own step, whose
    # few declared kernels it compiles before starting workers, reports "loading ... or compiling")
    declared = [g for g in STEPS if list(_jit.kernels(g)) and g != LOCAL_STEP]
    assert declared[:2] == ["hashing", "ingest"]
    cache = tmp_path / "numba"
    messages, log = await _start(tmp_path, cache, "cold")
    early = _before_ready(messages)
    for step in declared:  # e.g. "STATUS=warming up numba kernels (3 s): ...; ingest: compiling"
        assert any(m.startswith("STATUS=warming up numba kernels (") and f"{step}: compiling" in m
                   for m in early), early
    # A first start takes longer than one 5 s tick, so systemd heard it is still making progress.
    assert "EXTEND_TIMEOUT_USEC=30000000" in early, early
    assert next(e for e in log if e.get("event") == "kernel_cache")["dir"] == str(cache)
    assert set(_done(log)) == set(STEPS)
    for step in declared:
        assert _compiled(log, step) > 0, step
    workers = {e["group"] for e in log
               if e.get("event") == "kernels_progress" and e["state"] == "worker"}
    if len(os.sched_getaffinity(0)) >= 2:  # every cold declared step ran in a worker
        assert workers == set(declared), workers
        for step in workers:  # and the daemon then loaded what the worker compiled
            assert _done(log)[step]["compiled"] == 0 and _done(log)[step]["loaded"] > 0
    else:
        assert workers == set()

    messages, log = await _start(tmp_path, cache, "warm")
    early = _before_ready(messages)
    assert not any(m.startswith("EXTEND_TIMEOUT_USEC") for m in early), early
    for step in STEPS:
        assert any(f"{step}: loading" in m for m in early if m.startswith("STATUS=")), early
    done = _done(log)
    assert set(done) == set(STEPS)
    assert all(e["compiled"] == 0 for e in done.values()), done
    assert not any(e.get("state") == "worker" for e in log)
    if os.environ.get("KVRELAY_HAND_OVER_KERNELS"):  # ``make test``: the session's cache
        from tests.support.kernel_cache import hand_over

        hand_over(cache, REPO / "kvrelay")
