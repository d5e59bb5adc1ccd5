"""The KVSP error tree: every problem type the library and its services raise (DESIGN.md §2, §3;
spec §4.4, §6.6–6.9 problem names; RFC 9457).

Every error raised on purpose is a :class:`KVSPError`. Each problem type is declared by exactly
one class, which carries the problem name, HTTP status and title as class attributes; a subclass
either declares a problem type of its own or refines its base's status, title or data. Exactly
one handler at the HTTP edge (:mod:`kvsp.web.problems`) renders any of them as
``application/problem+json``, and the HTTP client (:mod:`kvsp.web.client`) turns a peer's problem
back into its class. The catalogue lives in this one module, importing nothing but ``typing``, so
that every layer (core, stores, engines, transfer, services, relay) raises and catches the same
classes without importing any layer above the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # annotations only: nothing but typing is imported at run time
    from collections.abc import Sequence

PROBLEM_PREFIX = "urn:ietf:params:kvsp:problem:"
MAX_ERROR_BODY = 4096
"""Octets of a peer's unexpected answer kept on a :class:`RemoteError`."""


class KVSPError(Exception):
    """Root of every error the KVSP library raises on purpose.

    ``problem`` is the spec's problem name (rendered as ``urn:ietf:params:kvsp:problem:<name>``),
    ``status`` the HTTP status a service answers with. ``path`` optionally names the JSON path or
    field that is wrong.
    """

    problem: ClassVar[str] = "kvsp-bad-request"
    status: ClassVar[int] = 400
    title: ClassVar[str] = "Bad request"

    def __init__(self, detail: str, *, path: str | None = None) -> None:
        self.detail = detail
        self.path = path
        super().__init__(f"{path}: {detail}" if path else detail)

    @property
    def problem_type(self) -> str:
        """The full RFC 9457 ``type`` URI of this error."""
        return PROBLEM_PREFIX + self.problem

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """Render as an RFC 9457 problem details object."""
        body: dict[str, Any] = {
            "type": self.problem_type,
            "title": self.title,
            "status": self.status,
            "detail": str(self),
        }
        if self.path is not None:
            body["path"] = self.path
        if instance is not None:
            body["instance"] = instance
        return body


# --- input: malformed requests and records (kvsp-bad-request) ----------------------------------


class BadRequest(KVSPError):
    """Malformed or invalid input (400 ``kvsp-bad-request``)."""


class InvalidIdentifier(BadRequest):
    """A hex identifier or digest string of the wrong form (wrong length, uppercase, not hex)."""


class RecordError(BadRequest):
    """A JSON record that violates §4.4; ``path`` names the bad member (``$.layer_digests[3]``)."""


class DescriptorError(RecordError):
    """A Compatibility Descriptor that violates §4.1."""


class TokenError(BadRequest):
    """Token identifiers that cannot be encoded as uint32 (§4.2)."""


class ContainerError(BadRequest):
    """A KVB1 container that violates §4.3 (magic, version, flags, codec, lengths, truncation)."""


class PayloadTooLarge(BadRequest):
    """A body or declared length beyond the configured limit (413)."""

    status = 413
    title = "Payload too large"


class UnsupportedMediaType(KVSPError):
    """A request body in a media type the resource does not take (415 ``kvsp-bad-request``)."""

    status = 415
    title = "Unsupported media type"


class PreconditionRequired(KVSPError):
    """A holder got a block PUT without ``If-None-Match: *`` (428 ``kvsp-bad-request``, RFC
    6585; §6.7)."""

    status = 428
    title = "Precondition required"


# --- auth ---------------------------------------------------------------------------------------


class Unauthorized(KVSPError):
    """Missing, unknown or expired credentials (401 ``kvsp-unauthorized``)."""

    problem = "kvsp-unauthorized"
    status = 401
    title = "Unauthorized"


class Forbidden(KVSPError):
    """The principal is not allowed to do this (403 ``kvsp-forbidden``)."""

    problem = "kvsp-forbidden"
    status = 403
    title = "Forbidden"


