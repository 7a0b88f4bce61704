"""grpclib discovery client for vLLM's ``vllm.Control`` service (vLLM >= 0.27).

Every RPC has a timeout and maps failures to the typed errors in ``errors.py``. A reply the
engine should not send is an ``InvalidReply``, counted by kind: one whose length prefix claims
more than ``MAX_REPLY_BYTES`` is refused before its body is read (grpclib's own reader buffered
whatever the prefix claimed: 900 MiB in the two seconds of one call); then, before betterproto2
parses it, ``wirescan.scan`` walks its wire format and refuses one that is broken
(``undecodable``) or holds more than ``MAX_LIST_ENTRIES`` entries in a list (adapters, aliases,
sources) or more than ``FIELD_BUDGET`` fields in all (``implausible``), reading at most that many
fields whatever the reply's size: 1 MiB of empty LoRA entries had cost 2.2 s of CPU per poll to
parse before it was refused for its count, 1 MiB of unknown fields 20 s. A reply that passes
and does not parse is ``undecodable`` too. Replies over ``DECODE_ON_LOOP_BYTES`` are scanned and
decoded in a worker thread (parsing the largest valid reply takes up to ~0.15 s).
``GetKvEventSources`` falls back to ``vllm.KvTransfer/GetKvEventSources`` on UNIMPLEMENTED.
Returned endpoints have wildcard hosts replaced by the host used to reach the engine.
Parallelism an engine cannot have (``MAX_PARALLEL``) fails its snapshot: the relay builds one
structure per declared rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import betterproto2
import grpclib.const
import grpclib.exceptions
from grpclib.encoding.base import CodecBase

from kvrelay._aio import bounded
from kvrelay._grpc import GuardedChannel, UndecodableReply, effective_status, recv_reply
from kvrelay._proto import vllm as vpb
from kvrelay.discovery.endpoints import (
    SourceInfo,
    StaticSourceConfig,
    static_sources,
    substitute_wildcard,
)
from kvrelay.discovery.errors import (
    DiscoveryError,
    DiscoveryTimeout,
    EngineUnreachable,
    InvalidEndpoint,
    InvalidReply,
    KvSourcesUnsupported,
    RpcFailed,
)
from kvrelay.discovery.snapshot import EngineSnapshot, LoraEntry
from kvrelay.discovery.wirescan import WireRefusal, scan, shape_of

KV_TRANSFER_SOURCES_PATH = "/vllm.KvTransfer/GetKvEventSources"
T = TypeVar("T")
M = TypeVar("M", bound=betterproto2.Message)


#: The largest Control reply read (a ServerInfo is a few hundred bytes; 1 MiB holds thousands
#: of LoRA adapters). Judged from the length prefix, before any of the body is buffered.
MAX_REPLY_BYTES = 1024 * 1024
#: Replies larger than this are scanned and decoded in a worker thread (betterproto2 takes
#: microseconds per field: the largest reply the scan lets through would hold the loop ~0.15 s).
DECODE_ON_LOOP_BYTES = 4096
#: The most data-parallel ranks (or tensor/pipeline degree) an engine may declare.
MAX_PARALLEL = 4096
#: The most entries one list of a Control reply may hold: LoRA adapters or model aliases (each
#: becomes a catalog entry), KV event sources.
MAX_LIST_ENTRIES = 4096
#: Every reply type ``EngineClient`` reads; each is scanned before it is parsed.
REPLY_TYPES: tuple[type[betterproto2.Message], ...] = (
    vpb.ServerInfo, vpb.ModelInfo, vpb.GetKvEventSourcesResponse, vpb.ListLorasResponse,
    vpb.IsSleepingResponse, vpb.IsPausedResponse)  # fmt: skip
#: The most fields (nested and unknown ones included) a Control reply may hold: the most any
#: valid reply type holds (4,096 sources of 10 fields, each with its own tag: 45,056), plus one
#: field per list entry for fields a newer vLLM adds or an encoder repeats: 49,152. The scan
#: reads at most this many; a reply that passes parses in ~0.15 s at worst.
FIELD_BUDGET = (
    max(shape_of(t, MAX_LIST_ENTRIES).most_fields for t in REPLY_TYPES) + MAX_LIST_ENTRIES
)


def _decode(data: bytes, reply_type: type[M]) -> M:
    """The reply, once its wire format passed ``scan`` (``WireRefusal`` otherwise)."""
    scan(data, shape_of(reply_type, MAX_LIST_ENTRIES), MAX_LIST_ENTRIES, FIELD_BUDGET)
    return reply_type.parse(data)


class _RawReplies(CodecBase):
    """Requests: betterproto2 messages to bytes. Replies: the bytes as received (length-checked
    by ``recv_reply`` before they are read), decoded by ``EngineClient._unary``."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return message if isinstance(message, bytes) else bytes(message)

    def decode(self, data: bytes, message_type: Any) -> bytes:
        return data


