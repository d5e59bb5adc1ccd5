"""A client of the Index Service (spec §6.1, §6.2, §6.3 status; DESIGN.md §3 resource table).

Every method maps to one request of :mod:`kvsp.services.index.app`; errors arrive as the
:class:`~kvsp.errors.KVSPError` the server raised (see :mod:`kvsp.web.client`), and
answers are checked as records, so a peer's malformed answer raises
:class:`~kvsp.errors.RemoteError`.

A client given several IS base URLs fails over between them (:mod:`kvsp.web.failover`); of
the POSTs, ``lookup`` (a read) and the batch publication (a set of PUTs) are sent again to the
next IS when an answer was lost.

Unless it is handed an ``httpx`` client (an ASGI transport in tests, a shared pool), the
requests go over the bulk HTTP/1.1 client (:mod:`kvsp.transfer.bulk`), with the same headers,
bodies, error mapping and failover: an instance sends the IS a lookup, lease-free publications
and status records for every directive, and each request over ``httpx`` costs several times
the CPU of the whole exchange over the bulk client's keep-alive connections.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import KVSPError, RecordError, RemoteError, TransportError
from kvsp.fields import Fields
from kvsp.ids import CompatId, parse_compat_id, uri_id
from kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    StateAnswer,
)
from kvsp.transfer.bulk import BulkClient
from kvsp.transfer.http11 import BytesBody
from kvsp.web.client import (
    DEFAULT_TIMEOUT_S,
    BaseClient,
    decode_answer,
    error_from_problem,
    problem_error,
)
from kvsp.web.failover import NotSent
from kvsp.web.problems import KVSP_JSON
from kvsp.web.trust import Trust

MAX_ANSWER_BYTES = 64 << 20
"""The largest IS answer body the bulk transport takes (a lookup of many keys)."""


def replica_path(compat_id: bytes, scope_id: bytes, key: bytes, holder: str) -> str:
    """``replicas/{compat}/{scope}/{key}/{holder_id}`` for a record's identifiers (DESIGN §3)."""
    return f"replicas/{compat_id.hex()}/{scope_id.hex()}/{key.hex()}/{uri_id(holder)}"


def _ttl(obj: Any) -> int:
    ttl: int = Fields(obj).integer("ttl_ms")
    return ttl


def _batch_outcome(obj: Any, path: str) -> int | KVSPError:
    f = Fields(obj, path)
    if f.boolean("ok"):
        ttl: int = f.integer("ttl_ms")
        return ttl
    return error_from_problem(f.nested("problem").obj)


def _batch_outcomes(obj: Any, expected: int) -> list[int | KVSPError]:
    f = Fields(obj)
    results = [_batch_outcome(v, p) for v, p in f.items("results")]
    if len(results) != expected:
        raise RecordError(f"{len(results)} results for {expected} records", path="$.results")
    return results


def _withdrawn(obj: Any) -> int:
    count: int = Fields(obj).integer("withdrawn")
    return count


def _compat_of(obj: Any) -> CompatId:
    return parse_compat_id(Fields(obj).raw("compat_id"), path="$.compat_id")


