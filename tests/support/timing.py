"""Deadlines that stretch with how busy this machine is, from a measured calibration.

A test that waits for a condition needs a deadline, and a deadline right for a quiet machine is
too short for a laptop whose other core compiles something, or a shared CI runner. Sleeping
longer would slow every run; instead each deadline is ``scaled(seconds)``: ``seconds`` times
``slowdown()``, measured at the start of the session (again between tests once that measurement
is two minutes old: a busy neighbour comes and goes) by timing a fixed CPU-bound loop in two
processes at once (a test and the daemon it talks to compete for cores the same way) against the
same loop on an idle core of the suite's 2-core machines. Bounded: never below 1 (a fast machine
keeps the written deadline), never above ``MAX_SLOWDOWN`` (a machine slower than that fails).

``KVRELAY_TEST_SLOWDOWN`` (a number) replaces the measurement, e.g. to reproduce a run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

#: Seconds the loop below takes on an idle core of the suite's 2-core Xeon machines (its CPU
#: time there, which load does not change; a faster machine measures less and keeps factor 1).
REFERENCE_S = 0.058
MAX_SLOWDOWN = 6.0
ENV = "KVRELAY_TEST_SLOWDOWN"
PARALLEL = 2
ROUNDS = 3

_LOOP = """
import sys, time
sys.stdin.readline()
t0 = time.perf_counter()
x = 0
for i in range(500_000):
    x = (x + (i ^ (x >> 3))) & 0xFFFFFFFF
print(time.perf_counter() - t0, flush=True)
"""

REFRESH_S = 120.0

_factor: float | None = None
_measured_at = 0.0


def _round() -> float:
    """Slowest of ``PARALLEL`` processes running the loop at the same moment (started, then
    released together, so interpreter start-up is not measured)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LOOP], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )
        for _ in range(PARALLEL)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    times = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        times.append(float(out.strip()))
    return max(times)


def measure() -> float:
    """A fresh measurement: median of ``ROUNDS`` rounds over ``REFERENCE_S``, bounded."""
    raw = statistics.median(_round() for _ in range(ROUNDS)) / REFERENCE_S
    return min(MAX_SLOWDOWN, max(1.0, raw))


def slowdown() -> float:
    """The factor now (``KVRELAY_TEST_SLOWDOWN`` when set, else the latest measurement)."""
    forced = os.environ.get(ENV)
    if forced:
        return min(MAX_SLOWDOWN, max(1.0, float(forced)))
    if _factor is None:
        refresh_if_stale()
    assert _factor is not None
    return _factor


def refresh_if_stale() -> None:
    """Measure again when the last measurement is ``REFRESH_S`` old (or there is none). Called
    between tests (``tests/conftest.py``), never inside one: a measurement takes the CPU for a
    moment, and a test's timers must not see that."""
    global _factor, _measured_at
    if _factor is None or time.monotonic() - _measured_at > REFRESH_S:
        _factor, _measured_at = measure(), time.monotonic()


def scaled(seconds: float) -> float:
    """``seconds``, a deadline written for a quiet machine, stretched for this one."""
    return seconds * slowdown()


def monotonic_deadline(seconds: float) -> float:
    """``time.monotonic()`` at which a wait of ``scaled(seconds)`` starting now gives up."""
    return time.monotonic() + scaled(seconds)
