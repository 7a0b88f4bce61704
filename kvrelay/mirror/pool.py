"""``MirrorPool``: one upstream pool stream re-served through a local ``PublicationHub``.

Each upstream subscription is checked frame by frame (``checker``). Once its snapshot is
assembled the pool goes live: a local hub starts at the upstream's cut (its chunk payloads seed
the first local snapshot), every upstream delta is applied to the hub's mirror table and its
received bytes are fanned out unchanged, and later joiners get snapshots cut locally from that
table with the upstream's envelope (byte-identical chunks; only ``send_ts_us`` differs).

When the upstream stream ends, the local subscribers end as the contract says for that case:

| upstream stream ended with | local subscribers get |
| --- | --- |
| clean EOF (upstream shut down) | clean EOF (also those waiting for the sync: ``admit``) |
| PUBLICATION_UNAVAILABLE, INTERNAL (fence, withdrawal, oversized) | the same status, message |
| SUBSCRIBER_LAGGED, SNAPSHOT_PROGRESS_TIMEOUT (mirror fell behind) | PUBLICATION_UNAVAILABLE |
| anything else, a silent or lost connection, a frame breaking a rule | PUBLICATION_UNAVAILABLE |

A pool its upstream's catalog no longer lists is *withdrawn* (``withdraw``): it admits nobody more,
and ends for good when its upstream stream ends. A relay publishes a withdrawal before it ends the
pool's streams, so that ending (its status and message) is forwarded as above; an upstream that
keeps the stream open ``WITHDRAWAL_GRACE_S`` longer has it closed by the mirror, whose local
subscribers then get PUBLICATION_UNAVAILABLE, as from a relay that withdraws a pool.

A live pool that ends resubscribes at once (a fresh snapshot) if it was live at least
``rpc.LIVE_RESUBSCRIBE_S`` (the SDK's rule too); one that ended sooner, and an attempt that
fails before its snapshot, back off. POOL_NOT_FOUND / PRODUCER_CHANGED end the pool for good
(the catalog brings the next generation). Subscribers that arrive while an attempt runs wait
for it (bounded by ``sync_wait_s``); one that arrives after a failed attempt gets that
attempt's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.contract.errors import Reason, RelayError
from kvrelay.contract.limits import QUEUE_FRAME_OVERHEAD, RelayLimits
from kvrelay.contract.producer import ProducerKey
from kvrelay.logging import get_logger
from kvrelay.mirror.checker import Installed, PoolStreamChecker, Violation
from kvrelay.mirror.settings import MirrorSettings
from kvrelay.mirror.upstream import BEHIND, FORWARDED, Upstream, upstream_error
from kvrelay.publication import cbi1
from kvrelay.publication.hub import PublicationHub, Subscription
from kvrelay.publication.plane import PlaneEnded
from kvrelay.publication.splice import FilterUpdateEncoder

_log = get_logger(__name__)
#: ``PlaneEnded``'s message for an admission the upstream's drain ended.
DRAINED = "the upstream shut down during admission"
_GONE = frozenset({int(Reason.POOL_NOT_FOUND), int(Reason.PRODUCER_CHANGED)})
VOUCH_SLACK_S = 0.25
#: While local joiners need spacing, the request to the upstream is renewed this often (it
#: lapses upstream after ``relay.HOLD_TTL_S`` = 1 s).
HOLD_RENEW_S = 0.25
#: A spacing request of a mirror of this mirror lapses this long after its last renewal.
HOLD_TTL_S = 1.0
#: How long a live pool its upstream's catalog withdrew is served on for its upstream stream to
#: end (a relay ends it right after publishing the withdrawal: its status is forwarded).
WITHDRAWAL_GRACE_S = 1.0
WITHDRAWN = "pool withdrawn: the upstream's catalog no longer lists it"


class PoolState(enum.Enum):
    SYNCING = "syncing"  # an upstream attempt runs; no local hub yet
    LIVE = "live"  # local hub serving
    FAILED = "failed"  # the last attempt failed before its snapshot; backing off
    GONE = "gone"  # this generation is over (or the mirror stopped it)


@dataclass(frozen=True, slots=True)
class PoolContext:
    """What a pool gets from its mirror (no back-pointer)."""

    settings: MirrorSettings
    upstream: Upstream
    encode_gate: asyncio.Semaphore
    identity: Callable[[], pb.RelayIdentity]
    listed: Callable[[ProducerKey], bool]
    changed: Callable[[MirrorPool], None]
    #: returns once the catalog messages the upstream sent so far are published locally
    catalog_taken: Callable[[], Awaitable[None]]
    #: what resolves when a plane stream of the mirror next takes its first message
    answering: Callable[[], asyncio.Future[None]]

    @property
    def limits(self) -> RelayLimits:
        return self.settings.limits


class MirrorPool:
    """One mirrored generation. Single event loop."""

    def __init__(self, ctx: PoolContext, key: ProducerKey, producer: pb.ProducerIdentity) -> None:
        self.ctx = ctx
        self.key = key
        self.producer = producer
        self.name = f"layout {key.layout_generation} dc {key.dc_id:016x}"
        self.state = PoolState.SYNCING
        self.error: RelayError | None = None
        self.hub: PublicationHub | None = None
        self.first_done = False  # the first attempt reached a snapshot or failed
        self.attempts = 0
        self.installs = 0
        self.deltas = 0
        self.lagged = 0  # local subscribers ended as lagged, over every local hub
        self.ends: Counter[str] = Counter()  # how upstream streams ended (mirror vocabulary)
        self.violations: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._checker: PoolStreamChecker | None = None
        self._last_frame = time.monotonic()
        self._last_sent_us = 0  # the upstream's send stamp of the last frame
        self._heartbeat_s = ctx.settings.upstream_heartbeat_s
        self._spacing: asyncio.Task[None] | None = None  # a spacing request in flight
        self._held = False  # the upstream was last asked for a spacing > 0
        self._asked = 0.0  # the spacing last asked for
        self._hold_renew = 0.0
        self.holds_sent = 0  # spacing requests the upstream granted
        self._waiting = 0  # admissions in progress (waiting for the sync or a snapshot slot)
        self._idle_mark = time.monotonic()  # since when nobody used this pool, between hubs
        self._live_since = 0.0  # when the current hub was installed (monotonic)
        #: set by the next upstream frame or state change: admissions waiting for the sync or
        #: for the upstream to show life again (``_admit``)
        self._life: asyncio.Event | None = None
        self.withdrawn = False  # the upstream's catalog no longer lists this pool
        #: upstream streams that ended cleanly (the upstream drained): an admission waiting
        #: when one did ends cleanly too (``_admit``)
        self._clean_ends = 0
        self._grace: asyncio.TimerHandle | None = None  # ends a withdrawn pool's stream

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kvrelay-mirror-pool-{self.key.layout_generation}"
        )

    def stop(self, error: RelayError | None, why: str = "the mirror stopped this pool") -> None:
        """End this pool now: local subscribers end with ``error`` (None: cleanly); subscribers
        still waiting for it get PUBLICATION_UNAVAILABLE saying ``why``."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._spacing is not None:
            self._spacing.cancel()
            self._spacing = None
        hub, self.hub = self.hub, None
        if hub is not None:
            hub.retire(error)
            self.lagged += hub.lagged
        self._set(PoolState.GONE, error or RelayError.publication_unavailable(why))

    def withdraw(self) -> None:
        """The upstream's catalog no longer lists this pool: admit nobody more, and end for good.
        A live pool's upstream stream is given ``WITHDRAWAL_GRACE_S`` to end (its ending is
        forwarded, as every upstream ending); then the mirror closes it and its local
        subscribers get PUBLICATION_UNAVAILABLE. A pool without a hub ends at once."""
        if self.withdrawn or self.state is PoolState.GONE:
            return
        self.withdrawn = True
        if self.hub is None:  # no local subscriber: an attempt in flight is closed
            self.stop(RelayError.publication_unavailable(WITHDRAWN))
            return
        loop = asyncio.get_running_loop()
        self._grace = loop.call_later(WITHDRAWAL_GRACE_S, self._close_withdrawn)
        self._wake()  # admissions waiting for the upstream to show life are refused now

    def _close_withdrawn(self) -> None:
        """The grace ran out: the upstream keeps serving a pool its catalog withdrew."""
        self._grace = None
        if self.state is PoolState.GONE:
            return
        self.ends["withdrawn"] += 1
        _log.warning("mirror_pool_withdrawn", pool=self.name, grace_s=WITHDRAWAL_GRACE_S)
        self.stop(RelayError.publication_unavailable(WITHDRAWN))

    @property
    def sequence(self) -> int | None:
        return None if self.hub is None else self.hub.sequence

    @property
    def idle_since(self) -> float | None:
        """Since when no local subscriber used this pool (monotonic); None while one does or one
        is being admitted. The mirror evicts the pool idle the longest when it needs room."""
        if self._waiting:
            return None
        hub = self.hub
        return self._idle_mark if hub is None else hub.idle_since

    def _set(self, state: PoolState, error: RelayError | None = None) -> None:
        self.state = state
        self.error = error
        if state is not PoolState.SYNCING:
            self.first_done = True
        if state is PoolState.GONE and self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self._wake()
        self.ctx.changed(self)

    # ------------------------------------------------------------------ admission
    async def admit(
        self, on_release: Callable[[], None] | None, deadline: float
    ) -> Subscription:
        """A local subscription once the pool is live; the failed attempt's error, or
        PUBLICATION_UNAVAILABLE after ``deadline`` (loop time) while still synchronizing.
        Raises ``PlaneEnded`` when the upstream stream ends cleanly meanwhile: the upstream
        drains, and ends its own admissions in progress with status OK (docs/contract.md §4.8); a
        subscriber that comes after gets the attempt's refusal, as a draining relay refuses
        new streams."""
        self._waiting += 1
        try:
            return await self._admit(on_release, deadline)
        finally:
            self._waiting -= 1
            if not self._waiting and self.hub is None:
                self._idle_mark = time.monotonic()

    async def _admit(
        self, on_release: Callable[[], None] | None, deadline: float
    ) -> Subscription:
        loop = asyncio.get_running_loop()
        clean_ends = self._clean_ends

        def drained() -> bool:  # the upstream ended a stream cleanly since this admission began
            return self._clean_ends != clean_ends and not self.withdrawn

        while True:
            if self.withdrawn:
                raise RelayError.publication_unavailable(WITHDRAWN)
            if drained():
                raise PlaneEnded(DRAINED)
            state, hub = self.state, self.hub
            if state in (PoolState.FAILED, PoolState.GONE):
                err = self.error or RelayError.publication_unavailable("pool not mirrored")
                raise RelayError(err.reason, err.message)
            if state is PoolState.LIVE and hub is not None:
                if self._vouch():
                    try:
                        sub = await hub.subscribe(on_release)  # may wait for a snapshot slot
                    except RelayError:
                        if drained():
                            raise PlaneEnded(DRAINED) from None
                        raise
                    if hub.retired or self.withdrawn:
                        sub.close()
                        if drained():
                            raise PlaneEnded(DRAINED)
                        raise RelayError.publication_unavailable(
                            WITHDRAWN if self.withdrawn
                            else "upstream stream ended during admission"
                        )  # fmt: skip
                    return sub
                # the upstream has been quiet past its heartbeat period: what the hub holds is
                # vouched for by nobody (local heartbeats stop too), so no joiner gets it as a
                # snapshot; it waits for the upstream to show life, within its deadline
                why = "the mirror's upstream stream is silent: its state is not vouched for"
            else:
                why = "the mirror is still synchronizing this pool with its upstream"
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RelayError.publication_unavailable(why)
            # one wait for both: the next upstream frame or state change (``_set`` wakes it too)
            if self._life is None:
                self._life = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._life.wait(), remaining)

    def _wake(self) -> None:
        life, self._life = self._life, None
        if life is not None:
            life.set()

    # ------------------------------------------------------------------ upstream
    def _vouch(self) -> bool:
        """A local heartbeat claims the stream is current: only while the upstream stream has
        shown life within 1.5 of its heartbeat periods (+0.25 s of scheduling slack)."""
        return time.monotonic() - self._last_frame <= 1.5 * self._heartbeat_s + VOUCH_SLACK_S

    def _on_frame(self, data: bytes) -> None:
        checker = self._checker
        assert checker is not None
        frame, extra = checker.feed(data)
        now = time.monotonic()
        if isinstance(extra, cbi1.Delta):
            hub = self.hub
            assert hub is not None
            # a local queue counts a frame as its payload + QUEUE_FRAME_OVERHEAD; a forwarded
            # frame may carry more (unknown fields an upstream added): counted as what it holds,
            # so ``publication_queue_bytes`` bounds what a local subscriber keeps queued
            n = max(len(frame.payload), len(data) - QUEUE_FRAME_OVERHEAD)
            hub.publish_encoded(frame.sequence, extra.buckets, extra.words, data, n)
            self.deltas += 1
            if hub.joiners or self._held or hub.holds_requested:
                self._space(hub)
        elif isinstance(extra, Installed):
            self._install(extra)
        elif frame.kind == int(pb.FilterUpdateKind.HEARTBEAT) and self._last_sent_us:
            # heartbeats come after one upstream period of silence: learn the period from the
            # upstream's own send stamps, not from arrivals (a delta and its heartbeat delayed
            # and delivered together would teach a period of nothing, and the stream would be
            # called silent over and over); a stamp going back (its clock stepped) teaches none
            gap_s = (frame.send_ts_us - self._last_sent_us) / 1e6
            if gap_s > 0:
                self._heartbeat_s = min(3600.0, max(0.05, gap_s))
        self._last_frame = now
        self._last_sent_us = frame.send_ts_us
        if self._life is not None:
            self._wake()

    def _space(self, hub: PublicationHub) -> None:
        """Ask the upstream to space its publications while this hub has joiners (or mirrors of
        this mirror ask it to): a mirror forwards the upstream's sequences and cannot space them
        (``service/spacing.py``). For its own joiners it asks for the longest spacing,
        ``snapshot_publication_delay_s``, not the finer estimate a relay computes at every cut:
        its requests reach the upstream a round trip and a renewal late, after deltas already
        in flight (the hub's joiners queue no deltas until their streams begin to send:
        ``late_cut``). Renewed every ``HOLD_RENEW_S`` while needed and at once when the need
        grows by a quarter, ended with 0; one request in flight at most; never again once the
        upstream said it cannot."""
        if self._spacing is not None or not self.ctx.upstream.spacing:
            return
        hold = hub.limits.snapshot_publication_delay_s if hub.joiners else hub.publication_hold()
        now = time.monotonic()
        if hold <= 0.0 and not self._held:
            return
        if hold > 0.0 and self._held and now < self._hold_renew and hold <= 1.25 * self._asked:
            return
        self._held = hold > 0.0
        self._asked = hold
        self._hold_renew = now + HOLD_RENEW_S
        request = rpc.pool_request(self.ctx.upstream.hold_requester, self.producer)
        self._spacing = asyncio.get_running_loop().create_task(self._ask(request, hold))

    async def _ask(self, request: pb.SubscribeKvPoolRequest, hold: float) -> None:
        try:
            if await self.ctx.upstream.hold(request, hold):
                self.holds_sent += 1
        finally:
            self._spacing = None

    def _install(self, snap: Installed) -> None:
        key = self.key
        hub = PublicationHub(
            FilterUpdateEncoder(snap.relay, snap.producer, prefix=snap.prefix),
            seed=key.seed,
            bucket_count=key.bucket_count,
            dc_id=key.dc_id,
            table=snap.table,
            sequence=snap.sequence,
            limits=self.ctx.limits,
            encode_gate=self.ctx.encode_gate,
            cut=snap.chunks,
            vouch=self._vouch,
            late_cut=True,  # its joiners' spacing is asked of the upstream (see _space)
        )
        hub.idle_since = self._idle_mark  # a resubscription is no use of the pool
        self.hub = hub
        self._live_since = time.monotonic()
        self.installs += 1
        self._set(PoolState.LIVE)

    async def _attempt(self) -> tuple[bool, RelayError | None, RelayError | None]:
        """One upstream subscription to its end: (was live, error for local subscribers,
        the upstream's own error if it answered with one)."""
        ctx = self.ctx
        self.attempts += 1
        self._checker = PoolStreamChecker(self.key, ctx.identity())
        self._last_frame = time.monotonic()
        self._last_sent_us = 0
        # each attempt starts from the configured period: what one stream taught is not carried
        # into the next (a period learned wrong would otherwise call every later stream silent)
        self._heartbeat_s = ctx.settings.upstream_heartbeat_s
        request = rpc.pool_request(ctx.settings.subscriber_id, self.producer)
        local: RelayError | None
        answer: RelayError | None = None
        ended: tuple[Any, rpc.StreamEnd] | None = None  # (channel, end): judged once retired
        silence_s = 3 * self._heartbeat_s
        try:
            end, channel = await ctx.upstream.stream(
                "SubscribeKvPool", request, self._on_frame, silence_s=silence_s, follow=True
            )
            ended = channel, end
        except Violation as v:
            self.violations[v.reason] += 1
            self.ends["violation"] += 1
            _log.warning("mirror_upstream_violation", pool=self.name, reason=v.reason,
                         detail=v.detail)  # fmt: skip
            local = RelayError.publication_unavailable(
                f"the mirror refused an upstream frame ({v.reason})"
            )
        except Exception as exc:  # a hub invariant, or a bug here: never a crash
            self.ends["internal"] += 1
            _log.exception("mirror_pool_failed", pool=self.name, error=repr(exc))
            local = RelayError.publication_unavailable(f"mirror failure: {type(exc).__name__}")
        else:
            self.ends[end.reason] += 1
            answer = upstream_error(end)
            if end.reason == E.EOF:
                local = None
                self._clean_ends += 1
            elif answer is not None:
                if int(answer.reason) in FORWARDED:
                    local = answer
                elif int(answer.reason) in BEHIND:
                    local = RelayError.publication_unavailable(
                        f"the mirror fell behind its upstream ({answer.trailer_value})"
                    )
                else:
                    local = RelayError.publication_unavailable(
                        f"upstream ended the stream: {answer.trailer_value}: {answer.message}"
                    )
            elif end.reason == E.SILENT:
                local = RelayError.publication_unavailable("upstream pool stream went silent")
            else:
                local = RelayError.publication_unavailable(
                    f"upstream connection lost ({end.reason}: {end.message})"
                )
        if local is not None and self.hub is not None:
            # a relay ends a pool's streams only after its catalog without the pool: the
            # mirror's catalog may still be parsing that withdrawal (it came first)
            await ctx.catalog_taken()
        hub, self.hub = self.hub, None
        self._checker = None
        if hub is not None:
            self._idle_mark = hub.idle_since or time.monotonic()
            hub.retire(local)
            self.lagged += hub.lagged
        if ended is not None:
            # its heartbeats stopped and nothing else came on the channel either (the connection
            # died with TCP up: streams opened on it again would go silent in turn until
            # grpclib's keepalive closed it, minutes), or only the channel's other streams
            # deliver: was this one's request heard? The silent verdict is reached without
            # suspending, in the same turn as the stream's end; the round trip may take
            # silence_s, so it comes after the local subscribers got their status.
            await ctx.upstream.replace_if_unfit(*ended, silence_s=silence_s, timeout_s=silence_s)
        return hub is not None, local, answer

    async def _run(self) -> None:
        failures = 0
        while True:
            if self.state is not PoolState.SYNCING:
                self._set(PoolState.SYNCING)
            was_live, local, answer = await self._attempt()
            if self._task is None:
                # stopped meanwhile, the stop's cancellation taken by the stream's end (the
                # channel closed under it: a transport error instead): done, not a new attempt
                # (``run_stream`` raises it again; this stays for a grpclib where it cannot:
                # ``CLIENT_CANCEL_NEEDS``)
                return
            if self.withdrawn:  # its ending (if the upstream's) already went to its subscribers
                self._set(PoolState.GONE, answer or local
                          or RelayError.publication_unavailable(WITHDRAWN))  # fmt: skip
                return
            if answer is not None and int(answer.reason) in _GONE:
                # this generation is gone upstream; subscribers still asking get its answer
                self._set(PoolState.GONE, answer)
                return
            if was_live:
                if rpc.lived(time.monotonic() - self._live_since):
                    failures = 0
                    continue  # resubscribe at once: a fresh snapshot for the next subscribers
                failures += 1  # it ended right after its snapshot: back off
                self._set(PoolState.SYNCING)
                await asyncio.sleep(self.ctx.settings.backoff(failures))
                continue
            # the upstream's answer to this key is forwarded (POOL_NOT_FOUND, RESOURCE_LIMIT,
            # ...), but not its verdict that the mirror fell behind: a subscriber waiting here
            # was sent nothing to lag on, and gets the mapped PUBLICATION_UNAVAILABLE (``local``)
            forward = answer is not None and int(answer.reason) not in BEHIND
            refusal = (answer if forward else local) or RelayError.publication_unavailable(
                "upstream ended the stream before its snapshot"
            )
            if not self.ctx.listed(self.key):
                self._set(PoolState.GONE, refusal)
                return
            failures += 1
            self._set(PoolState.FAILED, refusal)
            # (meanwhile its subscribers get ``refusal``: once a plane stream takes a message
            # after this, the upstream answers again, and the pool asks again rather than
            # refusing a listed pool for seconds more)
            await until_answering(self.ctx.answering(), self.ctx.settings.backoff(failures))

    def stats(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "sequence": self.sequence,
            "attempts": self.attempts,
            "installs": self.installs,
            "deltas": self.deltas,
            "holds_sent": self.holds_sent,
            "subscribers": 0 if self.hub is None else self.hub.subscriber_count,
            "lagged": self.lagged + (0 if self.hub is None else self.hub.lagged),
            "ends": dict(self.ends),
            "violations": dict(self.violations),
        }


async def until_answering(answering: asyncio.Future[None], delay: float) -> None:
    """The backoff of a loop whose last stream got nothing (the upstream unreachable,
    restarting, refusing): ``delay``, or less once one of the mirror's plane streams took a
    message since ``answering`` was taken (``PoolContext.answering``: a plane loop takes it as
    its stream starts, a pool when its attempt failed, so that the attempt's waiting subscribers
    get its refusal rather than a retry's outcome). A relay
    that comes back serves everything at once; each of the mirror's loops waiting out its own
    backoff (up to ``backoff_max_s``, 5 s) left it serving the catalog and ``GetRelayInfo``
    while it refused the other planes' readers, and the subscribers of pools its catalog lists,
    for seconds. A loop whose stream did deliver keeps its backoff, so a stream the upstream
    ends after its first message cannot make the others ask again in a loop. (``asyncio.wait``:
    the shared future is never cancelled with a waiter, and a stop's cancellation is never
    swallowed, as Python 3.11's ``wait_for`` may when the future resolves at once.)"""
    if not answering.done():
        await asyncio.wait((answering,), timeout=delay)
