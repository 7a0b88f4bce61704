"""``[relay] workers = 2`` as real processes: READY after the worker serves, replicas through
the worker equal the ingest process's, a killed worker is restarted and counted, SIGTERM drains
everything; ``kvrelay mirror`` with TLS both ways; ``check-config`` validates the settings.

Oracles: a consumer on the ingest process's own UNIX socket (what the worker mirrors) and the
simulator's ground truth; the worker's streams are compared with both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality

from benchmarks._common import free_port
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import RelayClient
from kvrelay.contract.wire import CONTRACT_MARKER as MARKER
from kvrelay.ops.config import load_config, parse_config
from kvrelay.ops.tls import client_ssl_context, server_ssl_context
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.ops.test_daemon import Notifications, _config
from tests.support.certs import make_crl, make_leaf, make_pki
from tests.support.commands import REPO, clean_env, kvrelay
from tests.support.fleet import ground_truth
from tests.support.rig import (
    Consumer,
    catalog_producer,
    eventually,
    first_matching,
    in_sync,
    make_settings,
    relay_info,
    start_relay,
    wait_live,
)
from tests.support.timing import scaled


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def _workers(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        with contextlib.suppress(OSError):
            if b"kvrelay.ops.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


async def _not_http2(port: int) -> None:
    """A client that does not speak HTTP/2 (the relay closes it, counted as a protocol error)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: relay\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(reader.read(), scaled(5))
    writer.close()


async def _metrics(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), scaled(5))
    writer.close()
    return data.decode().partition("\r\n\r\n")[2]


async def _consumer(ch: Channel) -> Consumer:
    info = await relay_info(ch)
    assert info.relay is not None
    c = Consumer(ch, await catalog_producer(ch), info.relay).start()
    await asyncio.wait_for(c.first.wait(), scaled(20))
    return c


async def _same_table(a: Consumer, b: Consumer, engine: SimEngine) -> None:
    """Both replicas settle at one sequence with byte-identical tables holding every block the
    engine holds."""
    def settled() -> bool:
        ra, rb = a.replica, b.replica
        return ra.sequence is not None and ra.sequence == rb.sequence

    await eventually(settled, what="both replicas at one sequence", timeout=20)
    await asyncio.sleep(0.3)  # nothing in flight any more
    await eventually(settled, what="still at one sequence", timeout=20)
    ta, tb = a.replica.table, b.replica.table
    assert ta is not None and tb is not None and np.array_equal(ta, tb)
    held = set().union(*ground_truth([engine]).values())
    assert held and bool(np.all(a.replica.contains(sorted(held))))


async def _serving_load_through_the_worker(port: int, engine: SimEngine) -> None:
    """SubscribeServingLoad through the fan-out worker, read with the SDK: both views COMPLETE
    and the counters equal the engine's own."""
    async with RelayClient([f"127.0.0.1:{port}"]) as client:
        finished = sum(s.finished for s in engine.schedulers)

        def complete() -> bool:
            v = client.serving_load()
            return (
                len(v.models) == 1 and v.models[0].complete
                and v.models[0].requests_completed_total == finished
                and [p.status for p in v.pools.values()] == ["COMPLETE"]
            )  # fmt: skip

        assert await client.wait_for(complete, 30), client.serving_load()
        (pool,) = client.serving_load().pools.values()
        assert pool.live_workers == 1 and pool.active_decode_blocks is not None


async def _serve_notified(
    tmp_path: Path, cfg: Path
) -> tuple[asyncio.subprocess.Process, Notifications, Path]:
    """``kvrelay serve --config cfg`` as systemd runs it: a notify socket and a runtime directory
    (``tmp_path/run``) of its own; stderr piped."""
    notes = Notifications(tmp_path / "notify.sock")
    runtime = tmp_path / "run"
    runtime.mkdir()
    env = clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), RUNTIME_DIRECTORY=str(runtime))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg),
        env=env, cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    return proc, notes, runtime


