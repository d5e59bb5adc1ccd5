"""The error a shared store raises when it fails (DESIGN.md §1: stateless IS and PC processes
over an in-memory or Redis store)."""

from __future__ import annotations

from kvsp.errors import KVSPError


class StoreUnavailable(KVSPError):
    """A shared store (Redis) is unreachable or failed (503 ``kvsp-store-unavailable``): the
    service's trouble, never the client's."""

    problem = "kvsp-store-unavailable"
    status = 503
    title = "Store unavailable"
