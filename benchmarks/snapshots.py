"""Snapshots alone: ``python -m benchmarks.snapshots [--repeats N] [--skip-64] [--skip-4]``
(``--smoke``: the 4 MiB lane once, tiny working set, to ``.work/smoke``).

The snapshot part of ``benchmarks.run`` without the latency sweep, for iterating on the snapshot
path: subscribe → snapshot complete on an idle 4 MiB lane (1 and 8 concurrent subscribers) and an
idle 64 MiB lane (1 and 4), then the 64 MiB lane while the pool publishes 100,000 block events/s
(one subscriber at a time joins, reading at full speed and throttled to 80 MB/s). Real processes
on loopback, as in ``run``. Writes ``benchmarks/results/snapshots.{json,md}``; with
``--workers N`` (≥ 2) every subscriber is served by the relay's N−1 fan-out workers (mirrors of
it) and the results go to ``snapshots_workers<N>.{json,md}``; with ``--mirror`` every
subscriber reads a ``kvrelay mirror`` process in front of the relay (loopback TCP), results in
``snapshots_mirror.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks._common import machine, results_dir, write_json
from benchmarks._harness import Fleet, FleetConfig
from benchmarks._report import snapshot_markdown
from benchmarks._scenarios import big_lane_fleet, fill, log, snapshot_load_suite, snapshot_times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3, help="joins per idle point")
    ap.add_argument("--skip-4", action="store_true", help="no 4 MiB lane")
    ap.add_argument("--skip-64", action="store_true", help="no 64 MiB lane")
    ap.add_argument("--rate", type=float, default=100_000, help="block events/s under load")
    ap.add_argument("--workers", type=int, default=1,
                    help="[relay] workers: >= 2 serves through N-1 fan-out workers")
    ap.add_argument("--mirror", action="store_true",
                    help="serve every subscriber through a kvrelay mirror process")
    ap.add_argument("--smoke", action="store_true",
                    help="4 MiB lane only, one join, tiny working set, to .work/smoke")
    a = ap.parse_args(argv)
    if a.smoke:
        a.repeats, a.skip_64 = 1, True
    t0 = time.monotonic()
    res: dict[str, Any] = {"benchmark": "snapshots", "machine": machine(), "snapshot": [],
                           "snapshot_under_load": []}
    if not a.skip_4:
        small = Fleet(FleetConfig(engines=1, base_port=27300, probes=0, tag="snap4",
                                  working_set_chains=256 if a.smoke else 8192,
                                  workers=a.workers, mirror=a.mirror))
        try:
            log("snapshot: 4 MiB lane (524,288 buckets)")
            small.start()
            fill(small)
            res["snapshot"] += [snapshot_times(small, a.repeats, 1),
                                snapshot_times(small, a.repeats, 8)]
        finally:
            small.stop()
    if not a.skip_64:
        big = big_lane_fleet(a.workers, a.mirror)
        try:
            log("snapshot: 64 MiB lane (8,388,608 buckets)")
            big.start()
            fill(big)
            res["snapshot"] += [snapshot_times(big, a.repeats, 1),
                                snapshot_times(big, max(1, a.repeats // 2), 4)]
            res["snapshot_under_load"] = snapshot_load_suite(big, a.rate, a.repeats)
        finally:
            big.stop()
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["workers"] = a.workers
    res["mirror"] = a.mirror
    name = "snapshots" if a.workers <= 1 else f"snapshots_workers{a.workers}"
    if a.mirror:
        name = "snapshots_mirror" if a.workers <= 1 else f"snapshots_mirror_workers{a.workers}"
    out = results_dir(a.smoke)
    write_json(out / f"{name}.json", res)
    md = snapshot_markdown(res)
    (out / f"{name}.md").write_text(md)
    print(md)
    log(f"wrote {out}/{name}.{{json,md}} in {res['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
