"""State handover across a relay restart (``[relay] state_dir``), over real sockets.

The engines' replay buffers hold far less than their history (``buffer_steps`` 8 against
hundreds of steps), so a relay that restarts from replay alone misses most of what they hold.
With the state file the restarted relay is exact again; every way the file or the fleet can have
changed meanwhile makes it fall back to what a start without a file gives (a subset, never a
phantom), counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import structlog

from kvrelay.relay import checkpoint, handover, state_file
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import eventually, ground_truth, relay_view
from tests.support.rig import Rig, make_settings, start_relay, stop_relay, subscribe, verify
from tests.support.timing import scaled

HISTORY_STEPS = 240
BUFFER_STEPS = 8


def _cfg(name: str, seed: int) -> SimConfig:
    return SimConfig(name=name, seed=seed, dp_size=2, capacity_blocks=4096,
                     buffer_steps=BUFFER_STEPS)  # fmt: skip


@asynccontextmanager
async def _relay(engines: list[SimEngine], settings: RelaySettings) -> AsyncIterator[Rig]:
    relay, server = await start_relay(settings)
    r = Rig(engines, relay, server, settings)
    try:
        yield r
    finally:
        await r.server.close(grace_s=1.0)
        await stop_relay(r.relay)


async def _first_run(engines: list[SimEngine], settings: RelaySettings) -> None:
    """Fill the fleet's history under a relay, then stop it cleanly (which saves the state)."""
    async with _relay(engines, settings) as r:
        await _live(r, 2 * len(engines))  # stepping before would outrun the replay buffer
        for _ in range(HISTORY_STEPS // 8):
            for e in engines:
                await e.step(8)
        await eventually(lambda: _exact(r.relay, engines), what="first run exact")


async def _live(r: Rig, members: int) -> None:
    await eventually(lambda: len(r.pool.subscribers) == members
                     and all(s.state == "live" for s in r.pool.subscribers.values()),
                     what="every member live")  # fmt: skip


def _exact(relay: Relay, engines: list[SimEngine]) -> bool:
    if relay.pools[0].generation is None:
        return False
    truth, view = ground_truth(engines), relay_view(relay)
    return all(view.get(k, set()) == v for k, v in truth.items())


@pytest.fixture
async def fleet() -> AsyncIterator[list[SimEngine]]:
    engines = [SimEngine(_cfg("ho0", 101)), SimEngine(_cfg("ho1", 102))]
    for e in engines:
        await e.start()
    yield engines
    for e in engines:
        await e.stop()


def _settings(engines: list[SimEngine], state_dir: Path, **kw: object) -> RelaySettings:
    return dataclasses.replace(
        make_settings(engines, expected_blocks=16_384), state_dir=str(state_dir), **kw
    )  # type: ignore[arg-type]


async def _rebuilt_subset(
    r: Rig, engines: list[SimEngine]
) -> tuple[dict[object, set[int]], dict[object, set[int]]]:
    """A generation rebuilt without the file, live after more traffic: never a phantom."""
    await eventually(lambda: r.pool.generation is not None, what="rebuilt from replay")
    await _live(r, 2 * len(engines))
    for e in engines:
        await e.step(2)
    await _live(r, 2 * len(engines))
    view, truth = relay_view(r.relay), ground_truth(engines)
    for key, held in view.items():
        assert held <= truth[key], "never a phantom"
    return view, truth  # type: ignore[return-value]


def _lost_without_state(engines: list[SimEngine]) -> int:
    """Held blocks stored before the replay window (what a replay-only restart cannot know)."""
    return sum(len(e.ground_truth(r)) for e in engines for r in range(e.cfg.dp_size))


async def test_a_restart_resumes_every_member_and_is_exact(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    (saved,) = tmp_path.iterdir()
    assert saved.suffix == handover.SUFFIX
    for e in fleet:  # traffic while the relay is down, within the replay window
        await e.step(BUFFER_STEPS // 2)
    async with _relay(fleet, settings) as r, r.channel() as ch:
        await eventually(lambda: _exact(r.relay, fleet), what="exact after the restart")
        pool = r.pool
        assert pool.counters.members_resumed == 4
        assert pool.counters.member_resets == {}, "every member resumed, none rebuilt"
        assert r.relay.state_restores == {"restored": 1}
        assert list(tmp_path.iterdir()) == [saved], "kept until a checkpoint or stop replaces it"
        consumer = await subscribe(r, ch)
        for e in fleet:
            await e.step(4)
        await verify(r, consumer, probes=2_000)
        await consumer.stop()
    assert r.relay.state_saves == {"saved": 1}


async def test_without_a_state_file_a_restart_is_only_a_subset(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """The baseline the handover improves on (and a check that the test can fail)."""
    await _first_run(fleet, _settings(fleet, tmp_path))
    for f in tmp_path.iterdir():
        f.unlink()
    async with _relay(fleet, _settings(fleet, tmp_path)) as r:
        view, truth = await _rebuilt_subset(r, fleet)
        missing = sum(len(truth[k] - view.get(k, set())) for k in truth)
        assert missing > 0.5 * _lost_without_state(fleet), missing
        assert r.relay.state_restores == {"none": 1}


@pytest.mark.parametrize("damage", ["truncated", "flipped", "stale", "other_version"])
async def test_a_damaged_or_unfit_file_is_refused_and_counted(
    fleet: list[SimEngine], tmp_path: Path, damage: str
) -> None:
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    (path,) = tmp_path.iterdir()
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        path.write_bytes(data[:100] + bytes([data[100] ^ 0x10]) + data[101:])
    elif damage == "stale":
        settings = dataclasses.replace(settings, state_max_age_s=1e-3)
    else:
        parsed = state_file.decode(data)
        state_file.write(path, {**parsed.header, "pool_layout": -1}, parsed.arrays)
    kind = {"truncated": "corrupt", "flipped": "corrupt", "stale": "stale",
            "other_version": "version"}[damage]  # fmt: skip
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.relay.state_restores == {kind: 1}, what=kind)
        await _rebuilt_subset(r, fleet)
        assert r.pool.counters.members_resumed == 0


async def test_an_engine_restarted_meanwhile_is_rebuilt_and_the_others_resume(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    await fleet[1].restart()  # new instance_id, seq 0, empty cache
    await fleet[1].step(5)
    async with _relay(fleet, settings) as r:
        await eventually(lambda: _exact(r.relay, fleet), what="exact")
        assert r.pool.counters.members_resumed == 2  # ho0's two ranks
        assert r.pool.counters.member_resets.get("incarnation") == 2


async def test_an_engine_restarted_with_fewer_ranks_meanwhile_does_not_hold_the_pool_back(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """ho0 comes back with one DP rank instead of two (a new incarnation) while the relay is
    down. Its saved rank 1 never gets a source to be reset by: it kept the whole generation
    unpublished (no catalog entry) until the 5 s vouch deadline expired it. Control names the
    new incarnation at the materialization, so both of ho0's members are cleared then; ho1's
    resume, and the pool is published once they are vouched for."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    port = fleet[0].grpc_port
    await fleet[0].stop()
    fleet[0] = SimEngine(dataclasses.replace(_cfg("ho0", 103), dp_size=1, grpc_port=port))
    await fleet[0].start()
    await fleet[0].step(5)
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.pool.published is not None and _exact(r.relay, fleet),
                         what="published and exact")  # fmt: skip
        assert r.pool.counters.members_resumed == 2  # ho1's two ranks
        assert r.pool.counters.member_resets == {"incarnation": 2}, "none left to expire"


async def test_history_gone_while_down_resets_that_member(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    await fleet[0].step(3 * BUFFER_STEPS)  # more than the replay window
    async with _relay(fleet, settings) as r:
        await _live(r, 4)
        await eventually(lambda: _exact_for(r.relay, fleet[1]), what="ho1 resumed exactly")
        resets = r.pool.counters.member_resets
        assert resets.get("gap_unrecoverable", 0) + resets.get("missing_history", 0) >= 1
        view, truth = relay_view(r.relay), ground_truth(fleet)
        for key, held in view.items():
            assert held <= truth[key], "never a phantom"


def _exact_for(relay: Relay, engine: SimEngine) -> bool:
    view, truth = relay_view(relay), ground_truth([engine])
    return all(view.get(k, set()) == v for k, v in truth.items())


@pytest.mark.parametrize("change", ["expected_blocks", "ckf_seed"])
async def test_a_restart_with_another_filter_shape_rebuilds_the_filter_from_the_state(
    fleet: list[SimEngine], tmp_path: Path, change: str
) -> None:
    """The exact state does not depend on the filter's size or seed: the file is used, its
    filter rebuilt from the owners, and every member resumes (nothing rebuilt from replay)."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    value = {"expected_blocks": 65_536, "ckf_seed": 424242}[change]
    pool = dataclasses.replace(settings.pools[0], **{change: value})  # type: ignore[arg-type]
    async with _relay(fleet, dataclasses.replace(settings, pools=(pool,))) as r, \
            r.channel() as ch:  # fmt: skip
        await eventually(lambda: _exact(r.relay, fleet), what="exact under the new filter")
        assert r.relay.state_restores == {"restored": 1}
        await eventually(lambda: r.pool.counters.members_vouched == 4, what="vouched")
        assert r.pool.counters.member_resets == {}
        gen = r.pool.generation
        assert gen is not None and gen.pool.bucket_count == pool.bucket_count
        assert gen.pool.seed == pool.ckf_seed
        consumer = await subscribe(r, ch)
        await verify(r, consumer, probes=2_000)
        await consumer.stop()


@pytest.mark.parametrize("setting", ["cache_salt_namespacing", "engine_reports"])
async def test_another_hash_or_counting_setting_refuses_the_file(
    fleet: list[SimEngine], tmp_path: Path, setting: str
) -> None:
    """``engine_reports`` decides whether a store of a held block was counted as a copy: copy
    counts saved under the other value would keep blocks the engines evicted."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    pool = settings.pools[0]
    if setting == "engine_reports":
        pool = dataclasses.replace(pool, engine_reports=not pool.engine_reports)
    else:
        salts = not pool.decode.cache_salt_namespacing
        decode = dataclasses.replace(pool.decode, cache_salt_namespacing=salts)
        pool = dataclasses.replace(pool, decode=decode)
    async with _relay(fleet, dataclasses.replace(settings, pools=(pool,))) as r:
        assert r.relay.state_restores == {"incompatible": 1}
        await eventually(lambda: r.pool.generation is not None, what="rebuilt")
        assert r.pool.counters.members_resumed == 0


async def test_an_unsafe_state_dir_is_refused_and_counted(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """A directory others can write to is neither read nor written: whoever can write there
    could hand the relay a state it made up."""
    d = tmp_path / "state"
    d.mkdir()
    d.chmod(0o777)
    async with _relay(fleet, _settings(fleet, d)) as r:
        await _live(r, 4)
        assert r.relay.state_restores == {"unsafe_dir": 1}
        assert r.metric("kvrelay_state_restores_total", result="unsafe_dir") == 1
    assert r.relay.state_saves == {"unsafe_dir": 1}
    assert list(d.iterdir()) == []


async def test_an_unusable_state_dir_is_logged_once_a_minute_per_reason(
    fleet: list[SimEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``state_dir_unusable`` went out at every checkpoint round for as long as the
    directory stayed unsafe or could not be made: at a short interval, several error lines a
    second. Now as ``state_checkpoint_failed``: one line per reason a minute, saying how many it
    did not log; each refusal is still counted."""
    d = tmp_path / "state"
    d.mkdir()
    d.chmod(0o777)
    settings = _settings(fleet, d, checkpoint_interval_s=0.05)
    with structlog.testing.capture_logs() as logs:
        async with _relay(fleet, settings) as r:
            saves = r.relay.state_saves
            await eventually(lambda: saves.get("unsafe_dir", 0) >= 5, what="refused rounds")
            d.chmod(0o700)
            d.rmdir()
            d.write_text("")  # a file where the directory should be: cannot be made
            await eventually(lambda: saves.get("unusable_dir", 0) >= 5, what="unusable rounds")
            lines = [e for e in logs if e["event"] == "state_dir_unusable"]
            assert [e["reason"] for e in lines] == ["unsafe_dir", "unusable_dir"], lines
            assert lines[0]["failures_not_logged"] == lines[1]["failures_not_logged"] == 0
            monkeypatch.setattr(checkpoint, "FAILURE_LOG_S", 0.0)  # the minute is up
            await eventually(lambda: sum(e["event"] == "state_dir_unusable" for e in logs) > 2,
                             what="the next line")  # fmt: skip
    third = [e for e in logs if e["event"] == "state_dir_unusable"][2]
    assert third["reason"] == "unusable_dir" and third["failures_not_logged"] >= 4, third
    assert r.relay.state_restores == {"unsafe_dir": 1}
    assert saves["unsafe_dir"] >= 5 and saves["unusable_dir"] >= 6


async def test_a_save_while_only_control_is_down_keeps_the_engines_incarnation(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """Control of ho1 does not answer while its event streams stay live (the state is exact): a
    clean stop then saved the incarnation of its unreachable snapshot, none, and the next start
    reset both its members as another incarnation though the same engine vouches for them. The
    incarnation saved is the last one Control named."""
    settings = dataclasses.replace(_settings(fleet, tmp_path), engine_down_grace_s=600.0)
    async with _relay(fleet, settings) as r:
        await _live(r, 4)
        for _ in range(HISTORY_STEPS // 8):
            for e in fleet:
                await e.step(8)
        await eventually(lambda: _exact(r.relay, fleet), what="first run exact")
        await fleet[1].stop_control()
        st = next(s for s in r.pool.engines.values() if s.spec.name == "ho1")
        await eventually(lambda: st.snapshot is not None and not st.snapshot.reachable,
                         what="ho1's Control unreachable")  # fmt: skip
        await fleet[1].step(2)  # still read from its event stream
        await eventually(lambda: _exact(r.relay, fleet), what="exact without Control")
    await fleet[1].start_control()
    async with _relay(fleet, settings) as r:
        await eventually(lambda: _exact(r.relay, fleet) and r.pool.published is not None
                         and r.pool.counters.members_resumed == 4,
                         what="exact after the restart, every member resumed")  # fmt: skip
        assert r.pool.counters.member_resets == {}, "every member resumed, none rebuilt"


async def test_a_restored_file_stays_until_something_replaces_it(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """A start reads the file, and stops (or crashes) before its pool had a generation again
    (here: no engine's Control answers): the file used to be gone when read, so the next start
    had nothing. It stays until the pool's next checkpoint or stop replaces it, and the next
    start resumes every member from it."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    (saved,) = tmp_path.iterdir()
    for e in fleet:
        await e.stop_control()
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.relay.state_restores.get("restored") == 1, what="read")
        await asyncio.sleep(0.5)
        assert r.pool.generation is None
    assert list(tmp_path.iterdir()) == [saved], "a stop without a generation saves nothing"
    for e in fleet:
        await e.start_control()
    async with _relay(fleet, settings) as r:
        await eventually(lambda: _exact(r.relay, fleet) and r.pool.published is not None
                         and r.pool.counters.members_resumed == 4,
                         what="exact from the kept file, every member resumed")  # fmt: skip
        assert r.pool.counters.member_resets == {}


async def test_the_first_published_state_after_a_restart_is_the_engines_not_the_saved_one(
    tmp_path: Path,
) -> None:
    """The engines went on far past the saved state while the relay was down (a crash's
    checkpoint is up to an interval old; here 600 steps, each a batch of stores and evictions,
    in a 1,024-step replay buffer). The generation used to be published at the vouch itself, while
    the replay after it was still being applied over several loop turns: the first pool routers
    could see held blocks evicted since the save and lacked those stored since. It is published
    once every restored member has caught up, at the engine's state, and nothing is rebuilt."""
    engine = SimEngine(SimConfig(name="lag0", seed=111, dp_size=2, capacity_blocks=256,
                                 buffer_steps=1024))  # fmt: skip
    await engine.start()
    try:
        settings = _settings([engine], tmp_path)
        async with _relay([engine], settings) as r:
            await _live(r, 2)
            await engine.step(64)
            await eventually(lambda: _exact(r.relay, [engine]), what="first run exact")
        for _ in range(600):
            await engine.step(1)
        truth = ground_truth([engine])
        async with _relay([engine], settings) as r:
            deadline = asyncio.get_running_loop().time() + scaled(15.0)
            while r.pool.published is None:  # every loop turn: the first instant it is served
                assert asyncio.get_running_loop().time() < deadline, "never published"
                await asyncio.sleep(0)
            view = relay_view(r.relay)
            stale = sum(len(view.get(k, set()) - v) for k, v in truth.items())
            missing = sum(len(v - view.get(k, set())) for k, v in truth.items())
            assert (stale, missing) == (0, 0), "the first published state is the engine's"
            assert r.pool.counters.members_resumed == 2
            assert r.pool.counters.member_resets == {}, "caught up, none rebuilt"
    finally:
        await engine.stop()


async def test_a_state_saved_under_another_block_size_is_discarded(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """ho0 came back with another ``kv_block_size`` while the relay was down: the file's pool was
    indexed under the old identity, so it is not used (counted), and every member starts from
    its engine's replay: never a phantom."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    for i, e in enumerate(fleet):
        port = e.grpc_port
        await e.stop()
        fleet[i] = SimEngine(dataclasses.replace(_cfg(e.cfg.name, 301 + i), block_size=32,
                                                 grpc_port=port))  # fmt: skip
        await fleet[i].start()
        await fleet[i].step(3)
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.pool.published is not None and _exact(r.relay, fleet),
                         what="exact under the new block size")  # fmt: skip
        assert r.pool.counters.restores_discarded == 1
        assert r.pool.counters.members_resumed == 0
        assert r.pool.identity is not None and r.pool.identity.block_size == 32
