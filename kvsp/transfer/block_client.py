"""Block retrieval, storage and leases at holders (spec §6.1 "the index is advisory", §6.6, §6.7).

:class:`BlockClient` is the one client an instance gets blocks with. :meth:`BlockClient.get_block`
GETs a block over the bulk path (:mod:`kvsp.transfer.bulk`) and verifies it while it arrives
(:mod:`kvsp.transfer.verify`), or hands a ``moqt://`` replica to its MOQT client
(:class:`~kvsp.transfer.moqt_client.MoqtBlockClient`, DESIGN.md §4). :meth:`BlockClient.fetch`
is the one walk over a block's replicas: in the order given, a 404, a broken or slow
connection, a malformed body or a digest mismatch means "try the next one" (§6.1), and
``None`` when all fail (the caller recomputes). :class:`FetchStats` keeps each attempt's
octets and seconds so that an instance can estimate its link rate to each holder (§6.3
``links``). Stores (``If-None-Match: *``) and leases (§6.6) are plain HTTP requests on the
same connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import httpx

from kvsp import sha256x2
from kvsp.audience import AudienceSigner, lease_base_allowed
from kvsp.container import Container, Geometry, header_fields, header_size
from kvsp.container_reader import LayerSink
from kvsp.errors import (
    BadRequest,
    DigestMismatch,
    Incompatible,
    KVSPError,
    RemoteError,
    UnsupportedHolder,
    UnvouchedOrigin,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord, loads
from kvsp.transfer.buffers import BufferPool
from kvsp.transfer.bulk import DEFAULT_TIMEOUT_S, BulkClient, BulkResponse, split_url
from kvsp.transfer.http11 import Buffer, BytesBody, ResponseHead
from kvsp.transfer.verify import (
    DEFAULT_HASHING,
    BlockPlan,
    Hashing,
    VerifiedBlock,
    VerifyingBody,
    plan_block,
)
from kvsp.transfer.verify_slices import SLICE_STEP, SliceBody
from kvsp.web.client import decode_answer, problem_error
from kvsp.web.http import parse_repr_digest, repr_digest
from kvsp.web.meters import FetchMeter
from kvsp.web.problems import KVSP_JSON, PROBLEM_JSON, dumps_json
from kvsp.web.trust import Trust

if TYPE_CHECKING:  # an annotation only: HTTP-only users need not load the MOQT stack
    from kvsp.transfer.moqt_client import MoqtBlockClient

BLOCK_MEDIA_TYPE = "application/kvsp-block"
MAX_ERROR_BODY = 64 * 1024
MAX_JSON_BODY = 1 << 20
_LEASE_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")
log = logging.getLogger(__name__)
_SLICED = ("slices", "inline", "paired")  # the placements SliceBody serves
INLINE_BELOW = 256 * 1024
"""Bodies shorter than this are hashed on the event loop as they arrive: handing a small
body's slices to worker threads costs more than hashing them (``bench/bench_directive.py``)."""


# -- per-source outcomes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    """One attempt at one source: what came (octets) in how long, or why not."""

    holder: str
    ok: bool
    octets: int
    seconds: float
    error: str | None = None
    """The error class name when the attempt failed (``NotFound``, ``DigestMismatch``, …)."""


@dataclass(slots=True)
class SourceStats:
    """Totals of the attempts at one holder."""

    attempts: int = 0
    successes: int = 0
    octets: int = 0
    seconds: float = 0.0
    """Wall time of the successful attempts (request sent to block verified)."""
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def mbit_per_s(self) -> float | None:
        """Delivered rate of the successful attempts (§6.3 ``links``), ``None`` before any."""
        if self.seconds <= 0 or self.octets == 0:
            return None
        return 8 * self.octets / self.seconds / 1e6


class FetchStats:
    """Per-holder outcomes of block fetches, and the last ``keep`` attempts in order."""

    def __init__(self, keep: int = 1024) -> None:
        self.sources: dict[str, SourceStats] = {}
        self.recent: deque[FetchOutcome] = deque(maxlen=keep)

    def record(self, outcome: FetchOutcome) -> None:
        """Count one attempt."""
        stats = self.sources.setdefault(outcome.holder, SourceStats())
        stats.attempts += 1
        if outcome.ok:
            stats.successes += 1
            stats.octets += outcome.octets
            stats.seconds += outcome.seconds
        elif outcome.error is not None:
            stats.errors[outcome.error] = stats.errors.get(outcome.error, 0) + 1
        self.recent.append(outcome)

    def mbit_per_s(self, holder: str) -> float | None:
        """The measured rate from ``holder``, ``None`` without a successful attempt."""
        stats = self.sources.get(holder)
        return stats.mbit_per_s if stats is not None else None


