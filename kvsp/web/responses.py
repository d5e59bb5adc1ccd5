"""A response that sends stored octets as they are (spec §6.7 block retrieval; DESIGN.md §3).

A holder answers ``GET blocks/…`` and an instance answers ``GET shards/…`` from buffers it
already holds. :class:`PartsResponse` hands those buffers to the server one ASGI body message
each, with no copy and none of :class:`~starlette.responses.StreamingResponse`'s task and
generator machinery; a part larger than :data:`SEND_SLICE` goes in slices of it, so the
server's write buffer stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SEND_SLICE = 4 << 20
"""A GET body is handed to the server in slices this large, so its write buffer stays bounded."""


def _send_pieces(parts: Sequence[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    for part in parts:
        view = memoryview(part)
        if len(view) <= SEND_SLICE:
            yield part
            continue
        for at in range(0, len(view), SEND_SLICE):
            yield view[at : at + SEND_SLICE]


class PartsResponse(Response):
    """A response whose body is ``parts`` sent as they are, one ASGI body message each (parts
    beyond :data:`SEND_SLICE` in slices of it): a stored 2 MiB block is one
    ``transport.write`` of its memory."""

    def __init__(
        self,
        parts: Sequence[bytes | memoryview],
        *,
        headers: Mapping[str, str],
        media_type: str,
    ) -> None:
        self.parts = tuple(parts)
        super().__init__(None, headers=headers, media_type=media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        pieces = list(_send_pieces(self.parts))
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < last})
        if not pieces:
            await send({"type": "http.response.body", "body": b""})


__all__ = ["SEND_SLICE", "PartsResponse"]
