"""Types of the native module built from ``moqt/_frozen.c`` (see :mod:`relay.cache`)."""

from typing import TypeVar

from typing_extensions import Buffer

_T = TypeVar("_T")

class FrozenSlice:
    def __init__(self, view: Buffer, /) -> None: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def untrack(obj: _T, /) -> _T: ...