def _grpc_port(ready: str) -> int:
    """The gRPC port a READY=1 status names."""
    m = re.search(r"serving gRPC on 127\.0\.0\.1:(\d+)", ready)
    assert m, ready
    return int(m.group(1))


async def test_two_workers_serve_are_restarted_and_drain(tmp_path: Path) -> None:
    engine = SimEngine(SimConfig(name="e0", seed=15, dp_size=2, capacity_blocks=96))
    await engine.start()
    assert engine.grpc_port is not None
    metrics_port = free_port()
    cfg = _config(tmp_path / "kvrelay.toml", engine.grpc_port, extra="workers = 2\n")
    cfg.write_text(cfg.read_text().replace('bind = "127.0.0.1:0"\n\n[logging]',
                                           f'bind = "127.0.0.1:{metrics_port}"\n\n[logging]')
                   + f"metrics_port = {engine.metrics_port}\n")  # fmt: skip
    proc, notes, runtime = await _serve_notified(tmp_path, cfg)
    consumers: list[Consumer] = []
    try:
        try:
            ready = await notes.wait_for("READY=1", timeout=120)
        except AssertionError:
            proc.kill()
            raise AssertionError((await proc.stderr.read()).decode()[-3000:]) from None  # type: ignore[union-attr]
        assert "1 fan-out worker" in ready
        port = _grpc_port(ready)
        [worker] = _workers(proc.pid)
        environ = Path(f"/proc/{worker}/environ").read_bytes()
        assert b"NOTIFY_SOCKET" not in environ, "only the supervisor talks to systemd"
        # under memory pressure the kernel takes the worker (restarted) before the ingest process
        own = int(Path("/proc/self/oom_score_adj").read_text())  # what the daemon inherited
        assert int(Path(f"/proc/{worker}/oom_score_adj").read_text()) == max(500, own)
        assert int(Path(f"/proc/{proc.pid}/oom_score_adj").read_text()) == own
        [internal] = list(runtime.glob("kvrelay-*/ingest.sock"))
        async with Channel("127.0.0.1", port) as pub, Channel(path=str(internal)) as ing:
            assert bytes((await relay_info(pub)).relay) == bytes((await relay_info(ing)).relay)
            direct = await _consumer(ing)
            via = await _consumer(pub)
            consumers += [direct, via]
            for _ in range(5):
                await engine.step(4)
                await asyncio.sleep(0.05)
            await _same_table(via, direct, engine)
            await _serving_load_through_the_worker(port, engine)
            # the worker holds the public connections: what its HTTP/2 guard counts is the
            # daemon's (it read 0 with workers), also after the worker is gone (below)
            abuse = r'^kvrelay_http2_abuse_total\{reason="protocol_error"\} 1\.0$'
            await _not_http2(port)
            deadline = time.monotonic() + scaled(10)
            while not re.search(abuse, await _metrics(metrics_port), re.M):
                assert time.monotonic() < deadline, "the worker's guard counts never came"
                await asyncio.sleep(0.2)

            os.kill(worker, signal.SIGKILL)  # a crashed worker: its router streams drop
            end = await via.wait_end()
            assert end.status is not None, "a dead worker cannot end with OK"
            await eventually(lambda: bool(_workers(proc.pid)) and _workers(proc.pid) != [worker],
                             what="worker restarted", timeout=30)  # fmt: skip

            async def served() -> bool:
                try:
                    async with Channel("127.0.0.1", port) as probe:
                        await relay_info(probe)
                    return True
                except (OSError, ConnectionError, Exception):
                    return False

            deadline = time.monotonic() + scaled(20)
            while not await served() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            text = await _metrics(metrics_port)
            assert re.search(r"^kvrelay_worker_restarts_total 1\.0$", text, re.M), text[-2000:]
            assert re.search(abuse, text, re.M), "counted still, its worker gone"
            assert 'kvrelay_workers{state="configured"} 1.0' in text
            await engine.step(4)
            again = await _consumer(pub)
            consumers.append(again)
            assert direct.end is None, "the ingest socket is not affected by a worker crash"
            await engine.step(4)
            await _same_table(again, direct, engine)

            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), scaled(20))
            stderr = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
            assert rc == 0, stderr[-3000:]
            assert (await again.wait_end()).status is None, "drained: clean EOF"
            assert (await direct.wait_end()).status is None
        assert not _workers(proc.pid) and not Path(f"/proc/{worker}").exists()
        assert '"worker_exited"' in stderr and '"worker_restarted"' in stderr
        await notes.wait_for("STOPPING=1")
        kinds = [n.split("=", 1)[0] for n in notes.messages]
        assert kinds.count("READY") == 1 and kinds.count("STOPPING") == 1
        assert not list(runtime.glob("kvrelay-*")), "the internal socket directory is removed"
    finally:
        for c in consumers:
            await c.stop()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
        await engine.stop()


