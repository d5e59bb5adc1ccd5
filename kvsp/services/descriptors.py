"""The descriptor resource every service serves (spec §4.1; DESIGN.md §3 resource table).

``PUT descriptors/{compat}`` registers a Compatibility Descriptor in a
:class:`~kvsp.stores.descriptors.DescriptorRegistry` and ``GET descriptors/{compat}`` reads one
back. The server computes the compat id from the body and refuses a path that names another
(§4.1: implementations MUST compute the Compatibility ID from the descriptor rather than accept
it from a peer).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import BadRequest, NotFound
from kvsp.ids import parse_compat_id
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.web.auth import principal_of
from kvsp.web.http import read_json
from kvsp.web.problems import kvsp_json

DESCRIPTOR_BODY_LIMIT = 64 * 1024
"""Octets of a descriptor body: a descriptor is a few hundred octets plus its adapters."""


def descriptor_routes(registry: DescriptorRegistry) -> list[Route]:
    """``PUT descriptors/{compat}`` and ``GET descriptors/{compat}`` over ``registry``, for any
    app that keeps ``principals`` and ``clock`` in ``app.state``."""

    async def put_descriptor(request: Request) -> Response:
        principal_of(request)  # the roles: kvsp.web.roles
        in_path = parse_compat_id(request.path_params["compat"], path="compat")
        descriptor = CompatibilityDescriptor.from_json(
            await read_json(request, DESCRIPTOR_BODY_LIMIT)
        )
        computed = compat_id(descriptor)
        if computed != in_path:
            # §4.1: the server computes the Compatibility ID; it never takes the client's word.
            raise BadRequest(
                f"the descriptor's compat_id is {computed.hex()}, not {in_path.hex()}",
                path="compat",
            )
        known = registry.get(computed) is not None
        registry.add(descriptor)
        return kvsp_json({"compat_id": computed.hex()}, status=200 if known else 201)

    async def get_descriptor(request: Request) -> Response:
        principal_of(request)
        cid = parse_compat_id(request.path_params["compat"], path="compat")
        descriptor = registry.get(cid)
        if descriptor is None:
            raise NotFound(f"no descriptor for compat_id {cid.hex()}")
        return kvsp_json(descriptor.to_json())

    return [
        Route("/descriptors/{compat}", put_descriptor, methods=["PUT"]),
        Route("/descriptors/{compat}", get_descriptor, methods=["GET"]),
    ]