# -- the client ----------------------------------------------------------------------------------


def block_base(record: ReplicaRecord) -> str:
    """Where the record's block is served: its ``holder`` (§6.7).

    Raises:
        UnsupportedHolder: not an ``http``/``https`` URI (``moqt://`` replicas use MOQT).
    """
    return _http_base(record.holder)


def source_base(record: ReplicaRecord) -> str:
    """Where the record's block is served, over HTTP or MOQT: its ``holder``, ending in ``/``.

    Raises:
        UnsupportedHolder: neither an ``http``/``https`` nor a ``moqt`` URI.
    """
    if _is_moqt(record.holder):
        return record.holder if record.holder.endswith("/") else record.holder + "/"
    return _http_base(record.holder)


def _is_moqt(uri: str) -> bool:
    return uri[:7].lower() == "moqt://"


def lease_base(record: ReplicaRecord) -> str:
    """Where leases on the record's replica are taken: ``lease_base`` or else ``holder``.

    Raises:
        UnsupportedHolder: neither is an ``http``/``https`` URI.
        UnvouchedOrigin: ``lease_base`` is not on the holder's origin (the IS refuses such a
            record; a client refuses it too, whatever its source, and sends nothing there).
    """
    if record.lease_base is not None and not lease_base_allowed(record.holder, record.lease_base):
        log.warning("refused a record whose lease_base is not on its holder's origin")
        raise UnvouchedOrigin("not on the holder's origin", path="$.lease_base")
    return _http_base(record.lease_base or record.holder)


def _http_base(uri: str) -> str:
    try:
        split_url(uri)
    except ValueError:
        raise UnsupportedHolder(f"holder {uri[:120]!r} is not an HTTP(S) URL") from None
    return uri if uri.endswith("/") else uri + "/"


def _repr_digest_of(head: ResponseHead) -> bytes:
    """The SHA-256 a 200 answer's ``Repr-Digest`` names.

    Raises:
        DigestMismatch: none, or a malformed one (the holder's fault, not ours).
    """
    try:
        expected = parse_repr_digest(head.get("repr-digest"))
    except BadRequest as exc:
        raise DigestMismatch(f"holder sent a malformed Repr-Digest: {exc}") from exc
    if expected is None:  # §6.7: holders MUST send it, clients MUST verify it
        raise DigestMismatch("holder sent no Repr-Digest (sha-256)")
    return expected


def _error_of(response: BulkResponse) -> KVSPError:
    """The error a non-2xx bulk answer stands for (same mapping as every KVSP client)."""
    body = response.body
    content = bytes(body.data) if isinstance(body, BytesBody) else b""
    answer = httpx.Response(response.status, headers=list(response.head.headers), content=content)
    return problem_error(answer)


def default_workers(hashing: Hashing) -> int:
    """Verification threads a :class:`BlockClient` makes for ``hashing``.

    ``"paired"`` runs one pass per block, so its threads need only leave a core to the event
    loop that receives: all cores but one, at least one, at most four (a second thread on
    two cores competes with the receiving loop; ``bench/bench_blocks.py`` shows it). The
    hashlib placements keep two, so that ``"split"`` and ``"slices"`` hash their two
    passes of one block at once (``"paired"`` too where it falls back to ``"slices"``).
    """
    if hashing != "paired" or not sha256x2.ACCELERATED:
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cores or 2) - 1))


