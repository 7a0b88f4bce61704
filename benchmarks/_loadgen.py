"""A paced vLLM KV-event publisher (one engine, one DP rank) for offered-load benchmarks.

The simulator in ``kvrelay.sim`` models a scheduler in Python and tops out far below the loads we
want to offer, so this process pre-encodes vLLM map-era (>= 0.24) events once and only splices a
fresh envelope ``[ts, events, dp_rank]`` per batch: ``ts`` is ``time.time()`` taken just before the
send, i.e. the engine publish time. Traffic: a FIFO working set of ``W`` resident chains (each a
``BlockStored`` of ``C`` blocks with ``parent_block_hash = None``); each batch stores ``S`` chains
and removes the ``S`` oldest, cycling through ``2W`` distinct chains. Pacing is on *block events*
(hashes in Stored + Removed events), so offered load = block events / s.

Probe chains: every ``1/probe_hz`` s one extra, never-reused 8-block chain is stored (and removed
``probe_ttl`` s later). Their Dynamo canonical hashes (computed with the ``xxhash`` package) are
written to ``--probe-file`` before traffic starts; subscribers report when all 8 appear in their
replica filter, which gives the end-to-end engine → subscriber latency.

A probe's removal that is not due when a run ends waits for the next run (it goes out first
thing then): removing it right after the run's last batch would let a relay that coalesces
commands into one delta — any relay a little behind at the end of a run, as the contract allows —
publish the store and the removal together, and no consumer could ever see that probe although
every event arrived and the relay's state was exact (``run ... flush`` still does that, for the
test that shows it).

Working-set file (``--state-file``, for the side by side's final-state check): after every run,
the canonical hashes of the chains the engine still holds (``present``, shape (W, C)) and of up to
2,048 chains it removed most recently (``absent``) go to an ``.npz``, so a consumer can check its
replica against what the engine really holds, independently of any relay counter.

Protocol: prints ``BOUND``, then ``READY`` once ``--subscribers`` SUB sockets subscribed (XPUB sees
each subscription), then reads commands on stdin: ``run RATE SECONDS STORES_PER_BATCH [PROBE_HZ]
[flush]`` answers one JSON line; ``quit`` exits.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from collections import deque

import msgspec
import numpy as np
import zmq

from kvrelay.sim.hashing import dynamo_sequence_hashes

_ENC = msgspec.msgpack.Encoder()


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)


def envelope(ts: float, events: list[bytes], dp_rank: int) -> bytes:
    """msgpack ``[ts(float64), [events...], dp_rank]`` from pre-encoded events."""
    return b"".join(
        (b"\x93\xcb", struct.pack(">d", ts), _array_header(len(events)), *events,
         _ENC.encode(dp_rank))
    )


def _store(hashes: list[int], tokens: list[int], block_size: int) -> bytes:
    return _ENC.encode({
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
        "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
        "lora_name": None,
    })


def _remove(hashes: list[int]) -> bytes:
    return _ENC.encode({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})


class Traffic:
    def __init__(self, a: argparse.Namespace) -> None:
        rng = np.random.default_rng(a.seed)
        c, b = a.chain_blocks, a.block_size
        n = 2 * a.working_set_chains
        toks = rng.integers(1000, 150_000, size=(n, c * b), dtype=np.int64)
        hashes = rng.integers(1, 2**63, size=(n, c), dtype=np.int64).astype(np.uint64)
        self.stores = [_store(hashes[i].tolist(), toks[i].tolist(), b) for i in range(n)]
        self.removes = [_remove(hashes[i].tolist()) for i in range(n)]
        self.c = c
        self.n = n
        self.w = a.working_set_chains
        self.next = 0
        self.resident: deque[int] = deque()
        # probes: unique chains, never reused
        ptoks = rng.integers(150_001, 2**31, size=(a.probes, 8 * b), dtype=np.int64)
        phashes = rng.integers(2**63, 2**64 - 1, size=(a.probes, 8), dtype=np.uint64)
        self.probe_store = [_store(phashes[i].tolist(), ptoks[i].tolist(), b)
                            for i in range(a.probes)]
        self.probe_remove = [_remove(phashes[i].tolist()) for i in range(a.probes)]
        self.probe_canonical = [dynamo_sequence_hashes(ptoks[i].tolist(), b)
                                for i in range(a.probes)]
        self.next_probe = 0
        # (perf_counter deadline, probe) of stored probes not yet removed; kept across runs
        self.probe_removals: deque[tuple[float, int]] = deque()
        self.removed: deque[int] = deque(maxlen=2048)
        self.canonical: np.ndarray | None = None
        if a.state_file:  # ~6 µs per chain with the xxhash oracle
            self.canonical = np.array(
                [dynamo_sequence_hashes(toks[i].tolist(), b) for i in range(n)], dtype=np.uint64
            )

    def write_state(self, path: str) -> None:
        """``present``/``absent`` canonical hashes (see the module docstring)."""
        assert self.canonical is not None
        held = set(self.resident)
        gone = [i for i in self.removed if i not in held]
        tmp = path + ".tmp.npz"
        np.savez(tmp, present=self.canonical[list(self.resident)],
                 absent=self.canonical[gone].reshape(-1, self.c))
        os.replace(tmp, path)

    def batch(self, s: int) -> tuple[list[bytes], int]:
        """Events of one batch (``s`` stores, up to ``s`` removes) and its block-event count."""
        evs: list[bytes] = []
        blocks = 0
        for _ in range(s):
            i = self.next
            self.next = (i + 1) % self.n
            evs.append(self.stores[i])
            self.resident.append(i)
            blocks += self.c
            if len(self.resident) > self.w:
                gone = self.resident.popleft()
                evs.append(self.removes[gone])
                self.removed.append(gone)
                blocks += self.c
        return evs, blocks


def run(
    pub: zmq.Socket[bytes], tr: Traffic, state: dict[str, int], rate: float, seconds: float,
    s: int, probe_hz: float, probe_ttl: float, dp_rank: int, flush: bool = False,
) -> dict[str, object]:
    """One paced run. Probe removals not due at the end stay pending for the next run (see
    the module docstring); ``flush`` sends them right after the last batch instead."""
    probes_sent: list[tuple[int, int]] = []
    probe_removals = tr.probe_removals
    sent_blocks = batches = again = late_resets = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    due = t0
    next_probe = t0 if probe_hz > 0 else float("inf")
    probe_period = 1.0 / probe_hz if probe_hz > 0 else 0.0
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if now < due:
            wait = due - now
            if wait > 0.0002:
                time.sleep(wait - 0.0001)
            continue
        if now - due > 0.05:  # we fell behind: never burst more than 50 ms of backlog
            due = now
            late_resets += 1
        evs, blocks = tr.batch(s)
        probe = -1
        if now >= next_probe and tr.next_probe < len(tr.probe_store):
            probe = tr.next_probe
            tr.next_probe += 1
            evs.append(tr.probe_store[probe])
            blocks += 8
            probe_removals.append((now + probe_ttl, probe))
            next_probe += probe_period
            if next_probe < now:
                next_probe = now + probe_period
        while probe_removals and probe_removals[0][0] <= now:
            evs.append(tr.probe_remove[probe_removals.popleft()[1]])
            blocks += 8
        ts = time.time()
        payload = envelope(ts, evs, dp_rank)
        seq = state["seq"]
        try:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            again += 1  # dropped at the PUB HWM: the relay will see a gap
        state["seq"] = seq + 1
        if probe >= 0:
            probes_sent.append((probe, int(ts * 1e6)))
        sent_blocks += blocks
        batches += 1
        due += blocks / rate
    elapsed = time.perf_counter() - t0
    if flush and probe_removals:  # the old end of a run: every pending probe removed at once
        evs = [tr.probe_remove[p] for _, p in probe_removals]
        probe_removals.clear()
        payload = envelope(time.time(), evs, dp_rank)
        pub.send_multipart([b"", state["seq"].to_bytes(8, "big"), payload])
        state["seq"] += 1
        sent_blocks += 8 * len(evs)
    end_wall_us = int(time.time() * 1e6)  # the last event of this run has been handed to ZMQ
    return {
        "offered_rate": rate,
        "seconds": elapsed,
        "batches": batches,
        "block_events": sent_blocks,
        "achieved_rate": sent_blocks / elapsed if elapsed > 0 else 0.0,
        "stores_per_batch": s,
        "hwm_drops": again,
        "fell_behind": late_resets,
        "probes": probes_sent,
        "probes_pending_removal": len(probe_removals),
        "next_seq": state["seq"],
        "end_wall_us": end_wall_us,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chain-blocks", type=int, default=8)
    p.add_argument("--working-set-chains", type=int, default=8192)
    p.add_argument("--probes", type=int, default=4000)
    p.add_argument("--probe-file", default="")
    p.add_argument("--probe-hz", type=float, default=100.0)
    p.add_argument("--probe-ttl", type=float, default=3.0)
    p.add_argument("--hwm", type=int, default=100_000)
    p.add_argument("--subscribers", type=int, default=1, help="SUB sockets to wait for")
    p.add_argument("--state-file", default="", help="working-set .npz written after each run")
    a = p.parse_args()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, a.hwm)
    pub.setsockopt(zmq.LINGER, 0)
    if a.subscribers > 1:  # otherwise XPUB passes up only the first subscription to a topic
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.bind(f"tcp://{a.host}:{a.port}")
    print("BOUND", flush=True)
    tr = Traffic(a)
    if a.probe_file:
        with open(a.probe_file, "w") as f:
            json.dump({"probes": tr.probe_canonical}, f)
    for _ in range(a.subscribers):  # each subscription message; traffic sent before is lost
        pub.recv()
    print("READY", flush=True)
    state = {"seq": 0}
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        if parts[0] == "run":
            rate, seconds, s = float(parts[1]), float(parts[2]), int(parts[3])
            hz = float(parts[4]) if len(parts) > 4 else a.probe_hz
            flush = len(parts) > 5 and parts[5] == "flush"
            res = run(pub, tr, state, rate, seconds, s, hz, a.probe_ttl, a.dp_rank, flush)
            res["next_probe"] = tr.next_probe
            if a.state_file:
                tr.write_state(a.state_file)
            print(json.dumps(res), flush=True)
    pub.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
