"""A client of the Placement Controller (spec §6.3 status, §6.4 placement, §6.8 sessions;
DESIGN.md §3 resource table): one method per resource of :mod:`kvsp.services.pc.app`.

Errors arrive as the :class:`~kvsp.errors.KVSPError` the PC raised (see
:mod:`kvsp.web.client`): ``kvsp-stale-epoch`` as :class:`~kvsp.errors.StaleEpoch`,
``kvsp-not-active`` from ``place`` as :class:`~kvsp.errors.NotActive`, an illegal operator
transition as :class:`~kvsp.errors.Conflict`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Self

from kvsp.errors import RecordError
from kvsp.fields import Fields
from kvsp.ids import uri_id
from kvsp.records import (
    InstanceStatusRecord,
    PlaceRequest,
    PlaceResponse,
    SessionCheckpoint,
    StateAnswer,
)
from kvsp.records_common import HTTP_SCHEMES, read_uri, read_uuid
from kvsp.registries import InstanceState
from kvsp.web.client import BaseClient, decode_answer


def _state(f: Fields, key: str, *, nullable: bool = False) -> InstanceState | None:
    name = f.string(key, nullable=nullable)
    if name is None:
        return None
    try:
        return InstanceState(name)
    except ValueError:
        raise RecordError(f"unknown state {name!r}", path=f.at(key)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceListing:
    """One entry of ``GET instances``: the PC's state, epoch, load and record age."""

    instance: str
    state: InstanceState
    epoch: int
    reported_state: InstanceState
    requested_state: InstanceState | None
    running: int
    queued: int
    batch_size: int
    age_ms: int
    ttl_ms: int
    mean_service_us: float | None

    @property
    def load(self) -> int:
        """``running + queued``, the load the sleep policy looks at."""
        return self.running + self.queued

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read one entry.

        Raises:
            RecordError: a bad or missing member.
        """
        f = Fields(obj, path)
        state = _state(f, "state")
        reported = _state(f, "reported_state")
        if state is None or reported is None:
            raise RecordError("must not be null", path=f.at("state"))
        return cls(
            instance=read_uri(f.raw("instance"), f.at("instance"), HTTP_SCHEMES),
            state=state,
            epoch=f.integer("epoch"),
            reported_state=reported,
            requested_state=_state(f, "requested_state", nullable=True),
            running=f.integer("running"),
            queued=f.integer("queued"),
            batch_size=f.integer("batch_size"),
            age_ms=f.integer("age_ms"),
            ttl_ms=f.integer("ttl_ms"),
            mean_service_us=f.number("mean_service_us", nullable=True),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionView:
    """Where a session lives now (``GET sessions/{session}``, §6.8), or what a checkpoint
    PUT left: instance, epoch, state and the output tokens the PC holds a checkpoint for."""

    session: uuid.UUID
    instance: str | None
    epoch: int
    state: str
    output_offset: int
    max_tokens: int | None = None
    detail: str | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a session view (``instance`` is absent from a checkpoint's answer).

        Raises:
            RecordError: a bad or missing member.
        """
        f = Fields(obj, path)
        instance = f.raw("instance", optional=True)
        return cls(
            session=read_uuid(f.raw("session"), f.at("session")),
            instance=None
            if instance is None
            else read_uri(instance, f.at("instance"), HTTP_SCHEMES),
            epoch=f.integer("epoch"),
            state=f.string("state"),
            output_offset=f.integer("output_offset"),
            max_tokens=f.integer("max_tokens", optional=True),
            detail=f.string("detail", optional=True),
        )


def _listing(obj: Any) -> list[InstanceListing]:
    return [InstanceListing.from_json(v, p) for v, p in Fields(obj).items("instances")]


class PCClient(BaseClient):
    """An async client of one PC (``async with PCClient(base, token) as pc: ...``)."""

    control_plane = True  # the PC takes the bearer token itself

    async def put_status(self, record: InstanceStatusRecord) -> StateAnswer:
        """PUT an Instance Status Record (§6.3); returns the PC's state for the instance.

        Raises:
            KVSPError: as the PC answered (409 ``kvsp-stale-epoch``, 403, ...).
        """
        path = f"instances/{uri_id(record.instance)}/status"
        answer = await self._request_json("PUT", path, record.to_json())
        return decode_answer(StateAnswer.from_json, answer)

    async def list_instances(self) -> list[InstanceListing]:
        """GET the instances the PC knows.

        Raises:
            KVSPError: as the PC answered (403 without role pc or admin).
        """
        return decode_answer(_listing, await self._request_json("GET", "instances"))

    async def set_state(self, instance: str, state: InstanceState) -> InstanceState:
        """PUT an operator state change for ``instance`` (§6.3); returns the new state.

        Raises:
            KVSPError: 404 unknown instance, 409 illegal transition, 502 instance unreachable.
        """
        path = f"instances/{uri_id(instance)}/state"
        answer = await self._request_json("PUT", path, StateAnswer(state=state).to_json())
        return decode_answer(StateAnswer.from_json, answer).state

    async def end_epoch(self, instance: str, epoch: int) -> None:
        """DELETE ``instances/{id}?epoch=E``: end ``instance``'s epoch gracefully (its
        shutdown, §6.3); the PC withdraws its replicas and moves its sessions.

        Raises:
            KVSPError: 404 unknown instance, 409 ``kvsp-stale-epoch`` for a lower epoch than
                the PC's, 403 for another instance's principal.
        """
        await self._request("DELETE", f"instances/{uri_id(instance)}?epoch={epoch}")

    async def place(
        self,
        request: PlaceRequest,
        *,
        deadline_ms: int | None = None,
        lease_ms: int | None = None,
    ) -> PlaceResponse:
        """POST place (§6.4); ``deadline_ms``/``lease_ms`` override the PC's directive timing.

        Raises:
            NotActive: no instance can take it now (the PC may be starting one).
            KVSPError: as the PC answered otherwise (403 scope, 400, ...).
        """
        body = request.to_json()
        if deadline_ms is not None:
            body["deadline_ms"] = deadline_ms
        if lease_ms is not None:
            body["lease_ms"] = lease_ms
        answer = await self._request_json("POST", "place", body)
        return decode_answer(PlaceResponse.from_json, answer)

    async def put_checkpoint(self, checkpoint: SessionCheckpoint) -> SessionView:
        """PUT a Session Checkpoint (§6.8); the answer carries the offset the PC keeps.

        Raises:
            StaleEpoch: the session moved on to a higher epoch.
            KVSPError: as the PC answered otherwise (404 unknown session, 403, 409).
        """
        path = f"sessions/{checkpoint.session}/checkpoint"
        answer = await self._request_json("PUT", path, checkpoint.to_json())
        return decode_answer(SessionView.from_json, answer)

    async def get_session(self, session: uuid.UUID) -> SessionView:
        """GET where a session lives now (§6.8).

        Raises:
            NotFound: the PC has no such session.
            KVSPError: as the PC answered otherwise.
        """
        answer = await self._request_json("GET", f"sessions/{session}")
        return decode_answer(SessionView.from_json, answer)
