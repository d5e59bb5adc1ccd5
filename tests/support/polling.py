"""Waiting for a condition instead of sleeping and hoping: the tests' one polling helper.

A test that needs "eventually X" polls a check until it returns a truthy value and gets that
value back, so that the wait ends as soon as X holds and a failure says what was awaited.
:func:`eventually` blocks (for tests that drive processes from the main thread);
:func:`until` awaits (for tests inside an event loop, whose servers run on the same loop) and
also takes a check that returns an awaitable.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

T = TypeVar("T")


def eventually(
    check: Callable[[], T | None],
    timeout: float = 30.0,
    what: str = "",
    *,
    interval: float = 0.05,
) -> T:
    """Call ``check`` every ``interval`` seconds until it returns a truthy value; return it.

    Raises:
        AssertionError: no truthy value within ``timeout`` seconds; the message names ``what``
            (or the check's source line) and the last value seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(check, timeout, what, value))
        time.sleep(interval)


async def until(
    check: Callable[[], T | None] | Callable[[], Awaitable[T | None]],
    timeout: float = 10.0,
    what: str = "",
    *,
    interval: float = 0.01,
) -> T:
    """Call ``check`` (awaiting what it returns, if awaitable) every ``interval`` seconds,
    yielding to the event loop in between, until it gives a truthy value; return it.

    Raises:
        AssertionError: no truthy value within ``timeout`` seconds; the message names ``what``
            (or the check's source line) and the last value seen.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value: Any = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return cast(T, value)
        if loop.time() > deadline:
            raise AssertionError(_timed_out(check, timeout, what, value))
        await asyncio.sleep(interval)


def _timed_out(check: Callable[[], object], timeout: float, what: str, last: object) -> str:
    return f"not met within {timeout} s: {what or _where(check)} (last value: {last!r:.200})"


def _where(check: Callable[[], object]) -> str:
    """``name (file:line)`` of a check, for a lambda whose repr says nothing."""
    code = getattr(check, "__code__", None)
    name = getattr(check, "__qualname__", repr(check))
    if code is None:
        return name
    return f"{name} ({Path(code.co_filename).name}:{code.co_firstlineno})"
