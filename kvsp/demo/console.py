"""Terminal output of the demo commands: progress bars, step headings and plain tables.

On a TTY a :class:`Progress` redraws one line (``\\r``) with a small bar; anywhere else (a pipe,
a log file, a test) it prints one plain line per change worth noting, so the output reads well
in both. No dependency beyond the standard library.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

BAR_WIDTH = 24


class Console:
    """Where the demo writes: a stream, and whether it is a terminal."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty

    def line(self, text: str = "") -> None:
        """Write one line and flush (output interleaves with child processes' logs)."""
        self.stream.write(text + "\n")
        self.stream.flush()

    def heading(self, text: str) -> None:
        """A step heading: a blank line, then the text underlined."""
        self.line()
        self.line(text)
        self.line("-" * len(text))

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        """Print ``rows`` under ``headers`` as aligned columns."""
        for text in render_table(headers, rows):
            self.line(text)

    def progress(self, label: str, total: int) -> Progress:
        """A progress bar for ``total`` units of work."""
        return Progress(self, label, total)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Aligned text lines: numbers right-aligned, text left-aligned, two spaces apart."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def fmt(values: Sequence[str]) -> str:
        parts = [
            v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(values)
        ]
        return "  ".join(parts).rstrip()

    return [fmt(list(headers)), fmt(["-" * w for w in widths]), *(fmt(row) for row in cells)]


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Progress:
    """A progress bar: redrawn in place on a TTY, one line per :meth:`advance` otherwise.

    Use as a context manager; leaving it finishes the line (and says how long it took).
    """

    def __init__(self, console: Console, label: str, total: int) -> None:
        self.console = console
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.note = ""
        self.started = time.monotonic()
        self._quarter = 0

    def __enter__(self) -> Progress:
        self._draw()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish(failed=exc[0] is not None)

    def advance(self, count: int = 1, note: str = "") -> None:
        """Count ``count`` more units done; ``note`` says what just finished."""
        self.done = min(self.total, self.done + count)
        self.note = note
        self._draw()

    def set(self, done: int, note: str = "") -> None:
        """Set the units done so far (redrawn only when it changed)."""
        done = min(self.total, done)
        if done != self.done or note != self.note:
            self.done = done
            self.note = note
            self._draw()

    def finish(self, *, failed: bool = False) -> None:
        """End the bar with the elapsed time."""
        elapsed = time.monotonic() - self.started
        outcome = "failed" if failed else "done"
        text = f"{self.label}: {outcome} in {elapsed:.1f} s"
        if self.console.tty:
            self.console.stream.write("\r\x1b[2K")
        self.console.line(text)

    def _draw(self) -> None:
        note = f"  {self.note}" if self.note else ""
        if self.console.tty:
            filled = BAR_WIDTH * self.done // self.total
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            text = f"{self.label} [{bar}] {self.done}/{self.total}{note}"
            self.console.stream.write("\r\x1b[2K" + text)
            self.console.stream.flush()
        elif self._worth_a_line():
            self.console.line(f"{self.label}: {self.done}/{self.total}{note}")

    def _worth_a_line(self) -> bool:
        """Off a TTY: a line per named step, else one per quarter of the work."""
        quarter = 4 * self.done // self.total
        if not self.note and (self.done == 0 or quarter == self._quarter):
            return False
        self._quarter = quarter
        return True