async def _serves(port: int, timeout: float = 30.0) -> None:
    """``GetRelayInfo`` through the public port succeeds within ``timeout`` (scaled)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        try:
            async with Channel("127.0.0.1", port) as probe:
                async with asyncio.timeout(scaled(2)):
                    await relay_info(probe)
            return
        except Exception:
            assert time.monotonic() < deadline, "no worker serves the public port"
            await asyncio.sleep(0.2)


async def test_a_lost_internal_socket_is_listened_on_again_for_a_restarted_worker(
    tmp_path: Path,
) -> None:
    """The internal socket's directory is removed at runtime (a cleaner of ``runtime_dir``),
    then the worker dies: the daemon listens on a new internal socket before the restart, and
    the new worker serves. Before, every restarted worker waited for a socket that was gone
    (120 s, then again with backoff): nothing accepted on the public port, ``/healthz`` 200."""
    engine = SimEngine(SimConfig(name="e0", seed=17, capacity_blocks=64))
    await engine.start()
    assert engine.grpc_port is not None
    cfg = _config(tmp_path / "kvrelay.toml", engine.grpc_port, extra="workers = 2\n")
    proc, notes, runtime = await _serve_notified(tmp_path, cfg)
    try:
        port = _grpc_port(await notes.wait_for("READY=1", timeout=120))
        [worker] = _workers(proc.pid)
        [lost] = list(runtime.glob("kvrelay-*"))
        shutil.rmtree(lost)
        os.kill(worker, signal.SIGKILL)
        await eventually(lambda: _workers(proc.pid) not in ([], [worker]),
                         what="worker restarted", timeout=30)  # fmt: skip
        await _serves(port)
        [new] = list(runtime.glob("kvrelay-*/ingest.sock"))
        assert new.parent != lost
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), scaled(20))
        stderr = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
        assert rc == 0, stderr[-3000:]
        assert '"internal_socket_lost"' in stderr
        assert not list(runtime.glob("kvrelay-*")), "every internal directory is removed"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
        await engine.stop()


async def test_the_public_port_opens_only_when_a_worker_serves(tmp_path: Path) -> None:
    """With ``workers = 2`` the daemon listened on the public port before starting any worker:
    connections were accepted and left unanswered for about a second (a health check with a
    short deadline timed out) where a single process refuses them. The worker is held
    (SIGSTOP) as soon as it runs, before it could serve: the port must refuse connections
    until it goes on, then serve."""
    engine = SimEngine(SimConfig(name="e0", seed=19, capacity_blocks=64))
    await engine.start()
    assert engine.grpc_port is not None
    port = free_port()
    cfg = _config(tmp_path / "kvrelay.toml", engine.grpc_port, extra="workers = 2\n")
    cfg.write_text(cfg.read_text().replace('bind = "127.0.0.1:0"', f'bind = "127.0.0.1:{port}"', 1))
    proc, notes, _ = await _serve_notified(tmp_path, cfg)
    held: int | None = None
    try:
        deadline = time.monotonic() + scaled(120)
        while not (found := _workers(proc.pid)):  # the worker's interpreter starts: hold it
            assert proc.returncode is None and time.monotonic() < deadline, "no worker started"
            await asyncio.sleep(0.005)
        held = found[0]
        os.kill(held, signal.SIGSTOP)
        for _ in range(5):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=scaled(2)).close()
            await asyncio.sleep(0.1)
        os.kill(held, signal.SIGCONT)
        held = None
        assert _grpc_port(await notes.wait_for("READY=1", timeout=120)) == port
        await _serves(port)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), scaled(20))
        stderr = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
        assert rc == 0, stderr[-3000:]
    finally:
        if held is not None:
            os.kill(held, signal.SIGCONT)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
        await engine.stop()


def _listening(folder: Path) -> list[str]:
    """The UNIX sockets listening under ``folder`` in this network namespace (a socket's bound
    path stays listed after the file is removed)."""
    out = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()  # Num RefCount Protocol Flags Type St Inode Path
        if len(f) >= 8 and f[7].startswith(f"{folder}/") and int(f[3], 16) & 0x10000:
            out.append(f[7])
    return out


async def test_a_replaced_internal_socket_is_closed_once_no_worker_uses_it(
    tmp_path: Path,
) -> None:
    """The internal directory is removed and the worker dies: the front listens on a new
    internal socket for the restart, and closes the one it replaced, whose only worker is gone
    (no worker can reach its path again). Before, every replaced server listened on, with its
    directory's lock, until the daemon stopped: one listener and two descriptors per loss."""
    from kvrelay.contract.limits import RelayLimits
    from kvrelay.ops.front import WorkerFront
    from tests.support.mem_relay import MemRelayView
    from tests.support.mirror_rig import QUIET_WINDOW_MS

    runtime = tmp_path / "run"
    runtime.mkdir()
    cfg = load_config(_config(tmp_path / "w.toml", 1, f'workers = 2\nruntime_dir = "{runtime}"'))
    view = MemRelayView(RelayLimits(), window_ms=QUIET_WINDOW_MS)
    view.add_pool("p0", 1024)
    front = WorkerFront(cfg, view, start_timeout_s=scaled(60))
    await front.start()
    try:
        sup = front.supervisor
        assert sup is not None
        [lost] = list(runtime.glob("kvrelay-*"))
        assert _listening(lost) == [str(lost / "ingest.sock")]
        shutil.rmtree(lost)
        [worker] = sup.pids
        assert worker is not None
        os.kill(worker, signal.SIGKILL)
        await eventually(lambda: sup.restarts == 1 and sup.alive == 1,
                         what="worker restarted", timeout=scaled(60))  # fmt: skip
        assert front.internal_rebinds == 1
        await eventually(lambda: not _listening(lost), what="the replaced socket closed")
        [new] = list(runtime.glob("kvrelay-*"))
        assert _listening(new) == [str(new / "ingest.sock")]
    finally:
        await front.stop(2.0)
    assert not list(runtime.glob("kvrelay-*")) and not _listening(runtime)