# --- resources and their state ------------------------------------------------------------------


class NotFound(KVSPError):
    """No such resource (404 ``kvsp-not-found``)."""

    problem = "kvsp-not-found"
    status = 404
    title = "Not found"


class LayersUnavailable(NotFound):
    """The holder does not hold the requested layers (404 ``kvsp-layers-unavailable``, §6.7)."""

    problem = "kvsp-layers-unavailable"
    title = "Layers unavailable"


class Conflict(KVSPError):
    """The request conflicts with the resource's state (409 ``kvsp-conflict``)."""

    problem = "kvsp-conflict"
    status = 409
    title = "Conflict"


class IllegalTransition(Conflict):
    """A state machine was asked for a transition its table does not allow."""


class PreconditionFailed(Conflict):
    """``If-None-Match: *`` on a block the holder already has (412, §6.7)."""

    status = 412
    title = "Precondition failed"


class StaleEpoch(Conflict):
    """A message carrying an epoch lower than one already seen (409 ``kvsp-stale-epoch``)."""

    problem = "kvsp-stale-epoch"
    title = "Stale epoch"


# --- compatibility and integrity ----------------------------------------------------------------


class Incompatible(KVSPError):
    """Caches or blocks whose Compatibility IDs or geometry do not match (``kvsp-incompatible``)."""

    problem = "kvsp-incompatible"
    status = 422
    title = "Incompatible"


class NotAcceptable(Incompatible):
    """A requested codec the holder cannot produce (406 ``kvsp-incompatible``, §6.7)."""

    status = 406
    title = "Not acceptable"


class DigestMismatch(KVSPError):
    """Bytes whose digest differs from the one they must have (``kvsp-digest-mismatch``)."""

    problem = "kvsp-digest-mismatch"
    status = 422
    title = "Digest mismatch"


# --- capacity and availability ------------------------------------------------------------------


class NotActive(KVSPError):
    """The instance is not active and takes no new work (503 ``kvsp-not-active``, §6.3)."""

    problem = "kvsp-not-active"
    status = 503
    title = "Instance not active"


class LeaseQuota(KVSPError):
    """A lease beyond the client's quota of octets or TTL (429 ``kvsp-lease-quota``, §6.6)."""

    problem = "kvsp-lease-quota"
    status = 429
    title = "Lease quota exceeded"


# --- storage ------------------------------------------------------------------------------------


class InsufficientStorage(KVSPError):
    """No tier of a block store can take a block without evicting a leased one, raised by the
    holder's store and by an engine's cache (507 ``kvsp-insufficient-storage``)."""

    problem = "kvsp-insufficient-storage"
    status = 507
    title = "Insufficient storage"


class BlockLeased(Conflict):
    """A block store refused an eviction because a lease covers the block (409, §6.6: MUST NOT
    evict)."""


class StoreUnavailable(KVSPError):
    """A shared store (Redis) behind the Index Service or the PC is unreachable or failed (503
    ``kvsp-store-unavailable``): the service's trouble, never the client's."""

    problem = "kvsp-store-unavailable"
    status = 503
    title = "Store unavailable"


class NotReady(KVSPError):
    """A live service that is not ready to serve: its ``GET /readyz`` (503
    ``kvsp-not-ready``; ``detail`` says why, e.g. its Index Service does not answer)."""

    problem = "kvsp-not-ready"
    status = 503
    title = "Not ready"


# --- peers and transfer -------------------------------------------------------------------------


class TransportError(KVSPError):
    """A client could not reach a peer or the exchange broke off below HTTP (502
    ``kvsp-unreachable``)."""

    problem = "kvsp-unreachable"
    status = 502
    title = "Peer unreachable"


