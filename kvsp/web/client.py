"""The HTTP client boundary shared by every KVSP client (DESIGN.md §3 encodings and auth;
STYLE.md rule 3: foreign exceptions are translated at one boundary).

:class:`BaseClient` holds one keep-alive ``httpx.AsyncClient``, sends ``application/kvsp+json``
with ``Authorization: Bearer``, and turns every failure into a :class:`~kvsp.errors.KVSPError`:

* an ``application/problem+json`` answer becomes the error class with that problem type and
  status (:func:`problem_error`), so ``kvsp-lease-quota`` raises :class:`~kvsp.errors.LeaseQuota`
  on the client as it did on the server;
* any other non-2xx answer, and a 2xx answer whose body is not the JSON asked for, becomes a
  :class:`~kvsp.errors.RemoteError` (502 ``kvsp-upstream-error``, carrying the peer's status
  and body);
* an httpx transport failure (connect, timeout, reset, protocol) becomes a
  :class:`~kvsp.errors.TransportError` (502 ``kvsp-unreachable``) raised ``from`` the httpx
  exception, as does the ``AttributeError`` httpcore raises when the peer dies just after
  accepting.

The two 502 problem names are ours (DESIGN §3 lists the others): a service that lets either
propagate answers its own client "Bad gateway", which is what happened.

A client may be given several base URLs of one service (several control planes on one store):
each request fails over between them as :mod:`kvsp.web.failover` describes; the methods named
in :data:`RESENDABLE` (and the POSTs a subclass marks ``resend=True``) are the ones that may be
sent again after an answer was lost.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Self, TypeVar

import httpx

from kvsp import errors
from kvsp.audience import AudienceSigner, audience_credential, canonical_origin, origins
from kvsp.errors import KVSPError, RecordError, RemoteError, TransportError
from kvsp.records import loads
from kvsp.web.failover import Failover
from kvsp.web.problems import KVSP_JSON, PROBLEM_JSON, dumps_json
from kvsp.web.trust import Trust

DEFAULT_TIMEOUT_S = 30.0
"""Seconds for any one read, write or pool wait; connecting gets at most 5 s."""

T = TypeVar("T")

RESENDABLE = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
"""Methods whose request may be sent again, to the next URL, once it may have been received
(HTTP's idempotent methods)."""


_CLASSES: tuple[type[KVSPError], ...] = (
    errors.BadRequest,
    errors.PayloadTooLarge,
    errors.UnsupportedMediaType,
    errors.Unauthorized,
    errors.Forbidden,
    errors.NotFound,
    errors.LayersUnavailable,
    errors.NotAcceptable,
    errors.Conflict,
    errors.PreconditionFailed,
    errors.StaleEpoch,
    errors.NotActive,
    errors.LeaseQuota,
    errors.DigestMismatch,
    errors.Incompatible,
    errors.TransportError,
)
# First class listed wins, so the base classes (BadRequest, Conflict) stand for their subclasses
# that share a problem type and status (RecordError, IllegalTransition).
_BY_TYPE_AND_STATUS: dict[tuple[str, int], type[KVSPError]] = {}
for _cls in _CLASSES:
    _BY_TYPE_AND_STATUS.setdefault((errors.PROBLEM_PREFIX + _cls.problem, _cls.status), _cls)


def _problem_body(response: httpx.Response) -> dict[str, Any] | None:
    content_type = response.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != PROBLEM_JSON:
        return None
    try:
        body = loads(response.content)
    except RecordError:
        return None
    return body if isinstance(body, dict) else None


def _strip_path(detail: str, path: str | None) -> str:
    # KVSPError renders "path: detail"; rebuilding the error with its path would repeat it.
    prefix = f"{path}: "
    return detail[len(prefix) :] if path and detail.startswith(prefix) else detail


def problem_error(response: httpx.Response) -> KVSPError:
    """The :class:`~kvsp.errors.KVSPError` a non-2xx answer stands for.

    A problem answer whose type and status name a known class gives that class with the peer's
    detail and path; anything else (``about:blank``, unknown types, no problem body, a 5xx
    page) gives a :class:`RemoteError` carrying the status and body.
    """
    status = response.status_code
    body = _problem_body(response)
    if body is None:
        return RemoteError(
            f"peer answered {status} without a problem body",
            remote_status=status,
            body=response.content,
        )
    return error_from_problem(body, status, response.content)


def error_from_problem(problem: object, status: int | None = None, raw: bytes = b"") -> KVSPError:
    """The :class:`~kvsp.errors.KVSPError` an RFC 9457 problem object stands for (as in a
    batch result); ``status`` defaults to the object's own ``status`` member.

    An unknown type/status pair, or a value that is not a problem object, gives a
    :class:`RemoteError`.
    """
    body = problem if isinstance(problem, dict) else {}
    if status is None:
        member = body.get("status")
        status = member if isinstance(member, int) and not isinstance(member, bool) else 0
    problem_type = body.get("type")
    detail = body.get("detail")
    path = body.get("path")
    text = detail if isinstance(detail, str) else str(body.get("title", "no detail"))
    where = path if isinstance(path, str) else None
    cls = _BY_TYPE_AND_STATUS.get((str(problem_type), status))
    if cls is None:
        return RemoteError(
            f"peer answered {status} {str(problem_type)[:120]}: {text[:500]}",
            remote_status=status,
            body=raw,
            remote_type=problem_type if isinstance(problem_type, str) else None,
            path=where,
        )
    return cls(_strip_path(text, where), path=where)


class BaseClient:
    """An async KVSP client over one keep-alive ``httpx.AsyncClient`` (use ``async with``).

    ``base_url`` is the service base (a trailing ``/`` is added if missing), or several bases
    of the same service (a sequence, or comma-separated) that requests fail over between
    (:mod:`kvsp.web.failover`); paths are relative to it. ``client`` lets a caller share a
    connection pool or route through an ASGI transport; a client passed in is not closed here.
    ``trust`` is the process's one TLS trust setting (:mod:`kvsp.web.trust`; default: the
    system trust store) for a client made here. ``service`` names the peer in failover log
    lines (default: the class's :attr:`service`).

    Only a client of the control plane (:attr:`control_plane`: the IS, the PC) sends ``token``
    itself, to each of its URLs; any other service receives an audience credential for the
    origin of the URL the request goes to (:mod:`kvsp.audience`), which opens nothing
    elsewhere.
    """

    accepted_types: ClassVar[str] = f"{KVSP_JSON}, {PROBLEM_JSON}"
    control_plane: ClassVar[bool] = False
    """Whether the peer is the IS or the PC, the only services that get the bearer token."""
    service: ClassVar[str] = "service"
    """The peer's name in failover log lines."""

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
        self.failover = Failover(base_url, service or self.service)
        self._headers: dict[str, dict[str, str]] = {}
        for url in self.failover.urls:
            headers = {"accept": self.accepted_types}
            if token is not None and self.control_plane:
                headers["authorization"] = f"Bearer {token}"
            elif token is not None:
                headers["authorization"] = "Bearer " + audience_credential(token, url)
            self._headers[url] = headers
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            verify=True if trust is None else trust.ssl_context(),
        )

    @property
    def base_url(self) -> str:
        """The base URL requests go to first now (the one that answered last)."""
        return self.failover.current

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (only if this client made it)."""
        if self._owns_client:
            await self._client.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        accept_404: bool = False,
        resend: bool | None = None,
    ) -> httpx.Response:
        """Send one request with a JSON body (``None`` = no body) and return a 2xx answer (or
        the 404 when ``accept_404``), failing over between the client's URLs; ``resend``
        (default: ``method`` is in :data:`RESENDABLE`) says it is safe to send again.

        Raises:
            TransportError: the exchange failed below HTTP (at every URL).
            KVSPError: the peer answered with an error (see :func:`problem_error`).
        """
        content = None if body is None else dumps_json(body)
        safe = method in RESENDABLE if resend is None else resend

        async def attempt(base: str) -> httpx.Response:
            return await self._send(method, base, path, content, accept_404)

        return await self.failover.call(attempt, resend=safe, what=f"{method} {path}")

    async def _send(
        self, method: str, base: str, path: str, content: bytes | None, accept_404: bool
    ) -> httpx.Response:
        headers = dict(self._headers[base])
        if content is not None:
            headers["content-type"] = KVSP_JSON
        try:
            response = await self._client.request(
                method, base + path, content=content, headers=headers
            )
        except httpx.RequestError as exc:
            raise TransportError(f"{method} {base}{path}: {type(exc).__name__}: {exc}") from exc
        except AttributeError as exc:
            # httpcore on anyio, when the peer dies between accepting the connection and the
            # first read: the closed socket is None when asked for its peer name
            raise TransportError(f"{method} {base}{path}: connection lost: {exc}") from exc
        if response.is_success or (accept_404 and response.status_code == 404):
            return response
        raise problem_error(response)

    async def _request_json(
        self, method: str, path: str, body: Any = None, *, resend: bool | None = None
    ) -> Any:
        """Send one request (as :meth:`_request`) and return the parsed JSON answer (``None``
        for an empty body).

        Raises:
            TransportError: the exchange failed below HTTP.
            RemoteError: a 2xx answer that is not JSON.
            KVSPError: the peer answered with an error (see :func:`problem_error`).
        """
        response = await self._request(method, path, body, resend=resend)
        return parse_answer(response)


class AudienceAuth(httpx.Auth):
    """``Authorization: Bearer`` for an ``httpx`` client that talks to the control plane and
    to other services: the token itself only to an origin in ``control_plane`` (the IS, the
    PC), an audience credential for the request's origin anywhere else (:mod:`kvsp.audience`).
    """

    def __init__(self, token: str, control_plane: Iterable[str]) -> None:
        self._raw = f"Bearer {token}"
        self._control = origins(control_plane)
        self._signer = AudienceSigner(token)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        """Set the request's ``Authorization`` field (httpx calls this)."""
        url = str(request.url)
        if canonical_origin(url) in self._control:
            request.headers["authorization"] = self._raw
        else:
            request.headers["authorization"] = self._signer.authorization(url) or ""
        yield request


def parse_answer(response: httpx.Response) -> Any:
    """The JSON value of a successful answer (``None`` when it has no body).

    Raises:
        RemoteError: the body is not valid JSON.
    """
    if not response.content:
        return None
    try:
        return loads(response.content)
    except RecordError as exc:
        raise RemoteError(
            f"peer answered {response.status_code} with a body that is not JSON: {exc}",
            remote_status=response.status_code,
            body=response.content,
        ) from exc


def decode_answer(read: Callable[[Any], T], value: Any, status: int = 200) -> T:
    """Read a peer's answer with ``read`` (a record's ``from_json``), blaming the peer.

    Raises:
        RemoteError: the answer is not the record asked for; the message names the JSON path.
    """
    try:
        return read(value)
    except RecordError as exc:
        raise RemoteError(
            f"peer answered {status} with an invalid body: {exc}", remote_status=status
        ) from exc
