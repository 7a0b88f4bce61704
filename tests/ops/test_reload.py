"""``kvrelay serve`` reloads on SIGHUP and through ``kvrelay reload``, as real processes.

An engine joins by a reload while a router streams the pool: the stream goes on from deltas (no
second snapshot) and the replica gains the new engine's blocks. An invalid file is refused by
``kvrelay reload`` before anything is signalled, and by the daemon itself on a bare SIGHUP, with
``check-config``'s messages; the running configuration stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from grpclib.client import Channel

from benchmarks._common import free_port, free_ports
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.ops.config import load_config
from kvrelay.ops.daemon import Daemon
from kvrelay.ops.reload import ReloadReport, reload_report
from kvrelay.ops.sdnotify import Notifier
from kvrelay.ops.tls import client_ssl_context
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.certs import make_pki
from tests.support.commands import REPO, clean_env
from tests.support.fleet import eventually
from tests.support.notify import Notifications
from tests.support.rig import Consumer, catalog_producer, relay_info
from tests.support.scrape import scrape, total
from tests.support.timing import scaled


def _config(grpc: int, metrics: int, engines: list[SimEngine], extra: str = "") -> str:
    text = f"""
[relay]
dc_name = "dc-reload"
bind = "127.0.0.1:{grpc}"
discovery_interval_s = 0.2
discovery_timeout_s = 1.0
{extra}
[metrics]
bind = "127.0.0.1:{metrics}"

[logging]
format = "json"