def test_check_config_validates_workers_and_mirror(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('[relay]\ndc_name = "d"\nworkers = 0\n\n[[pools]]\nnamespace = "n"\n'
                 'component = "c"\nendpoint = "e"\n[[pools.engines]]\nname = "e0"\n'
                 'grpc_port = 1\n')  # fmt: skip
    r = kvrelay("check-config", str(f))
    assert r.returncode == 2 and "error: relay.workers: must be in 1..256, got 0" in r.stdout
    f.write_text(f.read_text().replace("workers = 0", "workers = 3"))
    r = kvrelay("check-config", str(f))
    assert r.returncode == 0 and "3 processes" in r.stdout, r.stdout
    r = kvrelay("check-config", str(f), env=clean_env(KVRELAY_RELAY_WORKERS="2"))
    assert r.returncode == 0 and "2 processes" in r.stdout
    # a runtime directory too long for the internal socket's path: refused before any start
    raw = tomllib.loads(f.read_text())
    for base, refused in (("/run/" + "r" * 73, False), ("/run/" + "r" * 74, True)):
        cfg, problems = parse_config(raw, env={"RUNTIME_DIRECTORY": base})
        found = [p for p in problems if p.severity == "error" and p.path == "relay.runtime_dir"]
        assert bool(found) == refused and (cfg is None) == refused, problems
    assert "may have at most 78 bytes" in found[0].reason
    m = tmp_path / "m.toml"
    m.write_text('[mirror]\nupstream = "relay.dc-b:50161"\ntls_cert = "/nonexistent.crt"\n\n'
                 '[[pools]]\nnamespace = "n"\n')  # fmt: skip
    r = kvrelay("check-config", str(m))
    assert r.returncode == 2
    for line in ("error: pools: a mirror has no [[pools]]",
                 "error: mirror.tls_key: tls_cert and tls_key go together",
                 "error: mirror.tls_cert: file '/nonexistent.crt' does not exist"):  # fmt: skip
        assert line in r.stdout, r.stdout
    m.write_text('[mirror]\nupstream = "10.1.2.3:50161"\n')
    r = kvrelay("check-config", str(m))
    assert r.returncode == 0 and "mirror of 10.1.2.3:50161 (plaintext)" in r.stdout
    assert "warning: mirror.upstream: plaintext gRPC to non-loopback upstream" in r.stdout
    r = kvrelay("check-config", str(m), env=clean_env(KVRELAY_MIRROR_UPSTREAM="bad"))
    assert r.returncode == 2 and "mirror.upstream" in r.stdout


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


async def test_kvrelay_mirror_with_tls_both_ways(tmp_path: Path) -> None:
    """``kvrelay mirror --workers 2`` in front of an mTLS relay, its worker serving mTLS: READY,
    an exact replica through mirror and worker, clean SIGTERM. Its flags win over the
    ``KVRELAY_*`` variables of their keys, which the Kubernetes pod sets (they won before). Its
    ``/metrics`` shows the expiry of the certificates it uses upstream, and reload outcomes
    (``kvrelay reload`` reads them; a mirror had neither). Its worker gets the client CRL: a
    client it revokes is refused at the worker's handshake, counted on the mirror's page."""
    pki = make_pki(tmp_path)
    cca = (pki.client_ca, tmp_path / "client-ca.key")
    gone = make_leaf(tmp_path, "router-gone", cca, server=False)
    crl = make_crl(tmp_path, "clients", cca, [gone[0]])
    engine = SimEngine(SimConfig(name="t0", seed=16, capacity_blocks=64))
    await engine.start()
    relay, upstream = await start_relay(make_settings([engine]), ssl=server_ssl_context(
        str(pki.server_cert), str(pki.server_key), str(pki.client_ca)))  # fmt: skip
    conf = tmp_path / "mirror.toml"
    conf.write_text(f"""
[mirror]
upstream = "localhost:{upstream.port}"
tls_ca = "{pki.server_ca}"
tls_cert = "{pki.client_cert}"
tls_key = "{pki.client_key}"

[tls]
cert = "{pki.server_cert}"
key = "{pki.server_key}"
client_ca = "{pki.client_ca}"
client_crl = "{crl}"

[logging]
format = "json"
""")
    notes = Notifications(tmp_path / "notify.sock")
    metrics_port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "mirror", "--config", str(conf),
        "--bind", "127.0.0.1:0", "--metrics-bind", f"127.0.0.1:{metrics_port}", "--workers", "2",
        env=clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"),
                      KVRELAY_RELAY_BIND="127.0.0.1:1", KVRELAY_RELAY_WORKERS="1",
                      KVRELAY_METRICS_ENABLED="true", KVRELAY_METRICS_BIND="127.0.0.1:2"),
        cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    consumer: Consumer | None = None
    try:
        ready = await notes.wait_for("READY=1", timeout=60)
        m = re.search(r"serving gRPC on 127\.0\.0\.1:(\d+), mirror of localhost:\d+, "
                      r"1 fan-out worker", ready)  # fmt: skip
        assert m, ready
        page = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics_port}/metrics")
        for role in ("server", "client_ca", "upstream_ca", "upstream_client"):
            assert f'kvrelay_tls_certificate_expiry_timestamp_seconds{{role="{role}"' in page, role
        assert 'kvrelay_config_reloads_total{result="applied"} 0.0' in page
        assert 'kvrelay_tls_client_crl_next_update_timestamp_seconds{issuer="client-ca"}' in page
        revoked = client_ssl_context(str(pki.server_ca), str(gone[0]), str(gone[1]))
        served = False
        with contextlib.suppress(Exception):  # refused at the handshake, however it shows
            async with Channel("127.0.0.1", int(m.group(1)), ssl=revoked) as ch:
                await asyncio.wait_for(pb.KvEventRelayStub(ch).get_relay_info(
                    pb.RelayInfoRequest(contract_marker=MARKER)), scaled(10))  # fmt: skip
                served = True
        assert not served, "a revoked client was served"
        refused = 'kvrelay_tls_revoked_connections_total{stage="handshake"} 1.0'
        deadline = time.monotonic() + scaled(15)
        while refused not in page and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            page = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics_port}/metrics")
        assert refused in page
        ctx = client_ssl_context(str(pki.server_ca), str(pki.client_cert), str(pki.client_key))
        async with Channel("127.0.0.1", int(m.group(1)), ssl=ctx) as ch:
            await wait_live(relay, 1)
            consumer = await _consumer(ch)
            await engine.step(6)
            await eventually(lambda: in_sync([engine], relay), what="relay = ground truth")
            gen = relay.pools[0].generation
            assert gen is not None
            gen.flush()
            await eventually(lambda: consumer.replica.sequence == gen.sequence,
                             what="replica at the producer's sequence")  # fmt: skip
            assert np.array_equal(consumer.replica.table, gen.pool.table)
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), scaled(20))
            assert rc == 0, (await proc.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
            assert (await consumer.wait_end()).status is None
    finally:
        if consumer is not None:
            await consumer.stop()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
        await upstream.close(grace_s=1.0)
        await relay.stop()
        await engine.stop()


async def _pool_snapshot(ch: Channel, producer: pb.ProducerIdentity) -> pb.FilterUpdate:
    """The first frame of a subscription (its snapshot chunk); the stream is then left."""
    async with asyncio.timeout(30):
        async with ch.request("/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool",
                              Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest,
                              pb.FilterUpdate) as st:  # fmt: skip
            await st.send_message(pb.SubscribeKvPoolRequest(
                subscriber_id="hop", expected_producer=producer, contract_marker=MARKER),
                end=True)  # fmt: skip
            fu = await st.recv_message()
            await st.cancel()
    assert fu is not None
    return fu


async def test_more_pools_than_hubs_are_served_behind_two_workers(tmp_path: Path) -> None:
    """Three pools, ``max_initialized_pool_hubs = 2``, ``workers = 2``: the worker mirrors two,
    and a router subscribing to the third (then to each again) is served, because the worker
    evicts its idle mirrored pool as the relay evicts an idle hub (before: RESOURCE_LIMIT for
    ever). Counted in ``kvrelay_mirror_pools_evicted_total``."""
    engines = [SimEngine(SimConfig(name=f"h{i}", seed=30 + i, capacity_blocks=64))
               for i in range(3)]  # fmt: skip
    for e in engines:
        await e.start()
    metrics_port = free_port()
    pools = "".join(f"""
[[pools]]
namespace = "ns"
component = "c{i}"
endpoint = "generate"
expected_blocks = 1024

[[pools.engines]]
name = "h{i}"
grpc_port = {e.grpc_port}
""" for i, e in enumerate(engines))  # fmt: skip
    cfg = tmp_path / "kvrelay.toml"
    cfg.write_text(f"""
[relay]
dc_name = "dc-ops"
bind = "127.0.0.1:0"
discovery_interval_s = 0.2
discovery_timeout_s = 1.0
workers = 2

[relay.limits]
max_initialized_pool_hubs = 2

[metrics]
bind = "127.0.0.1:{metrics_port}"

[logging]
format = "json"
{pools}""")
    proc, notes, _runtime = await _serve_notified(tmp_path, cfg)
    try:
        try:
            ready = await notes.wait_for("READY=1", timeout=120)
        except AssertionError:
            proc.kill()
            raise AssertionError((await proc.stderr.read()).decode()[-3000:]) from None  # type: ignore[union-attr]
        async with Channel("127.0.0.1", _grpc_port(ready)) as ch:
            producers: list[pb.ProducerIdentity] = []

            async def listed() -> bool:
                upd = await first_matching(
                    ch, "WatchKvPoolCatalog",
                    pb.WatchKvPoolCatalogRequest(subscriber_id="c", contract_marker=MARKER),
                    pb.KvPoolCatalogUpdate, lambda u: True,
                )  # fmt: skip
                assert upd.snapshot is not None
                producers[:] = [d.producer for d in upd.snapshot.pools if d.producer]
                return len(producers) == 3

            for _ in range(200):
                if await listed():
                    break
                await asyncio.sleep(0.1)
            assert len(producers) == 3, producers
            for _round in range(2):
                for producer in reversed(producers):  # the last listed is not mirrored yet
                    fu = await _pool_snapshot(ch, producer)
                    assert int(fu.kind) == int(pb.FilterUpdateKind.SNAPSHOT_CHUNK)
                    assert bytes(fu.producer) == bytes(producer)
        text = ""
        for _ in range(50):  # STATS reach the supervisor once a second
            text = await _metrics(metrics_port)
            got = re.search(r'^kvrelay_mirror_pools_evicted_total\{worker="1"\} (\d+)', text, re.M)
            if got and int(got.group(1)) >= 2:
                break
            await asyncio.sleep(0.2)
        assert got and int(got.group(1)) >= 2, text[-3000:]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 20)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
        for e in engines:
            await e.stop()


