"""A kvrelay mirror in front of Dynamo's reference relay serves replicas identical to a direct
subscriber's (issue 16).

The side-by-side setup (``side_by_side.py``: ``.venv-dynamo``, a private network namespace,
Dynamo's mocker and ``dynamo.kv_dc_relay``) with ``kvrelay mirror --upstream`` pointed at
Dynamo's relay instead of a kvrelay ingesting the mocker. ``_mirror_check`` subscribes the pool
on both, feeds both streams to the SDK's strict replica, and after the traffic compares: tables
byte for byte at one sequence, every common delta frame byte for byte, snapshot payloads when
both cut at one sequence, RelayInfo and catalog bytes. Writes ``results/mirror_dynamo.{json,md}``
(or ``skipped`` with the reason, like the side-by-side).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any

from benchmarks._common import PY, ROOT, WORK, machine, results_dir, tree_sample, write_json
from benchmarks._dynamo_env import delete_netns, sigterm_as_exit
from benchmarks._harness import Proc
from benchmarks.side_by_side import (
    BLOCK,
    DPY,
    DYN_PORT,
    NS,
    dyn_env,
    ensure_netns,
    ensure_venv,
    make_prompts,
    sh,
)

MIRROR_PORT = 5564


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] mirror-dynamo: {msg}", flush=True)


def markdown(res: dict[str, Any]) -> str:
    if res.get("skipped"):
        return f"# kvrelay mirror in front of Dynamo 1.6.1\n\nSKIPPED: {res['reason']}\n"
    c, m = res["check"], res["machine"]
    rows = [
        ("replica tables equal at one sequence", c["tables_equal"], c["sequence"]),
        ("delta frames identical except `send_ts_us`",
         c["deltas_identical_but_send_ts"] == c["deltas_compared"] > 0,
         f"{c['deltas_identical_but_send_ts']} of {c['deltas_compared']} deltas; byte for byte "
         f"{c['deltas_identical_bytes']} (Dynamo stamps each stream's frames when it sends "
         "them, so two direct subscribers differ there too)"),
        ("snapshot payloads equal (same cut)", c["snapshot_payloads_equal"],
         f"same cut: {c['snapshot_same_cut']}"),
        ("envelope prefix (relay + producer) equal", c["envelope_prefix_equal"], ""),
        ("GetRelayInfo bytes equal", c["relay_info_equal"], ""),
        ("catalog bytes equal", c["catalog_equal"], ""),
        ("consumer-rule violations", c["violations"], ""),
    ]  # fmt: skip
    lines = [
        "# kvrelay mirror in front of Dynamo 1.6.1", "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, load average at start "
        f"{m['loadavg_at_start']}; git {m['git_commit']}; {m['utc']}.", "",
        res["setup"], "",
        "| check | result | detail |", "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {d} |" for a, b, d in rows]
    lines += ["", f"Requests: {res['requests']} ({res['stored_blocks_per_s']:,} stored blocks/s "
              f"offered); mirror CPU {res['mirror_cpu_util']} cores, Dynamo relay CPU "
              f"{res['dynamo_cpu_util']} cores."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=100.0, help="requests/s (64 blocks each)")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--smoke", action="store_true", help="1 s at 20 requests/s, to .work/smoke")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rate, a.seconds = 20.0, 1.0
    sigterm_as_exit()
    out_dir = results_dir(a.smoke)
    out_json, out_md = out_dir / "mirror_dynamo.json", out_dir / "mirror_dynamo.md"
    WORK.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"benchmark": "mirror_dynamo", "skipped": False, "machine": machine()}

    def skip(reason: str) -> int:
        print(f"mirror-dynamo SKIPPED: {reason}", flush=True)
        out = {"benchmark": "mirror_dynamo", "skipped": True, "reason": reason,
               "machine": machine()}  # fmt: skip
        write_json(out_json, out)
        out_md.write_text(markdown(out))
        return 0

    reason = ensure_venv() or ensure_netns(NS)
    if reason:
        return skip(reason)
    model = WORK / "fakemodel"
    r = sh(DPY, str(ROOT / "benchmarks" / "_fakemodel.py"), str(model))
    if r.returncode != 0:
        delete_netns(NS)
        return skip(f"fake model: {r.stderr.strip()[-300:]}")
    kv_dir = WORK / "dynkv-mirror"
    shutil.rmtree(kv_dir, ignore_errors=True)
    kv_dir.mkdir(parents=True)
    env = dyn_env(kv_dir)
    nsx = ["ip", "netns", "exec", NS]
    warm, count = 40, int(a.rate * a.seconds)
    prompts, _probes = make_prompts(warm + count + 10)
    procs: dict[str, Proc] = {}
    try:
        log("starting mocker, Dynamo relay and a kvrelay mirror of it in netns " + NS)
        procs["mocker"] = Proc("md-mocker", [
            DPY, "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", "fake",
            "--block-size", str(BLOCK), "--num-gpu-blocks-override", "65536",
            "--speedup-ratio", "100", "--kv-events", "--endpoint", "dyn://testns.mocker.generate",
        ], prefix=nsx, env=env)  # fmt: skip
        procs["dynamo"] = Proc("md-dynamo-relay", [
            DPY, "-m", "dynamo.kv_dc_relay", "--dc-id", "dc-a", "--watch-all", "--bind",
            f"127.0.0.1:{DYN_PORT}"], prefix=nsx, env=env | {"DYN_NAMESPACE": "relayns"})
        log("warm-up requests: the pool materializes in Dynamo's catalog")
        drv = Proc("md-driver-warmup", [
            DPY, str(ROOT / "benchmarks" / "_dynamo_driver.py"), "--prompts", str(prompts),
            "--start", "0", "--count", str(warm), "--rate", "20"], prefix=nsx, env=env)
        drv.expect("{", 180)
        drv.stop()
        procs["mirror"] = Proc("md-mirror", [
            PY, "-m", "kvrelay", "mirror", "--upstream", f"127.0.0.1:{DYN_PORT}",
            "--bind", f"127.0.0.1:{MIRROR_PORT}", "--metrics-bind", "off"], prefix=nsx)
        check = Proc("md-check", [
            PY, "-m", "benchmarks._mirror_check", "--direct", str(DYN_PORT),
            "--mirror", str(MIRROR_PORT)], prefix=nsx, stdin=True)  # fmt: skip
        check.expect("SNAPSHOTS_DONE", 180)
        c0 = {k: tree_sample(procs[k].pid) for k in ("mirror", "dynamo")}
        log(f"{a.rate:.0f} requests/s for {a.seconds:.0f} s")
        drv = Proc("md-driver", [
            DPY, str(ROOT / "benchmarks" / "_dynamo_driver.py"), "--prompts", str(prompts),
            "--start", str(warm), "--count", str(count), "--rate", str(a.rate)],
            prefix=nsx, env=env)  # fmt: skip
        sent = json.loads(drv.expect("{", a.seconds + 120))
        drv.stop()
        c1 = {k: tree_sample(procs[k].pid) for k in ("mirror", "dynamo")}
        time.sleep(1.0)
        check.send("stop")
        res["check"] = json.loads(check.expect("{", 60))
        check.stop()
        window = c1["mirror"].wall - c0["mirror"].wall
        res.update(
            requests=len(sent["sent"]),
            stored_blocks_per_s=round(sent["requests_per_s"] * 64),
            mirror_cpu_util=round((c1["mirror"].cpu_s - c0["mirror"].cpu_s) / window, 3),
            dynamo_cpu_util=round((c1["dynamo"].cpu_s - c0["dynamo"].cpu_s) / window, 3),
            setup=("Dynamo mocker (block 16, 65,536 GPU blocks, speedup 100) → "
                   "`dynamo.kv_dc_relay` → `kvrelay mirror`, in netns "
                   f"`{NS}`; one checker subscribes the pool on Dynamo's relay and on the mirror "
                   "at once (SDK strict replicas + raw frames)."),
        )  # fmt: skip
    except (Exception, KeyboardInterrupt) as exc:  # report, never leave a half-written result
        res = {"benchmark": "mirror_dynamo", "skipped": True,
               "reason": f"run failed: {type(exc).__name__}: {exc}"[:2000], "machine": machine()}
        print(f"mirror-dynamo FAILED: {res['reason']}", flush=True)
    finally:
        for proc in procs.values():
            proc.stop()
        delete_netns(NS)
    write_json(out_json, res)
    md = markdown(res)
    out_md.write_text(md)
    print(md)
    return 1 if res.get("skipped") else 0


if __name__ == "__main__":
    sys.exit(main())
