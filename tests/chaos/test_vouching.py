"""Vouching under faults: a restored member whose engine's replay hangs is rebuilt, not kept.

The fleet's history is far longer than its replay buffers, so a member kept without a vouch and
one rebuilt are told apart by what the relay holds; the simulator's ground truth is the oracle
(never a phantom)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvrelay.contract.errors import RelayError
from kvrelay.relay import handover, state_file
from kvrelay.sim.engine import SimEngine
from tests.relay.test_handover import _cfg, _first_run, _live, _relay, _settings
from tests.support.fleet import eventually, ground_truth, relay_view


@pytest.fixture
async def fleet() -> AsyncIterator[list[SimEngine]]:
    engines = [SimEngine(_cfg("vo0", 201)), SimEngine(_cfg("vo1", 202))]
    for e in engines:
        await e.start()
    yield engines
    for e in engines:
        await e.stop()


async def test_a_restored_member_whose_replay_hangs_is_rebuilt(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    fleet[0].mute_replay()  # takes the vouching request, never answers
    async with _relay(fleet, settings) as r:
        await eventually(
            lambda: r.pool.counters.member_resets.get("vouch_timeout", 0) == 2,
            what="vo0's two ranks reset for a vouch that never came", timeout=30,
        )
        assert r.pool.counters.members_vouched == 2  # vo1's ranks
        assert sum(p.stats.replay_unanswered for p in fleet[0].publishers) >= 2
        fleet[0].mute_replay(False)
        await _live(r, 4)
        for e in fleet:
            await e.step(3)
        await _live(r, 4)
        def vo1_exact() -> bool:
            v, t = relay_view(r.relay), ground_truth(fleet)
            return all(v.get(("vo1", k)) == t[("vo1", k)] for k in range(2))

        await eventually(vo1_exact, what="vo1 vouched for and resumed exactly")
        view, truth = relay_view(r.relay), ground_truth(fleet)
        for key, held in view.items():
            assert held <= truth[key], "never a phantom"
        for rank in range(2):
            lost = truth[("vo0", rank)] - view.get(("vo0", rank), set())
            assert lost, "rebuilt from what the engine still offers, not kept from the file"


async def test_restored_members_stay_unpublished_until_their_engine_vouches(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """While any member restored from the file waits for its engine, the generation is not in
    the catalog, readiness or load planes and no pool stream can open on it: routers never see
    blocks nobody vouched for."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    fleet[0].mute_replay()
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.pool.counters.members_resumed == 4, what="resumed")
        gen = r.pool.generation
        assert gen is not None and r.pool.published is None
        assert r.pool.descriptor() is None and r.pool.load_input() is None
        with pytest.raises(RelayError) as err:
            r.relay._live_generation(gen.producer)
        assert err.value.trailer_value.endswith("POOL_NOT_FOUND")
        await eventually(lambda: r.pool.counters.members_vouched == 2, what="vo1 vouched")
        assert r.pool.published is None, "vo0 still waits"
        await eventually(lambda: r.pool.published is not None, timeout=30, what="published")
        assert r.pool.counters.member_resets.get("vouch_timeout") == 2
        assert r.pool.descriptor() is not None
        view, truth = relay_view(r.relay), ground_truth(fleet)
        for key, held in view.items():
            assert held <= truth[key], "never a phantom"


async def test_a_restored_position_never_outlives_its_generation(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """A member restored from the file still waiting for its engine (its Control unreachable at
    the restart) when the restored generation is fenced: its saved position belonged to that
    generation's state. The next generation starts it from replay, counted as unverified, and
    never resumes it as vouched on an empty state."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    await fleet[1].stop_control()
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.pool.generation is not None and len(r.pool.subscribers) == 2,
                         what="vo0 resumed, vo1 still waiting")  # fmt: skip
        gen = r.pool.generation
        assert gen is not None and r.pool.counters.members_resumed == 2
        # vo0's members vouched for first: only vo1's, still waiting, go with the generation
        await eventually(lambda: r.pool.counters.members_vouched == 2, what="vo0 vouched")
        r.pool.fence(gen, "injected")
        await fleet[1].start_control()
        await eventually(lambda: r.pool.generation not in (None, gen), what="rebuilt")
        await _live(r, 4)
        assert r.pool.counters.members_resumed == 2, "vo1 resumed on the rebuilt generation"
        assert r.pool.counters.member_resets.get("restore_unverified") == 2
        assert r.pool.published is not None
        view, truth = relay_view(r.relay), ground_truth(fleet)
        for key, held in view.items():
            assert held <= truth[key], "never a phantom"


async def test_a_refilter_while_restored_members_wait_keeps_them_waiting(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """A refilter (a reload of ``expected_blocks`` or ``ckf_seed``, a scrub divergence) inside
    the vouching window carries the exact state into a new generation, sources running: its
    restored members still wait for their vouch there, and it stays unpublished meanwhile."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    fleet[0].mute_replay()  # vo0's resumed members never get their vouch
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.pool.counters.members_resumed == 4, what="resumed")
        gen = r.pool.generation
        assert gen is not None and r.pool.published is None
        assert r.pool._regenerate(gen, "pool settings changed by a reload", "reload")
        assert r.pool.generation is not gen
        assert r.pool.published is None, "unvouched restored state published"
        assert "restore_unverified" not in r.pool.counters.member_resets
        await eventually(lambda: r.pool.counters.member_resets.get("vouch_timeout", 0) == 2,
                         what="vo0 reset for the vouch that never came", timeout=30)  # fmt: skip
        await eventually(lambda: r.pool.published is not None, timeout=30, what="published")


async def test_a_state_saved_while_its_members_await_their_vouch_keeps_its_age(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """A stop while restored members still wait for their engine (one resumed, its vouch not
    come; one whose Control is down) saves their state as it was read, and the file keeps the
    age it had. It was written as new: carried over such restarts (a relay crash-looping in its
    restore, engines slow to answer) a state looked fresh for ever and ``state_max_age_s`` never
    applied. Once every member is vouched for, the next save is as young as it is."""
    settings = _settings(fleet, tmp_path)
    await _first_run(fleet, settings)
    path = handover.path_for(tmp_path, settings.pools[0])
    parsed = state_file.read(path)
    old = parsed.header["written_unix"] - 100.0
    path.unlink()
    state_file.write(path, {**parsed.header, "written_unix": old}, parsed.arrays)
    fleet[0].mute_replay()  # vo0's ranks resume, their vouch never comes
    await fleet[1].stop_control()  # vo1's ranks wait for their engine
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.pool.counters.members_resumed == 2, what="vo0 resumed")
        assert r.pool.counters.members_vouched == 0
    assert state_file.read(path).header["written_unix"] == old
    fleet[0].mute_replay(False)
    await fleet[1].start_control()
    async with _relay(fleet, settings) as r:
        await eventually(lambda: r.pool.counters.members_vouched == 4, what="all vouched")
        await _live(r, 4)
    assert state_file.read(path).header["written_unix"] > time.time() - 60
