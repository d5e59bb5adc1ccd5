"""The two SHA-256 passes of block verification in one (spec §6.7; DESIGN.md §7).

§6.7 has a client check ``Repr-Digest`` (SHA-256 of the whole container) and each layer's
digest (SHA-256 of the layer's octets): every octet is hashed twice. The native module
``kvsp._sha256x2`` issues the rounds of both messages interleaved on the x86 SHA extensions,
which leave most of their throughput unused on one dependent stream, so both passes cost little
more than one hashlib pass (the "hashing one block twice" line of ``bench/bench_blocks.py``).
A MOQT FETCH has no container to hash as a whole, only its layers: :func:`digests` puts two
layers on those lanes at once, so each octet is hashed once at the paired rate.

:data:`ACCELERATED` says whether it is here and this CPU can run it; when not (no compiler at
install, not x86, no SHA extensions) callers keep to :mod:`hashlib`, which gives the same
digests.
"""

from __future__ import annotations

from types import ModuleType

_native: ModuleType | None
try:
    from kvsp import _sha256x2 as _native
except ImportError:  # built optionally (setup.py): absent where it could not be compiled
    _native = None

ACCELERATED: bool = _native is not None and bool(_native.accelerated)
"""Whether :class:`Sha256`, :func:`update2`, :func:`feed_layers` and :func:`digests` work here."""

if _native is not None:
    from kvsp._sha256x2 import Sha256, digests, feed_layers, update2
else:  # pragma: no cover - only where the extension could not be built

    class Sha256:  # type: ignore[no-redef]
        """Stands in for the native class where it was not built: making one raises."""

        def __init__(self, data: object = b"", /) -> None:
            raise RuntimeError("kvsp._sha256x2 was not built here; use hashlib")

    def update2(a: object, b: object, data: object, /) -> None:  # type: ignore[misc]
        """Stands in for the native function where it was not built."""
        raise RuntimeError("kvsp._sha256x2 was not built here; use hashlib")

    def feed_layers(a: object, b: object, data: object, ends: object, /) -> list[bytes]:  # type: ignore[misc]
        """Stands in for the native function where it was not built."""
        raise RuntimeError("kvsp._sha256x2 was not built here; use hashlib")

    def digests(data: object, size: int, /) -> list[bytes]:  # type: ignore[misc]
        """Stands in for the native function where it was not built."""
        raise RuntimeError("kvsp._sha256x2 was not built here; use hashlib")


__all__ = ["ACCELERATED", "Sha256", "digests", "feed_layers", "update2"]
