"""The event log of a service process: one JSON object per line, each with ``t_ns`` (a
``CLOCK_MONOTONIC`` time in nanoseconds) and ``event``.

``CLOCK_MONOTONIC`` is the same clock in every process of one machine, so the logs of several
processes can be read together: the PC's checkpoint acknowledgements against an instance's
releases of tokens (spec §6.8 release gate). Lines are flushed as written, since those logs are
read while the processes run. Without a path nothing is written, so a service always holds an
:class:`EventLog` and never asks whether to log.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class EventLog:
    """One JSON object per line, each with ``t_ns`` (``time.monotonic_ns``) and ``event``;
    nothing is written without a path. Lines are flushed as written (several processes may
    be read together while they run)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = None if path is None else path.open("a", encoding="utf-8", buffering=1)

    def write(self, event: str, **members: Any) -> None:
        """Append one event (no-op without a path)."""
        if self._file is None:
            return
        line = json.dumps({"t_ns": time.monotonic_ns(), "event": event, **members})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = ["EventLog"]