[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"
expected_blocks = 4096
"""
    for e in engines:
        text += f'\n[[pools.engines]]\nname = "{e.cfg.name}"\ngrpc_port = {e.grpc_port}\n'
    return text


async def _sources_live(metrics: int, want: int) -> None:
    """Until ``kvrelay_ingest_sources{state="live"}`` on ``/metrics`` reaches ``want``."""
    deadline = asyncio.get_running_loop().time() + scaled(15)
    live = 0.0
    while True:
        with contextlib.suppress(OSError):  # not listening yet
            live = total(await scrape(metrics), "kvrelay_ingest_sources", state="live")
        if live >= want:
            return
        assert asyncio.get_running_loop().time() < deadline, f"{live} of {want} sources live"
        await asyncio.sleep(0.05)


async def _reload_cli(cfg: Path, pid_file: Path, **env: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "reload", "--config", str(cfg), "--pid-file",
        str(pid_file), "--timeout", f"{scaled(20):.0f}", env=clean_env(**env), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), scaled(60))
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_reload_adds_an_engine_without_a_resnapshot_and_refuses_bad_files(
    tmp_path: Path,
) -> None:
    e0 = SimEngine(SimConfig(name="rl0", seed=91, capacity_blocks=128))
    e1 = SimEngine(SimConfig(name="rl1", seed=92, capacity_blocks=128))
    for e in (e0, e1):
        await e.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    cfg.write_text(_config(grpc, metrics, [e0]))
    pid_file = tmp_path / "kvrelay.pid"
    notes = Notifications(tmp_path / "notify.sock")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg), "--pid-file",
        str(pid_file), env=clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock")), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    consumer: Consumer | None = None
    try:
        await notes.wait_for("READY=1")
        assert int(pid_file.read_text()) == proc.pid
        async with Channel("127.0.0.1", grpc) as ch:
            info = await relay_info(ch)
            assert info.relay is not None
            await e0.step(5)
            producer = await catalog_producer(ch)
            consumer = Consumer(ch, producer, info.relay).start()
            await asyncio.wait_for(consumer.first.wait(), scaled(15))

            def holds(engine: SimEngine) -> bool:
                want = sorted(engine.ground_truth(0))
                table = consumer.replica.table if consumer is not None else None
                return bool(want) and table is not None and bool(
                    consumer.replica.contains(want).all()  # type: ignore[union-attr]
                )

            await eventually(lambda: holds(e0), what="e0's blocks in the replica")
            snapshots = consumer.replica.kinds["snapshot"]

            # ---- an engine joins through `kvrelay reload`, run from a shell with a web proxy
            # (which it used for the relay's loopback /metrics: outcome unseen, "not readable")
            cfg.write_text(_config(grpc, metrics, [e0, e1]))
            dead_proxy = f"http://127.0.0.1:{free_port()}"
            proxied = {"http_proxy": dead_proxy, "HTTP_PROXY": dead_proxy, "no_proxy": "",
                       "NO_PROXY": ""}  # fmt: skip
            rc, out = await _reload_cli(cfg, pid_file, **proxied)
            assert rc == 0 and "kvrelay reload: applied" in out, out
            await notes.wait_for("RELOADING=1")
            await notes.wait_for("READY=1", count=2)
            for _ in range(5):
                await e1.step(2)
                await asyncio.sleep(0.1)
            await eventually(lambda: holds(e1), what="the new engine's blocks in the replica")
            assert consumer.end is None, consumer.end
            assert consumer.replica.kinds["snapshot"] == snapshots, "the reload re-snapshotted"
            assert (await catalog_producer(ch)) == producer  # same generation

            # ---- an invalid file: `kvrelay reload` refuses it and signals nothing
            good = cfg.read_text()
            cfg.write_text(good.replace("discovery_interval_s", "discovery_intervall_s"))
            rc, out = await _reload_cli(cfg, pid_file)
            assert rc == 2 and "discovery_intervall_s" in out and "not signalled" in out, out
            report = reload_report("127.0.0.1", metrics)
            assert report is not None
            assert report.counts == {"applied": 1, "rejected": 0, "failed": 0}

            # ---- a bare SIGHUP with that file: the daemon rejects it, keeps running
            proc.send_signal(signal.SIGHUP)
            await eventually(
                lambda: (r := reload_report("127.0.0.1", metrics)) is not None
                and r.counts.get("rejected") == 1,
                what="the daemon counted the rejected reload",
            )
            await notes.wait_for("READY=1", count=3)
            await e0.step(2)
            await e1.step(2)
            await eventually(lambda: holds(e0) and holds(e1), what="state still followed")
            assert consumer.end is None

            # ---- restart-only settings: applied (the rest), and `kvrelay reload` names them
            moved = good.replace(f"127.0.0.1:{grpc}", f"127.0.0.1:{free_port()}")
            cfg.write_text(moved.replace('"dc-reload"', '"dc-moved"'))
            rc, out = await _reload_cli(cfg, pid_file)
            assert rc == 0 and out.strip() == (
                "kvrelay reload: applied; these settings take effect at the next restart: "
                "relay.bind, relay.dc_name"), out  # fmt: skip
            assert total(await scrape(metrics), "kvrelay_config_restart_pending") == 2
            # a moved metrics listener: the file's endpoint is not the relay's yet (said so)
            elsewhere = free_port()
            cfg.write_text(good.replace(f"127.0.0.1:{metrics}", f"127.0.0.1:{elsewhere}"))
            rc, out = await _reload_cli(cfg, pid_file)
            assert rc == 0 and f"metrics endpoint (127.0.0.1:{elsewhere}) is not readable" in out
            assert "outcome is in its log" in out, out
            await eventually(
                lambda: (r := reload_report("127.0.0.1", metrics)) is not None
                and r.restart_pending == ("metrics",),
                what="the moved metrics listener waits for a restart",
            )
            cfg.write_text(good)  # put back: nothing waits any more
            proc.send_signal(signal.SIGHUP)
            await eventually(
                lambda: reload_report("127.0.0.1", metrics)
                == ReloadReport({"applied": 4, "rejected": 1, "failed": 0}, ()),
                what="the reload that put them back cleared them",
            )
            assert consumer.end is None
    finally:
        if consumer is not None:
            await consumer.stop()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), scaled(20))
        await notes.close()
        for e in (e0, e1):
            await e.stop()
    assert proc.returncode == 0
    assert not pid_file.exists(), "the pid file is removed on exit"
    assert proc.stdout is not None and proc.stderr is not None
    lines = (await proc.stdout.read() + await proc.stderr.read()).decode().splitlines()
    events = [json.loads(ln) for ln in lines if ln.startswith("{")]
    rejected = [ev for ev in events if ev.get("event") == "config_reload_rejected"]
    assert len(rejected) == 1
    # the same message check-config prints for that file
    assert any("discovery_intervall_s" in p and p.startswith("error:")
               for p in rejected[0]["problems"])  # fmt: skip
    applied, *_ = [ev for ev in events if ev.get("event") == "config_reloaded"]
    assert applied["engines_added"] == 1 and applied["pools_changed"] == ["ns/backend/generate"]


@pytest.mark.parametrize("workers", [1, 2])
async def test_reload_reads_a_rotated_certificate_for_new_connections(
    tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cert-manager style rotation: new files at the same paths, then SIGHUP (here: reload()).
    With ``workers = 2`` the fan-out worker, which terminates the clients' TLS, reads them too
    (it kept serving the old certificate while the reload said applied)."""
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(old.server_cert, cert)
    shutil.copy(old.server_key, key)
    engine = SimEngine(SimConfig(name="tl0", seed=93, capacity_blocks=32))
    await engine.start()
    cfg_path = tmp_path / "kvrelay.toml"
    cfg_path.write_text(_config(0, 0, [engine], extra=f"workers = {workers}")
                        + f'\n[tls]\ncert = "{cert}"\nkey = "{key}"\n')  # fmt: skip
    daemon = Daemon(load_config(cfg_path), Notifier({}), config_path=cfg_path)

    async def info(ca: Path) -> pb.RelayInfo:
        async with Channel("127.0.0.1", daemon.grpc_port, ssl=client_ssl_context(str(ca))) as c:
            return await asyncio.wait_for(pb.KvEventRelayStub(c).get_relay_info(
                pb.RelayInfoRequest(contract_marker=0x4B565231)), scaled(10))  # fmt: skip

    try:
        await daemon.start()
        assert (await info(old.server_ca)).relay is not None
        shutil.copy(new.server_cert, cert)
        shutil.copy(new.server_key, key)
        before = _expiry(daemon)
        result = await daemon.reload(cfg_path)
        assert result.result == "applied" and result.restart_required == ()
        await _eventually_served(lambda: info(new.server_ca))  # (a worker reads its stdin)
        # the expiry gauge follows the certificate the listener now serves
        assert set(_expiry(daemon)) == {("server", "relay")} and set(before) == set(_expiry(daemon))
        assert [c.not_after_unix for c in daemon.tls_certificates()] == list(
            _expiry(daemon).values()
        )
        with pytest.raises(ssl.SSLCertVerificationError):
            await info(old.server_ca)
        # a key that does not match the certificate: check-config's load rejects the file, and
        # the listener keeps the certificate it had
        shutil.copy(old.server_key, key)
        result = await daemon.reload(cfg_path)
        assert result.result == "rejected" and not daemon.reloads.last_successful
        assert [p.path for p in result.problems] == ["tls.cert"]
        assert (await info(new.server_ca)).relay is not None
        # files that load, in a reload whose later step fails: nothing of it is put in use,
        # neither here nor in the worker (it had the new files before the relay was asked)
        shutil.copy(old.server_cert, cert)
        shutil.copy(old.server_key, key)

        async def broken(_settings: object) -> None:
            raise RuntimeError("injected: the relay cannot take the new pools")

        monkeypatch.setattr(daemon.relay, "reconfigure", broken)
        result = await daemon.reload(cfg_path)
        assert result.result == "failed"
        await asyncio.sleep(0.5)  # a worker would have read a TLS line by now
        assert (await info(new.server_ca)).relay is not None
        with pytest.raises(ssl.SSLCertVerificationError):
            await info(old.server_ca)
    finally:
        await daemon.stop()
        await engine.stop()


async def _eventually_served(call: Callable[[], Awaitable[Any]]) -> None:
    """``call`` succeeds within a few seconds (it may fail with a TLS error until then)."""
    deadline = asyncio.get_running_loop().time() + scaled(10)
    while True:
        try:
            await call()
            return
        except ssl.SSLError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def _expiry(daemon: Daemon) -> dict[tuple[str, str], float]:
    """``kvrelay_tls_certificate_expiry_timestamp_seconds`` as the daemon's registry serves it."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(daemon.metrics.render().decode()):
        if fam.name == "kvrelay_tls_certificate_expiry_timestamp_seconds":
            for s in fam.samples:
                out[(s.labels["role"], s.labels["subject"])] = s.value
    return out


def _fingerprints(table: np.ndarray | None) -> int:
    """Occupied slots of a CKF table (four 16-bit fingerprints per bucket, 0 = empty)."""
    return -1 if table is None else int(np.count_nonzero(table.view(np.uint16)))


async def test_systemctl_restart_under_traffic_keeps_the_filter_complete(tmp_path: Path) -> None:
    """SIGTERM under traffic, a new process on the same state_dir: its first snapshot already
    holds every block the engines hold, though their replay buffers (8 steps) are far shorter
    than their history, and the relay identity is new."""
    engines = [SimEngine(SimConfig(name=f"rs{i}", seed=94 + i, dp_size=2, capacity_blocks=4096,
                                   buffer_steps=8)) for i in range(2)]  # fmt: skip
    for e in engines:
        await e.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    state = tmp_path / "state"
    cfg.write_text(_config(grpc, metrics, engines, extra=f'state_dir = "{state}"'))
    env = clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    pid_file = tmp_path / "kvrelay.pid"

    logs: list[Path] = []

    async def serve() -> asyncio.subprocess.Process:
        logs.append(tmp_path / f"relay{len(logs)}.log")
        with logs[-1].open("wb") as log:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg), "--pid-file",
                str(pid_file), env=env, cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=log,
            )  # fmt: skip

    def truth() -> list[int]:
        return sorted(h for e in engines for r in range(2) for h in e.ground_truth(r))

    async def complete(ch: Channel) -> tuple[pb.RelayInfo, Consumer]:
        info = await relay_info(ch)
        assert info.relay is not None
        consumer = Consumer(ch, await catalog_producer(ch), info.relay).start()
        await asyncio.wait_for(consumer.first.wait(), scaled(15))
        return info, consumer

    notes = Notifications(tmp_path / "notify.sock")
    traffic: asyncio.Task[None] | None = None
    procs: list[asyncio.subprocess.Process] = []
    try:
        procs.append(await serve())
        await notes.wait_for("READY=1")
        # READY=1 follows the bind, not the sources' first replay: history made before a source
        # has caught up is history an 8-step buffer no longer holds (the relay resets the member,
        # rightly, and the replica can never be full)
        await _sources_live(metrics, 4)
        async with Channel("127.0.0.1", grpc) as ch:
            first, consumer = await complete(ch)
            for _ in range(30):  # 240 steps of history
                for e in engines:
                    await e.step(8)
            want = truth()
            try:
                await eventually(lambda: bool(consumer.replica.contains(want).all()), what="full")
            except AssertionError:
                raise AssertionError(logs[0].read_text()[-6000:]) from None
            await consumer.stop()

        async def steady() -> None:
            # steps while the old process drains and the new one starts; fewer than the replay
            # buffer holds, so the engines can vouch for every restored member however slow
            # the restart is (a longer outage is the reset the handover tests cover)
            for _ in range(6):
                for e in engines:
                    await e.step(1)
                await asyncio.sleep(0.1)

        traffic = asyncio.create_task(steady())  # under traffic from here on
        procs[0].send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(procs[0].wait(), scaled(20)) == 0
        procs.append(await serve())
        await notes.wait_for("READY=1", count=2)
        traffic.cancel()
        async with Channel("127.0.0.1", grpc) as ch:
            second, consumer = await complete(ch)
            assert second.relay is not None and first.relay is not None
            assert second.relay.relay_incarnation != first.relay.relay_incarnation
            want = truth()
            # every held block, and nothing else: one fingerprint per distinct held block
            await eventually(lambda: bool(consumer.replica.contains(want).all())
                             and _fingerprints(consumer.replica.table) == len(set(want)),
                             what="a filter equal to the engines' caches")  # fmt: skip
            await consumer.stop()
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'kvrelay_state_restores_total{result="restored"} 1.0' in text
        assert ('kvrelay_pool_members_resumed_total{pool="ns/backend/generate"} 4.0' in text), [
            ln for ln in text.splitlines() if "resum" in ln or "member_resets" in ln]

        # ---- a forced exit (a second signal during the stop; held back while the process is
        # stopped, so both arrive together) takes its pid file along: left, it named a pid
        # `kvrelay reload`/`upgrade` would signal once the system gave it to another process
        assert int(pid_file.read_text()) == procs[1].pid
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGINT, signal.SIGCONT):
            procs[1].send_signal(sig)
        assert await asyncio.wait_for(procs[1].wait(), scaled(20)) == 1
        assert '"forced_exit"' in logs[1].read_text()
        assert not pid_file.exists(), "the forced exit left the pid file"
    finally:
        if traffic is not None:
            traffic.cancel()
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                await asyncio.wait_for(p.wait(), scaled(20))
        await notes.close()
        for e in engines:
            await e.stop()



@pytest.mark.parametrize("workers", [1, 2])
async def test_reload_changes_which_pools_each_client_sees(tmp_path: Path, workers: int) -> None:
    """``[[authorization]]`` through the daemon (and, with ``workers = 2``, through its fan-out
    worker): team A sees the pool, team B does not; a reload swaps them. A's open catalog stream
    is re-sent without the pool (same revision), and its pool stream ends as a withdrawn pool's."""
    from grpclib.const import Cardinality, Status
    from grpclib.exceptions import GRPCError

    from tests.support.certs import make_leaf
    from tests.support.mem_relay import grpclib_collect, sub_request

    pki = make_pki(tmp_path)
    cca = (pki.client_ca, tmp_path / "client-ca.key")
    a = make_leaf(tmp_path, "team-a", cca, server=False,
                  sans=("URI:spiffe://cluster.local/ns/team-a/sa/router",))  # fmt: skip
    b = make_leaf(tmp_path, "team-b", cca, server=False, sans=("DNS:router.team-b.svc",))
    engine = SimEngine(SimConfig(name="az0", seed=95, capacity_blocks=32))
    await engine.start()
    tls = (f'\n[tls]\ncert = "{pki.server_cert}"\nkey = "{pki.server_key}"\n'
           f'client_ca = "{pki.client_ca}"\n')  # fmt: skip
    (tmp_path / "run").mkdir()
    extra = f'workers = {workers}\nruntime_dir = "{tmp_path / "run"}"\n'

    def rules(a_sees: str, b_sees: str) -> str:
        return (f'\n[[authorization]]\nuri = ["spiffe://cluster.local/ns/team-a/*"]\n'
                f'namespaces = ["{a_sees}"]\n'
                f'\n[[authorization]]\ndns = ["router.team-b.svc"]\n'
                f'pools = ["{b_sees}"]\n')  # fmt: skip

    cfg_path = tmp_path / "kvrelay.toml"
    base = _config(0, 0, [engine], extra=extra) + tls
    cfg_path.write_text(base + rules("ns", "other/x/y"))
    daemon = Daemon(load_config(cfg_path), Notifier({}), config_path=cfg_path)

    def channel(cert: tuple[Path, Path]) -> Channel:
        ctx = client_ssl_context(str(pki.server_ca), str(cert[0]), str(cert[1]))
        return Channel("127.0.0.1", daemon.grpc_port, ssl=ctx)

    async def pools_seen(cert: tuple[Path, Path]) -> int:
        async with channel(cert) as ch:
            request = pb.WatchKvPoolCatalogRequest(subscriber_id="t", contract_marker=0x4B565231)
            res = await grpclib_collect(
                ch, "WatchKvPoolCatalog", request, pb.KvPoolCatalogUpdate, limit=1
            )
            assert res.status is None
            snap = res.messages[0].snapshot
            return 0 if snap is None else len(snap.pools)

    svc = "/dynamo.kvrelay.v1.KvEventRelay/"
    try:
        await daemon.start()
        assert (daemon.front is not None) == (workers > 1)  # the worker serves these clients
        ch_a = channel(a)
        producer = await catalog_producer(ch_a)  # team A sees the pool once it materializes
        assert await pools_seen(b) == 0
        async with channel(b) as ch_b:
            hidden = await grpclib_collect(ch_b, "SubscribeKvPool", sub_request(producer, "b"),
                                           pb.FilterUpdate, limit=1)  # fmt: skip
        assert hidden.status == Status.NOT_FOUND

        def denials() -> float:  # from the worker's reports when it serves the clients
            from prometheus_client.parser import text_string_to_metric_families

            return sum(s.value for fam in text_string_to_metric_families(
                daemon.metrics.render().decode()) if fam.name == "kvrelay_authorization_denials"
                for s in fam.samples if s.labels.get("rpc") == "SubscribeKvPool")  # fmt: skip

        await eventually(lambda: denials() == 1, what="the denial counted")
        async with (
            ch_a.request(svc + "WatchKvPoolCatalog", Cardinality.UNARY_STREAM,
                         pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate) as cat,
            ch_a.request(svc + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                         pb.SubscribeKvPoolRequest, pb.FilterUpdate) as pool,
        ):  # fmt: skip
            await cat.send_message(pb.WatchKvPoolCatalogRequest(
                subscriber_id="a", contract_marker=0x4B565231), end=True)  # fmt: skip
            first = await cat.recv_message()
            assert first is not None and first.snapshot is not None and first.snapshot.pools
            await pool.send_message(sub_request(producer, "a"), end=True)
            assert await asyncio.wait_for(pool.recv_message(), scaled(20)) is not None
            cfg_path.write_text(base + rules("other", "ns/backend/*"))
            result = await daemon.reload(cfg_path)
            assert result.result == "applied"
            again = await asyncio.wait_for(cat.recv_message(), scaled(20))
            assert again is not None and again.revision == first.revision
            assert again.snapshot is None or not again.snapshot.pools
            await cat.cancel()
            with pytest.raises(GRPCError) as ended:
                async with asyncio.timeout(scaled(20)):
                    while await pool.recv_message() is not None:
                        pass
                    await pool.recv_trailing_metadata()
            assert ended.value.status == Status.UNAVAILABLE
        assert await pools_seen(b) == 1
        ch_a.close()
    finally:
        await daemon.stop()
        await engine.stop()


async def test_a_mirror_reloads_its_rules_live_and_nothing_else(tmp_path: Path) -> None:
    """A mirror daemon applies new ``[[authorization]]`` rules live; a key it cannot take live
    keeps its running value and is named as restart-required, as a relay's are (the rest of
    the file still applies: ``tests/ops/test_mirror_tls_reload.py``)."""
    from kvrelay.service.server import RelayServer
    from tests.support.certs import make_leaf
    from tests.support.mem_relay import MemRelayView, grpclib_collect
    from tests.support.mirror_rig import QUIET_WINDOW_MS

    pki = make_pki(tmp_path)
    a = make_leaf(tmp_path, "team-a", (pki.client_ca, tmp_path / "client-ca.key"), server=False,
                  sans=("URI:spiffe://cluster.local/ns/team-a/sa/router",))  # fmt: skip
    view = MemRelayView(window_ms=QUIET_WINDOW_MS)
    view.add_pool("p1", 4096)  # serving endpoint ns/c/e
    upstream = RelayServer(view)
    await upstream.start("127.0.0.1", 0)
    text = f"""
[relay]
bind = "127.0.0.1:0"

[metrics]
bind = "127.0.0.1:0"

[mirror]
upstream = "127.0.0.1:{upstream.port}"

[tls]
cert = "{pki.server_cert}"
key = "{pki.server_key}"
client_ca = "{pki.client_ca}"

[[authorization]]
uri = ["spiffe://cluster.local/ns/team-a/*"]
namespaces = ["NS"]
"""
    cfg_path = tmp_path / "mirror.toml"
    cfg_path.write_text(text)
    daemon = Daemon(load_config(cfg_path), Notifier({}), config_path=cfg_path)

    async def seen() -> int:
        ctx = client_ssl_context(str(pki.server_ca), str(a[0]), str(a[1]))
        async with Channel("127.0.0.1", daemon.grpc_port, ssl=ctx) as ch:
            request = pb.WatchKvPoolCatalogRequest(subscriber_id="a", contract_marker=0x4B565231)
            res = await grpclib_collect(
                ch, "WatchKvPoolCatalog", request, pb.KvPoolCatalogUpdate, limit=1
            )
        snap = res.messages[0].snapshot
        return 0 if snap is None else len(snap.pools)

    try:
        await daemon.start()
        assert daemon.relay is None  # a mirror
        assert await seen() == 0  # globs are case-sensitive: "NS" is not "ns"
        cfg_path.write_text(text.replace('namespaces = ["NS"]', 'namespaces = ["n?"]'))
        result = await daemon.reload(cfg_path)
        assert result.result == "applied"
        assert await seen() == 1
        cfg_path.write_text(text.replace('namespaces = ["NS"]', 'namespaces = ["n?"]')
                            .replace('[mirror]', '[mirror]\nsync_wait_s = 3.0'))  # fmt: skip
        result = await daemon.reload(cfg_path)
        assert result.result == "applied" and result.restart_required == ("mirror.sync_wait_s",)
        # what ``config_reloaded`` logs: the daemon's restart-only settings too (it had none)
        assert result.summary["restart_required"] == ["mirror.sync_wait_s"]
        assert daemon.cfg.mirror is not None and daemon.cfg.mirror.sync_wait_s == 10.0
        assert await seen() == 1
    finally:
        await daemon.stop()
        await upstream.close(grace_s=0.5)
