"""Types of the native module built from ``moqt/_tlsrecords.c`` (see :mod:`moqt.qmux_tls`)."""

from typing import Any

from typing_extensions import Buffer

MORE: int
NEED: int
CLOSED: int

def bind(sslobj: Any, incoming: Any, version: str, /) -> bool: ...
def read(sslobj: Any, incoming: Any, data: Buffer, out: Buffer, /) -> tuple[int, int]: ...
