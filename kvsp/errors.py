"""The KVSP error tree (DESIGN.md §3, spec §4.4, §6.6–6.8 problem types).

Every error the library raises on bad input is a :class:`KVSPError`. Each concrete class carries
the RFC 9457 problem name and HTTP status as class attributes, so exactly one handler at the HTTP
edge can render any of them as ``application/problem+json``.
"""

from __future__ import annotations

from typing import Any, ClassVar

PROBLEM_PREFIX = "urn:ietf:params:kvsp:problem:"


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


class NotFound(KVSPError):
    """No such resource (404 ``kvsp-not-found``)."""

    problem = "kvsp-not-found"
    status = 404
    title = "Not found"


class LayersUnavailable(NotFound):
    """The holder does not hold the requested layers (404 ``kvsp-layers-unavailable``, §6.7)."""

    problem = "kvsp-layers-unavailable"
    title = "Layers unavailable"


class NotAcceptable(KVSPError):
    """A requested codec the holder cannot produce (406)."""

    problem = "kvsp-incompatible"
    status = 406
    title = "Not acceptable"


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


class DigestMismatch(KVSPError):
    """Bytes whose digest differs from the one they must have (``kvsp-digest-mismatch``)."""

    problem = "kvsp-digest-mismatch"
    status = 422
    title = "Digest mismatch"


class Incompatible(KVSPError):
    """Caches or blocks whose Compatibility IDs or geometry do not match (``kvsp-incompatible``)."""

    problem = "kvsp-incompatible"
    status = 422
    title = "Incompatible"
