"""The figures the demo collects while it plays, and the report it prints at the end.

Every figure is measured in the run that prints it: times to first token where the front end
saw them, octets from the Replica Records of the blocks that moved (by the transport of the
holder they came from), prompt blocks loaded or computed as the instances answered them
(``KVSP-Loaded-Blocks`` / ``KVSP-Computed-Blocks``), failover time from the kill to the first
token of the resumed stream.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvsp.demo.client import Generation, Transition
from kvsp.demo.console import Console

SECTIONS = ("TTFT", "Bytes moved", "Cache hits", "Failover", "Lifecycle")
"""The headings of the report, in order (the tests look for them)."""


@dataclass(slots=True)
class Placement:
    """One request of the scenario: where the PC put it and how it went."""

    label: str
    instance: str
    matched: int
    blocks: int
    directive: str | None
    generation: Generation
    prefetched: bool = False
    """The prefix was loaded by a directive just before (by the PC's or the demo's)."""

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token in milliseconds."""
        ttft = self.generation.ttft_s
        return None if ttft is None else ttft * 1000


@dataclass(slots=True)
class FailoverOutcome:
    """What the failover step measured."""

    method: str
    """How the session continued: ``resume`` (§6.8 via the PC) or ``restart`` (re-placed)."""
    killed: str
    resumed_on: str
    killed_after_tokens: int
    failover_s: float
    tokens: int
    gap_free: bool
    duplicates_dropped: int
    epochs: list[int]


@dataclass(slots=True)
class Figures:
    """Everything the report states."""

    prompt_tokens: int = 0
    ttft_recomputed_ms: list[float] = field(default_factory=list)
    ttft_cached_ms: list[float] = field(default_factory=list)
    ttft_prefetched_ms: list[float] = field(default_factory=list)
    octets: dict[str, int] = field(default_factory=lambda: {"HTTP": 0, "MOQT": 0})
    blocks_moved: dict[str, int] = field(default_factory=lambda: {"HTTP": 0, "MOQT": 0})
    loaded_blocks: int = 0
    computed_blocks: int = 0
    placements: list[Placement] = field(default_factory=list)
    failover: FailoverOutcome | None = None
    lifecycle: list[tuple[str, list[Transition]]] = field(default_factory=list)
    """(what happened, the instance's states at the PC meanwhile) per step that moved one."""
    missing: list[str] = field(default_factory=list)
    """Steps that could not be shown, and why."""

    def count(self, generation: Generation) -> None:
        """Add a generation's prompt blocks to the cache-hit tally."""
        self.loaded_blocks += generation.loaded_blocks
        self.computed_blocks += generation.computed_blocks

    def moved(self, transport: str, blocks: int, octets: int) -> None:
        """Add blocks that moved between holders and instances over ``transport``."""
        self.blocks_moved[transport] = self.blocks_moved.get(transport, 0) + blocks
        self.octets[transport] = self.octets.get(transport, 0) + octets


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def print_report(console: Console, figures: Figures, names: dict[str, str]) -> None:
    """Print the report: one short section per figure (``names`` maps URLs to short names)."""
    console.heading("Report")
    _ttft(console, figures)
    _bytes(console, figures)
    _hits(console, figures)
    _failover(console, figures, names)
    _lifecycle(console, figures, names)
    if figures.missing:
        console.line()
        console.line("Not shown in this run:")
        for why in figures.missing:
            console.line(f"  - {why}")


def _ttft(console: Console, f: Figures) -> None:
    recomputed, cached = _median(f.ttft_recomputed_ms), _median(f.ttft_cached_ms)
    prefetched = _median(f.ttft_prefetched_ms)
    console.line(f"TTFT ({f.prompt_tokens}-token prompts sharing a system prompt, medians):")
    rows: list[list[object]] = [
        ["recomputed (no cache)", _ms(recomputed), len(f.ttft_recomputed_ms)],
        ["cached (prefix resident)", _ms(cached), len(f.ttft_cached_ms)],
        ["prefetched (loaded by a directive)", _ms(prefetched), len(f.ttft_prefetched_ms)],
    ]
    console.table(["", "TTFT", "requests"], rows)
    if recomputed and cached:
        console.line(f"  cached is {recomputed / cached:.1f}x faster than recomputing")


def _bytes(console: Console, f: Figures) -> None:
    console.line()
    console.line("Bytes moved per transport (blocks loaded by prefetch directives):")
    rows = [
        [t, f.blocks_moved.get(t, 0), f"{f.octets.get(t, 0) / 1024:,.0f} KiB"] for t in f.octets
    ]
    console.table(["transport", "blocks", "octets"], rows)


def _hits(console: Console, f: Figures) -> None:
    console.line()
    total = f.loaded_blocks + f.computed_blocks
    share = f"{100 * f.loaded_blocks / total:.0f}%" if total else "-"
    console.line(
        f"Cache hits: {f.loaded_blocks} of {total} prompt blocks loaded instead of computed "
        f"({share}) over {len(f.placements)} requests"
    )


def _failover(console: Console, f: Figures, names: dict[str, str]) -> None:
    console.line()
    out = f.failover
    if out is None:
        console.line("Failover: not measured in this run (see below)")
        return
    verdict = "gap-free, duplicate-free" if out.gap_free else "NOT gap-free"
    console.line(
        f"Failover ({out.method}): {names.get(out.killed, out.killed)} killed after "
        f"{out.killed_after_tokens} tokens; {names.get(out.resumed_on, out.resumed_on)} "
        f"continued; {out.failover_s * 1000:,.0f} ms from the kill to the next token at the "
        f"front end; {out.tokens} tokens {verdict} (equal to the uninterrupted run; "
        f"{out.duplicates_dropped} duplicates dropped; epochs {out.epochs})"
    )


def _lifecycle(console: Console, f: Figures, names: dict[str, str]) -> None:
    console.line()
    console.line("Lifecycle at the PC (seconds since the step began):")
    for what, history in f.lifecycle:
        console.line(f"  {what}: {states_line(history)}")


def states_line(history: list[Transition]) -> str:
    """``active (0.0 s) -> draining (1.1 s) -> ...``: each change of the PC's state once."""
    changes = [t for i, t in enumerate(history) if i == 0 or history[i - 1].state != t.state]
    return " -> ".join(f"{t.state} ({t.at_s:.1f} s)" for t in changes)
