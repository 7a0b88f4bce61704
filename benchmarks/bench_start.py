"""Daemon start-up: process start → READY, cold (empty numba cache) and warm (cache present).

Usage: .venv/bin/python -m benchmarks.bench_start [--cold N] [--warm N] [--no-profile] [--short]
       [--smoke]

Each run starts the real daemon (``python -m kvrelay serve --config ...``, one pool with a static
ZMQ source) as a subprocess with ``NOTIFY_SOCKET`` pointing at an AF_UNIX datagram socket this
script binds, and times process spawn → the ``READY=1`` datagram. Every ``STATUS=`` line and
``EXTEND_TIMEOUT_USEC=`` request is recorded with its arrival time, so the result also shows what
an operator (``systemctl status``) sees during a cold compile. Cold runs get a fresh
``NUMBA_CACHE_DIR``; warm runs reuse the directory a cold run filled.

The profile (skipped with ``--no-profile``) runs ``warm_kernels`` in a child process with a fresh
cache and numba's compile events: per-kernel compile seconds (inclusive and exclusive of nested
compiles), the number of specializations and their signatures; then once more with the filled
cache, where every compile event is a ``cache=True`` miss. ``-X importtime`` of a warm start
lists the imports that dominate it.

``--short`` (what ``make bench`` runs): warm starts only, against a persistent cache in
``benchmarks/.work/numba-start`` (filled by one cold start the first time), no profile.
Writes ``benchmarks/results/start[-short].{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT, WORK, free_port, results_dir

PY = sys.executable

CONFIG = """\
[relay]
dc_name = "dc-bench"
bind = "127.0.0.1:0"
shutdown_timeout_s = 5.0
[metrics]
bind = "127.0.0.1:0"
[logging]
format = "json"
[[pools]]
namespace = "bench"
component = "backend"
endpoint = "generate"
expected_blocks = 65536
model = "bench-model"
kv_block_size = 16
[[pools.engines]]
name = "e0"
host = "127.0.0.1"
total_kv_blocks = 4096
[pools.engines.static]
endpoint = "tcp://127.0.0.1:{port}"
dp_ranks = [0]
"""


def _env(cache: Path | None, notify: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVRELAY_", "NUMBA_"))}
    env.pop("CACHE_DIRECTORY", None)
    env["NOTIFY_SOCKET"] = str(notify)
    env["PYTHONUNBUFFERED"] = "1"
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = str(cache)
    return env


def _cpu_s(pid: int) -> float | None:
    """utime + stime of a process and its reaped children (the compile workers), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = stat[stat.rindex(")") + 2 :].split()
    return round(sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK"), 2)


def _log_events(stderr: str, t0_wall: float) -> list[dict[str, Any]]:
    """The daemon's JSON log lines with ``t`` = seconds since spawn (from their timestamps)."""
    out = []
    for line in stderr.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ts = rec.get("timestamp")
        if isinstance(ts, str):
            t = time.mktime(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
            t += float("0" + ts[19:].rstrip("Z"))
            rec["t"] = round(t - t0_wall, 3)
        out.append(rec)
    return out


def start_once(cache: Path | None, timeout_s: float = 300.0,
               extra_args: tuple[str, ...] = (), keep_stderr: bool = False) -> dict[str, Any]:
    """One daemon start: spawn → READY=1, then SIGTERM; every notification with its time."""
    with tempfile.TemporaryDirectory(prefix="kvr-start-") as tmp:
        cfg = Path(tmp) / "kvrelay.toml"
        cfg.write_text(CONFIG.format(port=free_port()))
        notify = Path(tmp) / "notify.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(notify))
        sock.settimeout(0.1)
        notes: list[dict[str, Any]] = []
        t0_wall = time.time()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [PY, *extra_args, "-m", "kvrelay", "serve", "--config", str(cfg)],
            cwd=ROOT, env=_env(cache, notify), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )
        ready_s: float | None = None
        ready_cpu_s: float | None = None
        try:
            while time.monotonic() - t0 < timeout_s and proc.poll() is None:
                try:
                    data = sock.recv(65536).decode()
                except TimeoutError:
                    continue
                t = round(time.monotonic() - t0, 3)
                notes.append({"t": t, "msg": data})
                if "READY=1" in data.split("\n"):
                    ready_s = t
                    ready_cpu_s = _cpu_s(proc.pid)
                    break
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                _, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, stderr = proc.communicate()
            sock.close()
    events = _log_events(stderr, t0_wall)
    warm = [e for e in events if e.get("event") == "kernels_warm"]
    res = {
        "ready_s": ready_s,
        "ready_cpu_s": ready_cpu_s,
        "exit_code": proc.returncode,
        "notifications": notes,
        "status_lines": [n["msg"] for n in notes],
        "kernels_warm_s": warm[0].get("seconds") if warm else None,
        "log": [{k: e.get(k) for k in ("t", "event", "group", "seconds", "kernels")
                 if e.get(k) is not None} for e in events],
        "stderr_tail": "" if ready_s is not None else stderr[-3000:],
    }
    if keep_stderr:
        res["_stderr"] = stderr
    return res


# ---- per-kernel compile profile (child process) --------------------------------------------------


def _profile_child(out: Path) -> None:
    """Runs in a child with its own NUMBA_CACHE_DIR: numba compile events around warm_kernels."""
    t_start = time.perf_counter()
    from numba.core import event as ev

    stack: list[list[Any]] = []
    incl: dict[str, float] = collections.defaultdict(float)
    excl: dict[str, float] = collections.defaultdict(float)
    sigs: dict[str, list[str]] = collections.defaultdict(list)

    class Listener(ev.Listener):  # type: ignore[misc]
        def on_start(self, event: Any) -> None:
            d = event.data["dispatcher"]
            f = d.py_func
            stack.append([f"{f.__module__}.{f.__qualname__}", time.thread_time(), 0.0,
                          event.data["args"]])

        def on_end(self, event: Any) -> None:
            name, st, child, args = stack.pop()
            dt = time.thread_time() - st
            incl[name] += dt
            excl[name] += dt - child
            sigs[name].append(str(args))
            if stack:
                stack[-1][2] += dt

    ev.register("numba:compile", Listener())
    t_numba = time.perf_counter() - t_start
    steps: list[str] = []
    t0 = time.perf_counter()
    from kvrelay.ops.warmup import warm_kernels

    t_import = time.perf_counter() - t0
    cpu0 = time.process_time()
    seconds = warm_kernels(progress=lambda ev: steps.append(str(ev)), workers=False)
    cpu = time.process_time() - cpu0
    kernels = [
        {"kernel": k, "inclusive_s": round(incl[k], 3), "exclusive_s": round(excl[k], 3),
         "specializations": len(sigs[k]), "signatures": sigs[k]}
        for k in sorted(incl, key=lambda k: -incl[k])
    ]
    out.write_text(json.dumps({
        "numba_import_s": round(t_numba, 3),
        "import_daemon_s": round(t_import, 3),
        "warm_kernels_s": round(seconds, 3),
        "warm_kernels_cpu_s": round(cpu, 3),
        "total_s": round(time.perf_counter() - t_start, 3),
        "compile_events": sum(len(v) for v in sigs.values()),
        "compile_exclusive_sum_s": round(sum(excl.values()), 3),
        "steps": steps,
        "kernels": kernels,
    }))


def profile(cache: Path) -> dict[str, Any]:
    """Cold profile with an empty ``cache``, then a warm one with the cache it filled."""
    res: dict[str, Any] = {}
    for phase in ("cold", "warm"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = _env(cache, Path("/nonexistent"))
            env.pop("NOTIFY_SOCKET")
            subprocess.run([PY, "-m", "benchmarks.bench_start", "--profile-child", f.name],
                           cwd=ROOT, env=env, check=True, timeout=900)
            res[phase] = json.loads(Path(f.name).read_text())
    return res


def import_profile(cache: Path, top: int = 15) -> list[dict[str, Any]]:
    """``-X importtime`` of a warm daemon start: the heaviest top-level packages (cumulative)."""
    run = start_once(cache, extra_args=("-X", "importtime"), keep_stderr=True)
    rows: dict[str, int] = {}
    for line in run.pop("_stderr", "").splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m and len(m.group(3)) == 1:  # depth 0: imported by the program itself
            rows[m.group(4)] = rows.get(m.group(4), 0) + int(m.group(2))
    return [{"module": k, "cumulative_ms": round(v / 1000, 1)}
            for k, v in sorted(rows.items(), key=lambda kv: -kv[1])[:top]]


# ---- report --------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def markdown(res: dict[str, Any]) -> str:
    from benchmarks._report import machine_md

    lines = ["# Daemon start-up (process spawn → READY=1)", "", machine_md(res["machine"]), ""]
    lines += ["| start | runs | READY s (median) | READY s (each) | READY CPU s (each) "
              "| kernels_warm s (each) |", "| --- | --- | --- | --- | --- | --- |"]
    for kind in ("cold", "warm"):
        runs = res.get(kind) or []
        if not runs:
            continue
        each = ", ".join(f"{r['ready_s']:.2f}" if r["ready_s"] is not None else "timeout"
                         for r in runs)
        cpu = ", ".join(str(r["ready_cpu_s"]) for r in runs)
        kw = ", ".join(str(r["kernels_warm_s"]) for r in runs)
        med = _median([r["ready_s"] for r in runs])
        ms = "–" if med is None else f"{med:.2f}"
        lines.append(f"| {kind} | {len(runs)} | {ms} | {each} | {cpu} | {kw} |")
    cold = res.get("cold") or []
    if cold:
        lines += ["", "What systemd hears during the first cold start (seconds since spawn):", ""]
        for n in cold[0]["notifications"]:
            lines.append(f"- {n['t']:.2f} s: `{n['msg'].replace(chr(10), ' | ')}`")
    prof = res.get("profile")
    if prof:
        c = prof["cold"]
        lines += ["", f"Compile profile (fresh cache, in-process `warm_kernels`, one process): "
                  f"{c['warm_kernels_s']:.1f} s warm-up ({c['warm_kernels_cpu_s']:.1f} s CPU) "
                  f"after {c['import_daemon_s']:.1f} s of imports; {c['compile_events']} "
                  f"compiles, sum of exclusive CPU times {c['compile_exclusive_sum_s']:.1f} s. "
                  "With the filled cache: "
                  f"{prof['warm']['compile_events']} compiles (cache misses), warm-up "
                  f"{prof['warm']['warm_kernels_s']:.2f} s.", "",
                  "| kernel | inclusive CPU s | exclusive CPU s | specializations |",
                  "| --- | --- | --- | --- |"]
        for k in c["kernels"][:25]:
            lines.append(f"| `{k['kernel']}` | {k['inclusive_s']:.2f} | {k['exclusive_s']:.2f} "
                         f"| {k['specializations']} |")
        lines += ["", "Steps of `warm_kernels` (fresh cache):", ""]
        lines += [f"- {s}" for s in c["steps"]]
    imp = res.get("imports")
    if imp:
        lines += ["", "Heaviest imports of a warm start (`-X importtime`, cumulative):", "",
                  "| module | ms |", "| --- | --- |"]
        lines += [f"| `{r['module']}` | {r['cumulative_ms']} |" for r in imp]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", type=int, default=2, help="cold starts (fresh cache each)")
    ap.add_argument("--warm", type=int, default=5, help="warm starts")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile")
    ap.add_argument("--short", action="store_true",
                    help="warm starts only, persistent cache (make bench)")
    ap.add_argument("--smoke", action="store_true",
                    help="one warm start on the kernel cache in use (seconds), to .work/smoke")
    ap.add_argument("--profile-child", metavar="OUT", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.profile_child:
        _profile_child(Path(a.profile_child))
        return 0
    from benchmarks._common import machine, write_json

    res: dict[str, Any] = {"benchmark": "start", "machine": machine(),
                           "mode": "smoke" if a.smoke else "short" if a.short else "full"}
    scratch = Path(tempfile.mkdtemp(prefix="kvr-numba-"))
    try:
        if a.smoke:  # the cache this environment already uses (kvrelay warm filled it)
            res["warm"] = [start_once(None, timeout_s=120.0)]
        elif a.short:
            cache = WORK / "numba-start"
            cache.mkdir(parents=True, exist_ok=True)
            first = start_once(cache)
            if (first["kernels_warm_s"] or 0) > 2.0:  # the persistent cache was cold
                res["cold"] = [first]
            res["warm"] = [start_once(cache) for _ in range(a.warm if a.warm != 5 else 3)]
        else:
            res["cold"] = []
            for i in range(a.cold):
                cache = scratch / f"cold{i}"
                res["cold"].append(start_once(cache))
                print(f"cold start {i + 1}: READY after {res['cold'][-1]['ready_s']} s",
                      flush=True)
            res["warm"] = [start_once(scratch / "cold0") for _ in range(a.warm)]
            res["imports"] = import_profile(scratch / "cold0")
            if not a.no_profile:
                res["profile"] = profile(scratch / "profile")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["cold_ready_s_median"] = _median([r["ready_s"] for r in res.get("cold", [])])
    res["warm_ready_s_median"] = _median([r["ready_s"] for r in res["warm"]])
    name = "start-short" if a.short or a.smoke else "start"
    out = results_dir(a.smoke)
    write_json(out / f"{name}.json", res)
    md = markdown(res)
    (out / f"{name}.md").write_text(md)
    print(md)
    bad = [r for r in res.get("cold", []) + res["warm"] if r["ready_s"] is None]
    for r in bad:
        print(r["stderr_tail"], file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
