"""Compatibility Descriptors known to a service, and where they are kept (spec §4.1; DESIGN.md §3).

The IS needs a compat id's geometry (``block_tokens``, ``layers``) to estimate fetch and
recompute times (§6.4); holders need it to check containers. A :class:`DescriptorRegistry` maps
compat ids to descriptors, loaded from ``--descriptor FILE`` options and ``STATE/descriptors/``,
and persists the ones it learns as ``{compat}.json`` files written atomically. The compat id is
always computed from the descriptor (§4.1), never taken from a caller.

This is the storage half only, with no web stack, so that the Redis stores can take a registry;
the HTTP resource (``PUT``/``GET descriptors/{compat}``) is :mod:`kvsp.services.descriptors`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import DescriptorError, RecordError
from kvsp.ids import CompatId
from kvsp.records import dumps, loads


def read_descriptor_file(path: str | os.PathLike[str]) -> CompatibilityDescriptor:
    """Read a descriptor from a JSON file.

    Raises:
        DescriptorError: unreadable, not JSON, or not a valid descriptor; the message names the
            file.
    """
    where = os.fspath(path)
    try:
        data = Path(where).read_bytes()
    except OSError as exc:
        raise DescriptorError(f"cannot read descriptor {where}: {exc.strerror}") from None
    try:
        return CompatibilityDescriptor.from_json(loads(data))
    except RecordError as exc:
        raise DescriptorError(f"{where}: {exc.detail}", path=exc.path) from None


def _write(folder: Path, cid: bytes, descriptor: CompatibilityDescriptor) -> None:
    """Write ``folder/{cid}.json`` atomically (temporary file, then rename)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = folder / f"{cid.hex()}.json"
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_bytes(dumps(descriptor) + b"\n")
    os.replace(tmp, target)


class DescriptorRegistry:
    """Compat id → descriptor; persisted as ``{compat}.json`` in ``folder`` when one is given."""

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        self._by_id: dict[bytes, CompatibilityDescriptor] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, compat: bytes, /) -> CompatibilityDescriptor | None:
        """The descriptor of ``compat``, if known."""
        return self._by_id.get(bytes(compat))

    def add(self, descriptor: CompatibilityDescriptor, *, persist: bool = True) -> CompatId:
        """Register ``descriptor`` under the compat id computed from it; write it to the folder
        (when there is one and ``persist``) if it was not known. Returns its compat id."""
        cid = compat_id(descriptor)
        if cid not in self._by_id:
            self._by_id[cid] = descriptor
            if persist and self.folder is not None:
                _write(self.folder, cid, descriptor)
        return cid

    def load_files(self, paths: Iterable[str | os.PathLike[str]]) -> int:
        """Register the descriptors in ``paths`` (not copied to the folder); returns how many.

        Raises:
            DescriptorError: a file is unreadable or not a valid descriptor.
        """
        count = 0
        for path in paths:
            self.add(read_descriptor_file(path), persist=False)
            count += 1
        return count

    def load_folder(self) -> int:
        """Register every ``*.json`` in the folder (none when it is absent); returns how many.

        Raises:
            DescriptorError: a file is unreadable or not a valid descriptor.
        """
        if self.folder is None or not self.folder.is_dir():
            return 0
        return self.load_files(sorted(self.folder.glob("*.json")))


__all__ = ["DescriptorRegistry", "read_descriptor_file"]