class IndexClient(BaseClient):
    """An async client of one IS (``async with IndexClient(base, token) as index: ...``).

    Without ``client`` the requests go over a :class:`~kvsp.transfer.bulk.BulkClient` (see the
    module docstring); with one, over that ``httpx`` client.
    """

    control_plane = True  # the IS takes the bearer token itself
    service = "IS"

    def __init__(
        self,
        base_url: str | Sequence[str],
        token: str | None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        client: httpx.AsyncClient | None = None,
        trust: Trust | None = None,
        service: str | None = None,
    ) -> None:
        super().__init__(
            base_url, token, timeout=timeout, client=client, trust=trust, service=service
        )
        self._bulk: BulkClient | None = None
        if client is None:
            context = None if trust is None else trust.ssl_context()
            self._bulk = BulkClient(timeout=timeout, ssl=context)
        self._answers = BytesBody.factory(MAX_ANSWER_BYTES)

    async def aclose(self) -> None:
        """Close the connections (of an ``httpx`` client only if this client made it)."""
        if self._bulk is not None:
            await self._bulk.aclose()
        await super().aclose()

    async def _send(
        self, method: str, base: str, path: str, content: bytes | None, accept_404: bool
    ) -> httpx.Response:
        bulk = self._bulk
        if bulk is None:
            return await super()._send(method, base, path, content, accept_404)
        headers = self._headers[base]
        if content is not None:
            headers = {**headers, "content-type": KVSP_JSON}
        try:
            answer = await bulk.request(
                method, base + path, headers=headers, body=content, consumer=self._answers
            )
        except TransportError as exc:
            if isinstance(exc.__cause__, OSError):  # the bulk client's failed connect, only
                raise NotSent(str(exc)) from exc.__cause__
            raise
        data = answer.body.data if isinstance(answer.body, BytesBody) else b""
        response = httpx.Response(answer.status, headers=answer.head.headers, content=bytes(data))
        if response.is_success or (accept_404 and response.status_code == 404):
            return response
        raise problem_error(response)

    async def publish(self, record: ReplicaRecord) -> int:
        """PUT a Replica Record (§6.1); returns the granted TTL in milliseconds.

        Raises:
            KVSPError: as the server answered (400 mismatch, 403 scope or holder, ...).
        """
        path = replica_path(record.compat_id, record.scope_id, record.block_key, record.holder)
        return decode_answer(_ttl, await self._request_json("PUT", path, record.to_json()))

    async def publish_batch(self, records: Sequence[ReplicaRecord]) -> list[int | KVSPError]:
        """POST several records at once; per record, the granted TTL or the error it met.

        Raises:
            KVSPError: the batch as a whole was refused (too large, unauthenticated, ...).
        """
        body = {"records": [r.to_json() for r in records]}
        answer = await self._request_json("POST", "replicas", body, resend=True)
        return decode_answer(lambda obj: _batch_outcomes(obj, len(records)), answer)

    async def withdraw(self, compat_id: bytes, scope_id: bytes, key: bytes, holder: str) -> bool:
        """DELETE one holder's record (§6.1); ``False`` when the IS had none.

        Raises:
            KVSPError: as the server answered (403 scope or holder, ...).
        """
        path = replica_path(compat_id, scope_id, key, holder)
        response = await self._request("DELETE", path, accept_404=True)
        return response.status_code != 404

    async def withdraw_holder(self, holder: str, *, published_before: int | None = None) -> int:
        """DELETE every record of ``holder`` (``holders/{uri_id}/replicas``), or only those
        last published before ``published_before`` (ms); how many went.

        Raises:
            KVSPError: as the server answered (403 for another holder without role pc, ...).
        """
        path = f"holders/{uri_id(holder)}/replicas"
        if published_before is not None:
            path += f"?before={published_before}"
        answer = await self._request_json("DELETE", path)
        return decode_answer(_withdrawn, answer)

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        """POST a lookup (§6.2); the answer is checked against the request.

        Raises:
            KVSPError: as the server answered; RemoteError for an answer that does not fit.
        """
        answer = await self._request_json("POST", "lookup", request.to_json(), resend=True)
        response = decode_answer(LookupResponse.from_json, answer)
        decode_answer(lambda req: response.check_answers(req), request)
        return response

    async def put_status(self, record: InstanceStatusRecord) -> StateAnswer:
        """PUT an Instance Status Record (§6.3); returns the state the service answered.

        Raises:
            KVSPError: as the server answered (409 ``kvsp-stale-epoch``, 403, ...).
        """
        path = f"instances/{uri_id(record.instance)}/status"
        answer = await self._request_json("PUT", path, record.to_json())
        return decode_answer(StateAnswer.from_json, answer)

    async def put_descriptor(self, descriptor: CompatibilityDescriptor) -> bytes:
        """PUT a Compatibility Descriptor; returns the compat id the server computed (§4.1).

        Raises:
            KVSPError: as the server answered; RemoteError if the server's id differs from the
                one computed here.
        """
        cid = compat_id(descriptor)
        answer = await self._request_json("PUT", f"descriptors/{cid.hex()}", descriptor.to_json())
        confirmed = decode_answer(_compat_of, answer)
        if confirmed != cid:
            raise RemoteError(
                f"server computed compat_id {confirmed.hex()}, not {cid.hex()}", remote_status=200
            )
        return confirmed

    async def get_descriptor(self, cid: bytes) -> CompatibilityDescriptor:
        """GET the descriptor the service knows for compat id ``cid``.

        Raises:
            NotFound: the service knows none; RemoteError when the answer has another id.
        """
        answer = await self._request_json("GET", f"descriptors/{cid.hex()}")
        descriptor = decode_answer(CompatibilityDescriptor.from_json, answer)
        if compat_id(descriptor) != cid:
            raise RemoteError("answer is the descriptor of another compat_id", remote_status=200)
        return descriptor