class BlockClient:
    """Gets, stores and leases blocks at holders over the bulk path (use ``async with``).

    ``bulk`` shares a :class:`~kvsp.transfer.bulk.BulkClient` (not closed here);
    ``executor`` the verification threads (default: a pool of ``workers`` made here; by
    default :func:`default_workers`).
    ``hashing`` places the verification passes (see :mod:`kvsp.transfer.verify`); bodies
    shorter than ``inline_below`` octets are hashed on the event loop whatever it says (the
    sliced placements only: a ``sink`` body keeps its placement). ``buffers``
    lends the memory bodies land in and takes it back when a block is dropped (default: a
    :class:`~kvsp.transfer.buffers.BufferPool` of its own; ``BufferPool(0)`` reuses
    nothing). With ``moqt`` (closed with this client) :meth:`get_block` and :meth:`fetch`
    also serve ``moqt://`` replicas (a relay's) through it; leases stay HTTP (a relay's
    ``lease_base``). ``trust`` (the process's one TLS trust setting, :mod:`kvsp.web.trust`)
    is what a bulk client made here trusts for ``https`` holders and lease bases. ``meter``
    counts every :meth:`get_block` by transport and source: a verified block's octets on the
    wire and seconds to verified, a failure's error class (default: a
    :class:`~kvsp.web.meters.FetchMeter` of its own).
    """

    def __init__(
        self,
        token: str | None,
        *,
        bulk: BulkClient | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        executor: Executor | None = None,
        workers: int | None = None,
        hashing: Hashing = DEFAULT_HASHING,
        slice_step: int = SLICE_STEP,
        stats: FetchStats | None = None,
        moqt: MoqtBlockClient | None = None,
        buffers: BufferPool | None = None,
        inline_below: int = INLINE_BELOW,
        trust: Trust | None = None,
        meter: FetchMeter | None = None,
    ) -> None:
        # Holders get a credential for their own origin, never the token (kvsp.audience).
        self._signer = AudienceSigner(token)
        self.moqt = moqt
        self._owns_bulk = bulk is None
        context = None if trust is None else trust.ssl_context()
        self.bulk = bulk or BulkClient(timeout=timeout, ssl=context)
        self._owns_executor = executor is None and hashing != "inline"
        self._executor = executor
        if self._owns_executor:
            count = default_workers(hashing) if workers is None else workers
            self._executor = ThreadPoolExecutor(count, thread_name_prefix="kvsp-verify")
        self.hashing: Hashing = hashing
        self.slice_step = slice_step
        self.inline_below = inline_below
        self.stats = stats or FetchStats()
        self.meter = FetchMeter() if meter is None else meter
        self._owns_buffers = buffers is None
        self.buffers = BufferPool() if buffers is None else buffers

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the MOQT client, and the bulk client, the worker pool and the buffer pool if
        made here (blocks handed out stay valid)."""
        if self.moqt is not None:
            await self.moqt.aclose()
        if self._owns_bulk:
            await self.bulk.aclose()
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown(wait=False)
        if self._owns_buffers:
            self.buffers.close()

    async def get_block(
        self,
        holder_base: str,
        record: ReplicaRecord,
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        codec: int | None = None,
        sink: LayerSink | None = None,
        block_tokens: int | None = None,
    ) -> VerifiedBlock:
        """GET the record's block (layers ``a..b`` inclusive, or all) and verify it (§6.7).

        ``codec`` asks the holder for that codec (``codec=n``); a block in another codec
        than the replica's is protected by ``Repr-Digest`` only. With ``sink`` the layers
        are written into caller memory as they arrive; after an error it holds garbage.
        ``block_tokens`` (the descriptor's) goes to the MOQT client, which rebuilds the
        container header from it (DESIGN.md §4); HTTP bodies carry their own header.

        Raises:
            NotFound: the holder does not hold the block (LayersUnavailable: those layers).
            DigestMismatch: ``Repr-Digest`` missing or different, a layer digest differs, or
                the record's digests disagree; no block is returned.
            ContainerError: the body is not a KVB1 container of ``geometry``.
            Incompatible: other layers or codec than asked, or layers the record cannot
                verify (no ``layer_digests``).
            UnsupportedHolder: ``holder_base`` is not an HTTP URI (nor a ``moqt`` one with
                ``moqt`` set).
            TransportError: connection failed, broke off or timed out; malformed HTTP.
            KVSPError: any other problem the holder answered.
        """
        source = holder_base if holder_base.endswith("/") else holder_base + "/"
        began = time.perf_counter()
        try:
            block, octets = await self._get_block(
                holder_base, record, layers, geometry, codec, sink, block_tokens
            )
        except KVSPError as exc:
            self.meter.record_failure(source, type(exc).__name__)  # metrics
            raise
        self.meter.record(source, octets, time.perf_counter() - began)  # metrics
        return block

    async def _get_block(
        self,
        holder_base: str,
        record: ReplicaRecord,
        layers: tuple[int, int] | None,
        geometry: Geometry,
        codec: int | None,
        sink: LayerSink | None,
        block_tokens: int | None,
    ) -> tuple[VerifiedBlock, int]:
        """:meth:`get_block`, and the octets that crossed the wire for it: a MOQT fetch's
        object payloads (K ‖ V per layer: the header is rebuilt, never sent), an HTTP
        answer's body (the container, header included)."""
        if self.moqt is not None and _is_moqt(holder_base):
            if codec is not None and codec != record.codec:
                raise Incompatible("a MOQT holder serves the replica's codec only")
            block = await self.moqt.get_block(
                record,
                layers=layers,
                geometry=geometry,
                block_tokens=block_tokens,
                sink=sink,
                holder=holder_base,
            )
            return block, _layer_octets(block)
        base = _http_base(holder_base)
        plan = plan_block(record, layers, geometry, codec)
        query = f"?layers={plan.first}-{plan.last}" if layers is not None else ""
        if codec is not None:
            query += ("&" if query else "?") + f"codec={codec}"
        url = f"{base}blocks/{record.compat_id.hex()}/{record.scope_id.hex()}/"
        url += record.block_key.hex() + query

        checked: list[bytes] = []  # the Repr-Digest the body is verified against

        def consumer(
            head: ResponseHead, length: int | None
        ) -> VerifyingBody | SliceBody | BytesBody:
            if head.status != 200:
                return BytesBody(length, MAX_ERROR_BODY)
            checked.append(_repr_digest_of(head))
            return self._verifying_body(plan, checked[-1], length, sink)

        headers = {**self._auth(url), "accept": f"{BLOCK_MEDIA_TYPE}, {PROBLEM_JSON}"}
        response = await self.bulk.request("GET", url, headers=headers, consumer=consumer)
        body = response.body
        if not isinstance(body, VerifyingBody | SliceBody):
            raise _error_of(response)
        container, producer = await body.result()
        block = VerifiedBlock(
            **header_fields(container),
            layers=container.layers,
            record=record,
            source=base,
            producer_verified=producer,
            body_digest=checked[-1],
        )
        return block, header_size(container.layer_count) + _layer_octets(container)

    def _verifying_body(
        self, plan: BlockPlan, expected: bytes, length: int | None, sink: LayerSink | None
    ) -> VerifyingBody | SliceBody:
        """The consumer that verifies a 200 answer's body: a :class:`SliceBody` where
        :attr:`hashing` slices a body of known length that lands in its own buffer."""
        if self.hashing in _SLICED and length is not None and sink is None:
            inline = self.hashing == "inline" or length < self.inline_below
            return SliceBody(
                plan,
                expected,
                length,
                executor=None if inline else self._executor,
                step=self.slice_step,
                paired=self.hashing == "paired",
                buffers=self.buffers,
            )
        return VerifyingBody(
            plan,
            expected,
            length,
            executor=self._executor,
            hashing=self.hashing,
            sink=sink,
            buffers=self.buffers,
        )

    async def fetch(
        self,
        replicas: Sequence[ReplicaRecord],
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        sink: LayerSink | None = None,
        block_tokens: int | None = None,
    ) -> VerifiedBlock | None:
        """The block from the first replica, in the order given, that delivers it verified;
        ``None`` when none does.

        A 404, a broken, refused or slow connection, malformed HTTP, a digest mismatch or any
        other KVSP error at one replica means "try the next" (§6.1: the index is advisory);
        ``moqt://`` replicas are skipped unless ``moqt`` is set. Each attempt is recorded in
        :attr:`stats` under the replica's base (:func:`source_base`, ending in ``/``).
        """
        for record in replicas:
            try:
                base = block_base(record) if self.moqt is None else source_base(record)
            except UnsupportedHolder:
                continue
            started = time.perf_counter()
            try:
                block = await self.get_block(
                    base,
                    record,
                    layers=layers,
                    geometry=geometry,
                    sink=sink,
                    block_tokens=block_tokens,
                )
            except KVSPError as exc:
                elapsed = time.perf_counter() - started
                self.stats.record(FetchOutcome(base, False, 0, elapsed, type(exc).__name__))
                continue
            octets = sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)
            elapsed = time.perf_counter() - started
            self.stats.record(FetchOutcome(base, True, octets, elapsed))
            return block
        return None

    async def put_block(
        self,
        holder_base: str,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        data: Buffer | Sequence[Buffer],
    ) -> bool:
        """Store a container at a holder with ``If-None-Match: *`` (§6.7): ``True`` when
        stored, ``False`` when the holder already has the block (412) and kept its copy.

        Raises:
            KVSPError: the holder refused (e.g. Unauthorized, Forbidden, BadRequest).
            TransportError: the connection failed.
        """
        parts = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
        digest = await asyncio.to_thread(_sha256_parts, parts)
        url = f"{_http_base(holder_base)}blocks/{compat.hex()}/{scope.hex()}/{key.hex()}"
        headers = {
            **self._auth(url),
            "content-type": BLOCK_MEDIA_TYPE,
            "if-none-match": "*",
            "repr-digest": repr_digest(digest),
            "accept": PROBLEM_JSON,
        }
        consumer = BytesBody.factory(MAX_ERROR_BODY)
        response = await self.bulk.request(
            "PUT", url, headers=headers, body=parts, consumer=consumer
        )
        if 200 <= response.status < 300:
            return True
        if response.status == 412:
            return False
        raise _error_of(response)

    def _auth(self, url: str) -> dict[str, str]:
        """The ``Authorization`` field for a request to ``url``: a credential for its origin."""
        value = self._signer.authorization(url)
        return {} if value is None else {"authorization": value}

    async def acquire_lease(self, holder_base: str, request: LeaseRequest) -> LeaseGrant:
        """POST leases (§6.6): protect the request's blocks at the holder for ``ttl_ms``.

        Raises:
            LeaseQuota: beyond the client's quota (429 ``kvsp-lease-quota``).
            RemoteError: an answer that is not a lease grant.
            KVSPError: any other refusal; TransportError when unreachable.
        """
        answer = await self._json("POST", f"{_http_base(holder_base)}leases", request.to_json())
        return decode_answer(LeaseGrant.from_json, answer)

    async def renew_lease(self, holder_base: str, lease: str, ttl_ms: int) -> LeaseGrant:
        """PUT leases/{id} (§6.6): extend the lease to ``ttl_ms`` from now.

        Raises:
            LeaseQuota: beyond the client's quota. NotFound: no such lease (expired).
            KVSPError: any other refusal; TransportError when unreachable.
        """
        url = _lease_url(holder_base, lease)
        answer = await self._json("PUT", url, LeaseRenewal(ttl_ms=ttl_ms).to_json())
        return decode_answer(LeaseGrant.from_json, answer)

    async def release_lease(self, holder_base: str, lease: str) -> None:
        """DELETE leases/{id} (§6.6).

        Raises:
            NotFound: no such lease. KVSPError: any other refusal; TransportError.
        """
        await self._json("DELETE", _lease_url(holder_base, lease), None)

    async def _json(self, method: str, url: str, body: Any) -> Any:
        headers = {**self._auth(url), "accept": f"{KVSP_JSON}, {PROBLEM_JSON}"}
        content = None
        if body is not None:
            headers["content-type"] = KVSP_JSON
            content = dumps_json(body)
        consumer = BytesBody.factory(MAX_JSON_BODY)
        response = await self.bulk.request(
            method, url, headers=headers, body=content, consumer=consumer
        )
        if not 200 <= response.status < 300:
            raise _error_of(response)
        data = response.body.data if isinstance(response.body, BytesBody) else b""
        if not data:
            return None
        try:
            return loads(data)
        except KVSPError as exc:
            raise RemoteError(
                f"peer answered {response.status} with a body that is not JSON: {exc}",
                remote_status=response.status,
                body=bytes(data),
            ) from exc


def _lease_url(holder_base: str, lease: str) -> str:
    if _LEASE_ID.fullmatch(lease) is None:
        raise ValueError(f"not a lease identifier: {lease[:40]!r}")
    return f"{_http_base(holder_base)}leases/{lease}"


def _layer_octets(block: Container) -> int:
    return sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)


def _sha256_parts(parts: Sequence[Buffer]) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()
