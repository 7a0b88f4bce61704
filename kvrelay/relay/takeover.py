"""A hot upgrade's state hand-over: one live cut of every pool, in the clean stop's file format.

A clean stop saves each pool's exact state and member cursors after its sources stopped
(``handover.py``). A hot upgrade cannot stop them: the running relay keeps ingesting while its
successor starts. So the old process cuts the state *between two batches* on its event loop
(batches are applied whole inside the loop, so the pool's exact state and every member's resume
point agree there), writes it with the same writer into a private directory, and goes on. The
successor reads those files strictly and resumes each member from its cursor once the engine
vouches for it (``PoolRestore``: the same incarnation, a replay that still holds the cut batch
with the same bytes); the engine's replay buffer fills the batches the old process applied after
the cut. A member the engine cannot vouch for is rebuilt, exactly as after a restart.

The cut is taken in a forked child (:func:`cut_aside`, ``relay/forked.py``): the fork is the
instant of the cut for every pool at once, and the child writes while the old process's loop
goes on ingesting and serving, so the hand-over costs the loop the fork (milliseconds), not the
write of every pool's state (about half a second for 10M memberships).

Strict, because there is an alternative: a file the successor cannot use fails the takeover (and
the old process keeps serving), instead of starting the pool from replay as a restart would.
Except a pool the new configuration indexes otherwise (another hash, decode or
``engine_reports`` setting: ``incompatible``): the old state is of no use to it whatever the
hand-over, so it starts from replay, as a reload of that setting would rebuild it, and the
other pools are handed over.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from kvrelay.logging import get_logger
from kvrelay.relay import forked, handover, state_file
from kvrelay.relay.handover import RestoredPool
from kvrelay.relay.pool_runtime import PoolRuntime

_log = get_logger("kvrelay.relay.relay")  # the state_refused event of a start's restore

__all__ = ["CutFailed", "CutSummary", "TakeoverRefused", "cut", "cut_aside", "load"]

#: The successor reads the cut within seconds; anything older is not this hand-over's.
MAX_AGE_S = 600.0


@dataclass(frozen=True, slots=True)
class CutSummary:
    """What one cut wrote: pool names, members with a cursor, bytes."""

    pools: tuple[str, ...]
    members: int
    bytes: int


class CutFailed(Exception):
    """The forked writer of a cut failed (its error text is the message)."""


class TakeoverRefused(Exception):
    """The successor cannot use the hand-over; ``kind`` is the counted reason."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


def cut(
    pools: list[PoolRuntime], directory: Path, written: state_file.Written | None = None
) -> CutSummary:
    """Write each materialized pool's exact state and member cursors into ``directory`` (on the
    event loop, nothing is applied while it runs; or in a forked child's image). Pools without
    a generation are left out: the successor builds them as any start would. ``written`` as
    ``state_file.write``'s."""
    names: list[str] = []
    members = size = 0
    for p in pools:
        gen, ident = p.generation, p.identity
        if gen is None or ident is None:
            continue
        resume = p.restore.members_to_save(p.subscribers, p.by_worker)
        size += handover.save(directory, p.spec, ident, gen.pool, resume, written)
        names.append(p.name)
        members += len(resume)
    return CutSummary(tuple(names), members, size)


async def cut_aside(pools: list[PoolRuntime], directory: Path) -> CutSummary:
    """:func:`cut` in a forked child (call on the event loop, between batches: the fork is the
    cut); the loop goes on while the child writes. ``CutFailed`` when the child fails."""
    if not any(p.generation is not None and p.identity is not None for p in pools):
        return CutSummary((), 0, 0)  # nothing to write (a mirror, or nothing materialized)

    def work() -> str:
        c = cut(pools, directory, forked.give_back)
        return json.dumps({"pools": list(c.pools), "members": c.members, "bytes": c.bytes})

    child = forked.Child(work)
    try:
        ok, text = await asyncio.shield(child.done)
    except asyncio.CancelledError:  # the upgrade was abandoned: no writer outlives it
        child.kill()
        raise
    if not ok:
        raise CutFailed(text)
    try:
        raw = json.loads(text)
        return CutSummary(tuple(raw["pools"]), int(raw["members"]), int(raw["bytes"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CutFailed(f"the writer's report is unreadable: {exc}") from None


def load(pools: list[PoolRuntime], directory: Path) -> dict[str, RestoredPool]:
    """Read (and consume) the cut for every configured pool; a pool without a file is absent
    (the old process had no generation for it), and so is one whose file was saved under
    settings the new configuration changed (it starts from replay). Any other refused file
    refuses the takeover."""
    out: dict[str, RestoredPool] = {}
    for p in pools:
        try:
            r = handover.load(directory, p.spec, max_age_s=MAX_AGE_S)
        except handover.Refused as exc:
            if exc.kind == "incompatible":
                _log.warning("state_refused", pool=p.name, reason=exc.kind, why=str(exc))
                continue
            raise TakeoverRefused(f"state_{exc.kind}", f"pool {p.name}: {exc}") from None
        if r is not None:
            out[p.name] = r
    return out
