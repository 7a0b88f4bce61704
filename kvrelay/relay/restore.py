"""A pool's side of the state handover: from a restored state file to vouched members, and
back to the members a clean stop saves.

``handover.py`` reads and writes the file; this holds what one pool does with it while it runs:
the file's pool is used by the first materialization only if it was saved under the identity the
engines now give; each restored member then waits for its engine to vouch for it (the saved
incarnation, a replay holding the last applied batch) within ``RESTORE_VOUCH_S``, and is reset
otherwise. Every discarded or unverified state is counted and logged.

Until every restored member is vouched for and caught up with its engine's replay, or reset
(``awaiting``), the generation is not published: routers never see blocks nobody vouched for,
nor the saved state while the batches its engine published since are still being applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvrelay.ingest.sink import SourceKey
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.logging import get_logger
from kvrelay.pool.pool import Pool
from kvrelay.relay.engines import EngineState, PoolIdentity
from kvrelay.relay.generation import Generation
from kvrelay.relay.handover import RESTORE_VOUCH_S, MemberResume, RestoredPool
from kvrelay.relay.settings import PoolSpec
from kvrelay.relay.stats import PoolCounters

__all__ = ["PoolRestore"]

_log = get_logger("kvrelay.relay.pool_runtime")  # the events keep the logger they had


def _incarnation(st: EngineState | None) -> str | None:
    """The incarnation the engine's Control names now; None when unknown (no answer yet, or
    unreachable: ``resume_for`` decides once it answers)."""
    snap = None if st is None else st.snapshot
    return snap.instance_id if snap is not None and snap.reachable else None


class PoolRestore:
    """One pool's restored state: the file not yet used, then the members not yet vouched."""

    __slots__ = ("_counters", "_deadline", "_gen", "_pending", "_position", "_since", "_vouching",
                 "file")

    def __init__(self, counters: PoolCounters) -> None:
        self._counters = counters
        #: A state file's contents, used by the first materialization if the identity matches.
        self.file: RestoredPool | None = None
        self._pending: dict[SourceKey, MemberResume] = {}  # restored members not yet resumed
        #: Restored members whose subscriber resumed and waits for the vouch → its deadline.
        self._vouching: dict[SourceKey, float] = {}
        #: When the file's state was saved (``MemberResume.since``): what a save of a member
        #: still in ``_vouching`` carries.
        self._since: float | None = None
        #: Each of those members' next sequence when its deadline was set (a replay applying
        #: batches past it is catching up, not silent: ``overdue``).
        self._position: dict[SourceKey, int] = {}
        self._deadline = 0.0
        #: The generation built on the file's pool: the saved positions belong to its state only.
        self._gen: Generation | None = None

    def take_pool(
        self, spec: PoolSpec, ident: PoolIdentity, name: str
    ) -> tuple[Pool, dict[SourceKey, MemberResume]] | None:
        """The state file's pool, if it was saved under this identity (consumed either way)."""
        r, self.file = self.file, None
        if r is None:
            return None
        why = None
        if r.identity != ident:
            why = f"saved for {r.identity!r}, the engines now give {ident!r}"
        else:
            try:
                return r.pool(spec), dict(r.members)
            except Exception as exc:  # arrays that do not make a consistent pool: not trusted
                why = f"unloadable: {type(exc).__name__}: {exc}"
        self._counters.restores_discarded += 1
        _log.warning("state_discarded", pool=name, why=why)
        return None

    def begin(
        self,
        gen: Generation,
        resume: dict[SourceKey, MemberResume],
        by_worker: Mapping[int, EngineState],
        now: float,
    ) -> None:
        """``gen`` was built on the restored pool: members saved without a resume point (nothing
        applied, a rebuild under way) or of engines no longer configured hold nothing the relay
        can vouch for; nor do those whose engine Control already names another incarnation (it
        restarted while the relay was down): all are cleared now. The others wait for their
        engine until ``RESTORE_VOUCH_S`` from ``now``.

        Why at once: a restarted engine may come back with fewer DP ranks, and a saved rank it
        no longer has never gets a source to be reset by (``resume_for``); it kept the whole
        generation unpublished until ``expire``, 5 s without the pool in the catalog."""
        restarted = {
            k for k, r in resume.items()
            if _incarnation(by_worker.get(k.worker_id)) not in (None, r.incarnation)
        }  # fmt: skip
        for wid, rank in list(gen.pool.members().values()):
            key = SourceKey(wid, rank)
            if key in resume and wid in by_worker and key not in restarted:
                continue
            if wid in by_worker:
                gen.reset_member(key)
                if key in restarted:
                    self._counters.reset("incarnation")
            else:
                gen.remove_member(key)
        self._pending = {
            k: r for k, r in resume.items() if k.worker_id in by_worker and k not in restarted
        }
        self._vouching, self._position = {}, {}
        self._since = min((r.since for r in resume.values() if r.since is not None), default=None)
        self._deadline = now + RESTORE_VOUCH_S
        self._gen = gen

    def resume_for(
        self, key: SourceKey, gen: Generation, by_worker: Mapping[int, EngineState],
        at: float = 0.0,
    ) -> MemberResume | None:
        """The restored position (and learned group kinds) to resume ``key`` from, if its
        engine is the incarnation that was saved; otherwise its restored state is dropped
        before a fresh start. Only for the generation built on the file's pool: a position
        resumed on any other would skip the events that built the state it no longer has."""
        if gen is not self._gen:
            return None
        r = self._pending.pop(key, None)
        if r is None:
            return None
        st = by_worker.get(key.worker_id)
        now = "" if st is None or st.snapshot is None else st.snapshot.instance_id
        if now != r.incarnation:
            gen.reset_member(key)
            self._counters.reset("incarnation")
            return None
        self._counters.members_resumed += 1
        self._vouching[key] = at + RESTORE_VOUCH_S
        self._position[key] = r.last_seq + 1
        return r

    def abandon(self, gen: Generation, name: str) -> None:
        """``gen`` is retired (a fence, a withdrawal, a reload): if it was built on the file's
        pool, its members still waiting or resumed are not vouched for (their state went with
        it; the next generation starts them from replay), and nothing is awaited any more."""
        if gen is not self._gen:
            return
        self._gen = None
        left = len(self._pending) + len(self._vouching)
        self._pending, self._vouching, self._position = {}, {}, {}
        if left:
            for _ in range(left):
                self._counters.reset("restore_unverified")
            _log.warning("state_members_unverified", pool=name, members=left)

    def carry(self, old: Generation, fresh: Generation) -> None:
        """``fresh`` holds ``old``'s exact state (a refilter): the file's positions belong to it
        now, and its members still waiting go on waiting there."""
        if old is self._gen:
            self._gen = fresh

    @property
    def awaiting(self) -> bool:
        """Restored members neither vouched for and caught up nor reset yet: the generation stays
        unpublished."""
        return bool(self._pending or self._vouching)

    def settled(self, key: SourceKey) -> bool:
        """``key`` was vouched for (and its replay applied), reset or stopped; True when that was
        the last one awaited (the generation may be published now)."""
        self._position.pop(key, None)
        if self._vouching.pop(key, None) is None and self._pending.pop(key, None) is None:
            return False
        return not self.awaiting

    def overdue(
        self, now: float, position: Callable[[SourceKey], int | None] = lambda _k: None
    ) -> list[SourceKey]:
        """Resumed members whose vouch has not come in time (forgotten here: the caller restarts
        their subscribers, which resets them). ``position``: a member's next sequence now; one
        that moved on since its deadline was set is applying the replay after its vouch (a
        crash's checkpoint is up to an interval behind): it gets another ``RESTORE_VOUCH_S``
        instead (a replay that stalls ends by its own timeout, which resets the member)."""
        late = []
        for k, t in list(self._vouching.items()):
            if now < t:
                continue
            pos = position(k)
            if pos is not None and pos > self._position.get(k, pos):
                self._vouching[k], self._position[k] = now + RESTORE_VOUCH_S, pos
                continue
            late.append(k)
            del self._vouching[k]
            self._position.pop(k, None)
        return late

    def due(self, now: float) -> bool:
        """Restored members are still waiting and their time is up."""
        return bool(self._pending) and now >= self._deadline

    def expire(self, gen: Generation | None, name: str) -> None:
        """Restored members whose engine never offered a source to vouch for them: cleared."""
        pending, self._pending = self._pending, {}
        for key in pending:  # (members already resumed wait for their own vouch: ``overdue``)
            if gen is not None:
                gen.reset_member(key)
            self._counters.reset("restore_unverified")
        _log.warning("state_members_unverified", pool=name, members=len(pending))

    def members_to_save(
        self, subs: Mapping[SourceKey, Subscriber], by_worker: Mapping[int, EngineState]
    ) -> list[MemberResume]:
        """Where each member stands for a clean stop's state file: restored members not yet
        vouched for unchanged, and each stopped subscriber's resume point (with its time in the
        restored file while it still awaits its vouch: ``MemberResume.since``)."""
        members = list(self._pending.values())
        for key, sub in subs.items():
            point = sub.resume_point()
            st = by_worker.get(key.worker_id)
            if point is None or st is None:
                continue
            # the last incarnation Control named: during an outage of Control alone (its ZMQ
            # stream live, the state exact) the current snapshot names none, and saving that
            # would reset the member at the restore though the same engine can vouch for it
            known = st.last_good or st.snapshot
            inc = "" if known is None else known.instance_id
            groups = tuple(sorted(sub.learned_groups().items()))
            since = self._since if key in self._vouching else None
            members.append(MemberResume(key.worker_id, key.dp_rank, st.spec.name, inc,
                                        point[0], point[1], groups, sub.groups_unsure,
                                        since))  # fmt: skip
        return members