class UpstreamError(KVSPError):
    """A peer answered with an error or with something that does not fit, so the work asked
    of this service failed (502 ``kvsp-upstream-error``); the PC raises it when an instance
    refuses a state change it forwards."""

    problem = "kvsp-upstream-error"
    status = 502
    title = "Unexpected answer from a peer"


class RemoteError(UpstreamError):
    """An HTTP client got an answer it cannot map to a KVSP error or result (502
    ``kvsp-upstream-error``).

    ``remote_status`` is the peer's HTTP status, ``remote_type`` its problem type if it sent
    one, and ``body`` the first :data:`MAX_ERROR_BODY` octets of its answer.
    """

    def __init__(
        self,
        detail: str,
        *,
        remote_status: int,
        body: bytes = b"",
        remote_type: str | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(detail, path=path)
        self.remote_status = remote_status
        self.body = body[:MAX_ERROR_BODY]
        self.remote_type = remote_type


class UnsupportedHolder(Incompatible):
    """A block client was handed a replica it cannot reach: its holder URI has a scheme the
    client does not speak (422 ``kvsp-incompatible``)."""


class BadAudience(BadRequest):
    """A URI with no origin that an audience credential could be bound to
    (:mod:`kvsp.audience`)."""


class UnvouchedOrigin(RecordError):
    """A record that would send a client's credentials to an origin its holder URI does not
    name (a ``lease_base`` elsewhere); the client refuses it and sends nothing."""


# --- control: scale-up and resharding (§6.4, §6.9) ----------------------------------------------


class ScaleUpFailed(UpstreamError):
    """The PC's scale-up hook failed or answered something that is not an instance URI (502
    ``kvsp-upstream-error``)."""

    title = "Scale-up failed"


class _JsonMember(Protocol):
    """Anything that renders itself as one JSON object (a member of a problem's extension)."""

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        ...


class ReshardAborted(KVSPError):
    """The PC aborted a shard-map version change because a member failed its plan (502
    ``kvsp-reshard-aborted``, §6.9); version ``version`` stays authoritative and ``failed``
    names each member that failed."""

    problem = "kvsp-reshard-aborted"
    status = 502
    title = "Reshard aborted"

    def __init__(self, detail: str, *, version: int, failed: Sequence[_JsonMember]) -> None:
        super().__init__(detail)
        self.version = version
        self.failed = tuple(failed)

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """The problem details, with ``version`` and ``failed``."""
        body = super().to_problem(instance)
        body["version"] = self.version
        body["failed"] = [f.to_json() for f in self.failed]
        return body


class ReshardTimedOut(ReshardAborted):
    """The PC aborted a version change because a member did not acknowledge within
    ``deadline_ms`` (504 ``kvsp-reshard-aborted``)."""

    status = 504
    title = "Reshard timed out"


class RangeFetchFailed(UpstreamError):
    """An instance could not load a range of its reshard plan from the range's source (502
    ``kvsp-upstream-error``, §6.9)."""

    title = "Range fetch failed"


class RangeFetchTimedOut(RangeFetchFailed):
    """An instance did not load all the ranges of its plan within ``deadline_ms`` (504)."""

    status = 504
    title = "Range fetch timed out"


# --- sessions (§6.8) ----------------------------------------------------------------------------


class SessionFailed(KVSPError):
    """A front end cannot go on with a session: the PC marked it failed after tokens were
    delivered, or it could not be reattached in time (502 ``kvsp-session-failed``)."""

    problem = "kvsp-session-failed"
    status = 502
    title = "Session failed"


# --- tools: simulator and local cluster ---------------------------------------------------------


class SimError(KVSPError):
    """The simulator cannot go on: a replica store that suspends, an unplaceable request (500
    ``kvsp-sim``)."""

    problem = "kvsp-sim"
    status = 500
    title = "Simulation error"


class ClusterError(KVSPError):
    """The local demo cluster could not be started or stopped working (500
    ``kvsp-cluster-failed``; never served over HTTP)."""

    problem = "kvsp-cluster-failed"
    status = 500
    title = "The local cluster failed"
