"""Background loops of the services (the IS and PC sweepers, a holder's record refresh, the
relay's upkeep and link, an instance's status reports): they log a failed round and try again,
but must still end when their task is cancelled at shutdown.

Why a helper: a client library may turn the CancelledError of a cancel that lands inside one of
its own timeouts into an ordinary error (redis-py's reads run under ``asyncio.timeout``), so an
``except Exception`` that logs and loops would swallow the cancel and the awaiting shutdown
would wait for ever. :func:`raise_if_cancelling` in that handler restores it.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Raise :class:`asyncio.CancelledError` when the current task has a pending cancel.

    Call it first in a background loop's ``except Exception`` handler.

    Raises:
        asyncio.CancelledError: the task is being cancelled.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
