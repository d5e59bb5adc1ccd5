"""What a prefetch directive did, for the instance's log (spec §6.5 directive states).

An operator reading an instance's log wants to know, for each directive, how much of it was
loaded, from where and over which transport, how long it took and how it ended, without
matching warning lines to directives by hand. :class:`Loaded` is the outcome of loading one
block (the source and the octets moved); :class:`DirectiveTally` adds them up for one directive
and logs one line when it stops: at info always, and a second line at warning with the cause
when it ended partial or failed (each failed fetch is logged at warning where it happens, in
:mod:`kvsp.services.instance.service`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from kvsp.prefetch import DirectiveProgress
from kvsp.registries import DirectiveState

_log = logging.getLogger("kvsp.instance")

HELD = "held"
"""The source name of blocks the instance held already (nothing moved)."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """The outcome of loading one block: ``ok``, why not, and where it came from."""

    ok: bool
    why: str = ""
    source: str = HELD
    octets: int = 0

    @property
    def transport(self) -> str:
        """``moqt`` for a ``moqt://`` source, ``http`` for an HTTP(S) one, ``held`` when
        nothing was moved."""
        if self.source == HELD:
            return HELD
        return "moqt" if self.source[:7].lower() == "moqt://" else "http"


@dataclass(slots=True)
class DirectiveTally:
    """The blocks and octets one directive loaded, by source and by transport."""

    started: float = field(default_factory=time.monotonic)
    blocks_by_source: Counter[str] = field(default_factory=Counter)
    octets_by_source: Counter[str] = field(default_factory=Counter)
    blocks_by_transport: Counter[str] = field(default_factory=Counter)
    octets_by_transport: Counter[str] = field(default_factory=Counter)

    def add(self, loaded: Loaded) -> None:
        """Count one block that was loaded (or found held)."""
        self.blocks_by_source[loaded.source] += 1
        self.octets_by_source[loaded.source] += loaded.octets
        self.blocks_by_transport[loaded.transport] += 1
        self.octets_by_transport[loaded.transport] += loaded.octets

    def elapsed_ms(self) -> float:
        """Milliseconds since the directive was taken."""
        return 1000 * (time.monotonic() - self.started)

    def summary(self, progress: DirectiveProgress) -> str:
        """The outcome line of a directive that stopped."""
        loaded = len(progress.loaded)
        total = len(progress.keys)
        octets = sum(self.octets_by_source.values())
        return (
            f"directive {progress.directive.directive}: {progress.state}, {loaded}/{total} "
            f"blocks loaded, {octets} octets in {self.elapsed_ms():.1f} ms; "
            f"by source: {_breakdown(self.blocks_by_source, self.octets_by_source)}; "
            f"by transport: {_breakdown(self.blocks_by_transport, self.octets_by_transport)}"
        )

    def log(self, progress: DirectiveProgress) -> None:
        """Log the directive's outcome: a line at info, and its cause at warning unless it
        completed."""
        _log.info("%s", self.summary(progress))
        if progress.state is not DirectiveState.COMPLETE:
            _log.warning(
                "directive %s %s: %s",
                progress.directive.directive,
                progress.state,
                progress.detail or "no detail",
            )


def _breakdown(blocks: Counter[str], octets: Counter[str]) -> str:
    if not blocks:
        return "none"
    parts = (f"{name} {count} blocks/{octets[name]} octets" for name, count in blocks.items())
    return ", ".join(parts)


__all__ = ["HELD", "DirectiveTally", "Loaded"]