def test_a_logging_reload_reaches_running_and_later_workers(tmp_path: Path) -> None:
    """``[logging]`` applies at once: the supervisor's LOGGING line reconfigures a running
    worker, and a worker started later (a restart) gets the new level in its spec. Workers kept
    the level they started with."""
    import logging

    from kvrelay.logging import configure
    from kvrelay.ops.config import LoggingConfig
    from kvrelay.ops.front import WorkerFront
    from kvrelay.ops.worker import LOGGING_LINE, WorkerControl

    cfg = load_config(_config(tmp_path / "w.toml", 1, "workers = 2"))
    front = WorkerFront(cfg, view=None)
    front.path = str(tmp_path / "ingest.sock")
    assert front._spec(1).log_level == cfg.logging.level.upper()
    front.set_logging(LoggingConfig(level="debug", format="console"))
    spec = front._spec(1)
    assert (spec.log_level, spec.log_json) == ("DEBUG", False)
    try:
        WorkerControl().line(LOGGING_LINE + json.dumps({"level": "WARNING", "json": True}))
        assert logging.getLogger().level == logging.WARNING
        WorkerControl().line(LOGGING_LINE + "{not json")  # kept as it was, logged
        assert logging.getLogger().level == logging.WARNING
    finally:
        configure(level="INFO")
