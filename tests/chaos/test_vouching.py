"""Vouching under faults: a restored member whose engine's replay hangs is rebuilt, not kept.

The fleet's history is far longer than its replay buffers, so a member kept without a vouch and
one rebuilt are told apart by what the relay holds; the simulator's ground truth is the oracle
(never a phantom)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

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
