"""Types of the native module built from ``moqt/_objscan.c`` (see :mod:`moqt.objects`)."""

from typing import Protocol

from typing_extensions import Buffer

from .wire import KeyValuePair

class _Prior(Protocol):
    @property
    def group_id(self) -> int: ...
    @property
    def subgroup_id(self) -> int | None: ...
    @property
    def object_id(self) -> int: ...
    @property
    def publisher_priority(self) -> int | None: ...

def fetch_object(
    data: Buffer, pos: int, prior: _Prior | None, /
) -> tuple[int, int, int | None, int, int, tuple[KeyValuePair, ...], int] | None: ...

_RunObject = tuple[int, int | None, int, int, tuple[KeyValuePair, ...], int, int]

def fetch_objects(
    data: Buffer, pos: int, prior: _Prior | None, /
) -> tuple[int, list[_RunObject], int] | None: ...
def subgroup_object(
    data: Buffer, pos: int, has_extensions: bool, last: _Prior | None, /
) -> tuple[int, int, tuple[KeyValuePair, ...], int] | None: ...