class EngineClient:
    """Client for one engine frontend. Use as ``async with EngineClient(host, port) as c``."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = 2.0,
        static: StaticSourceConfig | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.static = static
        self.address = f"{host}:{port}"
        self._channel = GuardedChannel(host, port, codec=_RawReplies())

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _invalid(self, what: str, detail: str, kind: str) -> InvalidReply:
        return InvalidReply(self.address, f"{what}: {detail}", kind)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            # outer bound covers connection setup too, which grpclib's timeout may not
            return await bounded(fn(), self.timeout + 0.5)
        except InvalidReply:
            raise
        except grpclib.exceptions.GRPCError as exc:
            status = effective_status(exc.status, exc.message)  # grpclib's UNIMPLEMENTED
            if status is grpclib.const.Status.UNAVAILABLE:
                raise EngineUnreachable(self.address, f"{what}: {exc.message}") from exc
            if status is grpclib.const.Status.DEADLINE_EXCEEDED:
                raise DiscoveryTimeout(self.address, f"{what}: deadline exceeded") from exc
            raise RpcFailed(self.address, f"{what}: {exc.message or ''}", status.name) from exc
        except TimeoutError as exc:
            raise DiscoveryTimeout(self.address, f"{what}: timed out") from exc
        except (
            OSError,
            grpclib.exceptions.StreamTerminatedError,
            grpclib.exceptions.ProtocolError,
        ) as exc:
            flood = self._channel.take_flood()
            if flood is not None:  # the connection was closed for it: the engine's doing
                raise self._invalid(what, f"the server sent a {flood}", "flood") from exc
            raise EngineUnreachable(self.address, f"{what}: {exc!r}") from exc
        except Exception as exc:  # whatever else the reply made grpclib raise: typed
            raise self._invalid(what, f"bad reply: {exc!r}", "undecodable") from exc

    async def _unary(self, path: str, request: betterproto2.Message, reply_type: type[M]) -> M:
        """One unary call whose reply is judged by its length prefix before it is read, then
        by its wire format (``_decode``), in a worker thread when it is large."""
        what = path.rsplit("/", 1)[-1]
        async with self._channel.request(
            path, grpclib.const.Cardinality.UNARY_UNARY, type(request), bytes,
            timeout=self.timeout,
        ) as stream:  # fmt: skip
            await stream.send_message(request, end=True)
            try:
                data = await recv_reply(stream, MAX_REPLY_BYTES)
            except grpclib.exceptions.GRPCError as exc:
                if exc.status is not grpclib.const.Status.RESOURCE_EXHAUSTED:
                    raise
                raise self._invalid(what, exc.message or "reply too large", "too_large") from None
            except UndecodableReply as exc:
                raise self._invalid(what, str(exc), "undecodable") from None
        if data is None:
            raise self._invalid(what, "no reply message", "undecodable")
        try:
            if len(data) > DECODE_ON_LOOP_BYTES:
                return await asyncio.to_thread(_decode, data, reply_type)
            return _decode(data, reply_type)
        except WireRefusal as exc:
            raise self._invalid(what, str(exc), exc.kind) from None
        except Exception as exc:  # betterproto2 raises EOFError, ValueError, KeyError, ...
            raise self._invalid(what, f"bad reply: {exc!r}", "undecodable") from None

    # ---- RPCs ----
    async def server_info(self) -> vpb.ServerInfo:
        return await self._call("GetServerInfo", lambda: self._unary(
            "/vllm.Control/GetServerInfo", vpb.GetServerInfoRequest(), vpb.ServerInfo))  # fmt: skip

    async def model_info(self) -> vpb.ModelInfo:
        return await self._call("GetModelInfo", lambda: self._unary(
            "/vllm.Control/GetModelInfo", vpb.GetModelInfoRequest(), vpb.ModelInfo))  # fmt: skip

    async def list_loras(self) -> tuple[LoraEntry, ...]:
        resp = await self._call("ListLoras", lambda: self._unary(
            "/vllm.Control/ListLoras", vpb.ListLorasRequest(), vpb.ListLorasResponse))  # fmt: skip
        return tuple(LoraEntry(a.lora_id, a.lora_name, a.source_path) for a in resp.adapters)

    async def is_sleeping(self) -> bool:
        r = await self._call("IsSleeping", lambda: self._unary(
            "/vllm.Control/IsSleeping", vpb.IsSleepingRequest(), vpb.IsSleepingResponse))
        return bool(r.sleeping)

    async def is_paused(self) -> bool:
        r = await self._call("IsPaused", lambda: self._unary(
            "/vllm.Control/IsPaused", vpb.IsPausedRequest(), vpb.IsPausedResponse))  # fmt: skip
        return bool(r.paused)

    async def kv_event_sources_raw(self) -> tuple[vpb.GetKvEventSourcesResponse, str]:
        """Sources as returned by the engine plus which service answered."""
        try:
            resp = await self._call(
                "GetKvEventSources",
                lambda: self._unary("/vllm.Control/GetKvEventSources",
                                    vpb.GetKvEventSourcesRequest(), vpb.GetKvEventSourcesResponse),
            )
            return resp, "control"
        except RpcFailed as exc:
            if exc.status != "UNIMPLEMENTED":
                raise
        try:
            resp = await self._call("KvTransfer.GetKvEventSources", lambda: self._unary(
                KV_TRANSFER_SOURCES_PATH, vpb.GetKvEventSourcesRequest(),
                vpb.GetKvEventSourcesResponse))  # fmt: skip
            return resp, "kv_transfer"
        except RpcFailed as exc:
            if exc.status == "UNIMPLEMENTED":
                raise KvSourcesUnsupported(
                    self.address, "GetKvEventSources not served", exc.status
                ) from exc
            raise

    async def kv_event_sources(self) -> tuple[tuple[SourceInfo, ...], str]:
        """Connectable sources (wildcards substituted), sorted by DP rank, and the origin."""
        resp, via = await self.kv_event_sources_raw()
        out: list[SourceInfo] = []
        for i, s in enumerate(resp.sources):
            if s.transport and s.transport != "zmq":
                continue  # only ZMQ publishers are consumable
            try:
                ep = substitute_wildcard(s.endpoint, self.host)
                rep = (
                    substitute_wildcard(s.replay_endpoint, self.host) if s.replay_endpoint else None
                )
            except InvalidEndpoint as exc:
                raise RpcFailed(self.address, f"bad source endpoint: {exc}", "INVALID") from exc
            rank = s.data_parallel_rank if s.data_parallel_rank is not None else i
            out.append(
                SourceInfo(
                    dp_rank=rank,
                    endpoint=ep,
                    replay_endpoint=rep,
                    topic=s.topic,
                    transport=s.transport or "zmq",
                    encoding=s.encoding or "msgpack",
                    schema_version=s.schema_version,
                    buffer_steps=s.buffer_steps,
                    hwm=s.hwm,
                    max_queue_size=s.max_queue_size,
                    advertised_endpoint=s.endpoint,
                )
            )
        return tuple(sorted(out, key=lambda x: x.dp_rank)), via

    async def _optional(self, fn: Callable[[], Awaitable[T]], fallback: T) -> tuple[T, bool]:
        """(value, known): an optional RPC that fails (UNIMPLEMENTED on an older vLLM, a timeout,
        any error) is unknown this time, never a reason to call the engine unreachable."""
        try:
            return await fn(), True
        except DiscoveryError:
            return fallback, False

    def _check_parallelism(self, info: vpb.ServerInfo) -> None:
        par = info.parallelism or vpb.ParallelismInfo()
        sizes = (par.data_parallel_size, par.data_parallel_size_local, par.tensor_parallel_size,
                 par.pipeline_parallel_size)  # fmt: skip
        if max(sizes) > MAX_PARALLEL or par.data_parallel_rank >= MAX_PARALLEL:  # a rank < size
            raise self._invalid("GetServerInfo", f"implausible parallelism {sizes}", "implausible")

    async def snapshot(self, previous: EngineSnapshot | None = None) -> EngineSnapshot:
        """Full snapshot; never raises for network/RPC failures (``reachable=False`` instead).

        ``ListLoras``, ``IsSleeping`` and ``IsPaused`` are optional: when one fails its value is
        taken from ``previous`` (the last reachable snapshot; defaults without one) and its name
        is listed in ``unknown``.
        """
        prev = previous if previous is not None and previous.reachable else None
        try:
            info = await self.server_info()
            self._check_parallelism(info)
            model = await self.model_info()
            try:
                sources, via = await self.kv_event_sources()
            except KvSourcesUnsupported:
                if self.static is not None:
                    sources, via = static_sources(self.static, self.host), "static"
                else:
                    sources, via = (), "none"
            ranks = [s.dp_rank for s in sources]
            if len(ranks) > MAX_PARALLEL or len(set(ranks)) != len(ranks):
                raise self._invalid("GetKvEventSources", f"{len(ranks)} sources with "
                                    f"{len(set(ranks))} distinct ranks", "implausible")  # fmt: skip
            if ranks and max(ranks) >= MAX_PARALLEL:  # a DP rank is below the DP size
                raise self._invalid("GetKvEventSources", f"DP rank {max(ranks)} (ranks are "
                                    f"below {MAX_PARALLEL})", "implausible")  # fmt: skip
        except DiscoveryError as exc:
            return EngineSnapshot(host=self.host, port=self.port, reachable=False, error=str(exc))
        unknown: list[str] = []
        loras, ok = await self._optional(self.list_loras, prev.loras if prev else ())
        if not ok:
            unknown.append("loras")
        sleeping, ok = await self._optional(self.is_sleeping, prev.sleeping if prev else False)
        if not ok:
            unknown.append("sleeping")
        paused, ok = await self._optional(self.is_paused, prev.paused if prev else False)
        if not ok:
            unknown.append("paused")
        par = info.parallelism or vpb.ParallelismInfo()
        return EngineSnapshot(
            host=self.host,
            port=self.port,
            reachable=True,
            engine_version=info.engine_version,
            api_version=info.api_version,
            instance_id=info.instance_id,
            data_parallel_size=par.data_parallel_size or 1,
            data_parallel_rank=par.data_parallel_rank,
            # unset by a ``ParallelismInfo`` of the older numbering (its field 7 did not exist):
            # the ranks this frontend publishes for are its local ones
            data_parallel_size_local=par.data_parallel_size_local
            or len({s.dp_rank for s in sources}) or 1,
            tensor_parallel_size=par.tensor_parallel_size or 1,
            pipeline_parallel_size=par.pipeline_parallel_size or 1,
            max_model_len=info.max_model_len,
            kv_block_size=info.kv_block_size,
            total_kv_blocks=info.total_kv_blocks,
            max_running_requests=info.max_running_requests,
            max_batched_tokens=info.max_batched_tokens,
            max_loras=info.max_loras,
            model_id=model.model_id,
            served_model_name=model.served_model_name,
            served_model_aliases=tuple(model.served_model_aliases),
            loras=loras,
            sources=sources,
            sources_via=via,
            sleeping=sleeping,
            paused=paused,
            unknown=frozenset(unknown),
        )
