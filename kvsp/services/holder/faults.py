"""Retiring stored blocks found faulty on reading (spec §6.1 withdraw, §6.6 "a holder that must
evict leased data due to a fault MUST first withdraw the affected replica records").

The block store reports each fault it finds (:meth:`~kvsp.stores.blocks.BlockStore.read_checked`)
to :meth:`Retirement.on_fault`, from the event loop or from a worker thread. The block is then
retired once: counted by kind, withdrawn at the Index Service, and only then dropped from the
store with its files. Until it is dropped, the holder serves and refreshes it no more
(:meth:`Retirement.__contains__`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvsp.stores.blocks import FAULT_KINDS, BlockRef, BlockStore, StoredBlock

_log = logging.getLogger("kvsp.holder")


class Retirement:
    """The faulty blocks of one holder on their way out, and the count of faults by kind.

    ``withdraw(ref)`` withdraws the block's Replica Record (its failures are the caller's to
    retry); :meth:`attach` names the store whose blocks are retired.
    """

    def __init__(self, withdraw: Callable[[BlockRef], Awaitable[None]]) -> None:
        self.faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        """Storage faults found on reading, by kind (:data:`~kvsp.stores.blocks.FAULT_KINDS`)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop that retires blocks reported from worker threads."""
        self._withdraw = withdraw
        self._store: BlockStore | None = None
        self._tasks: dict[BlockRef, asyncio.Task[None]] = {}

    def attach(self, store: BlockStore) -> None:
        """Retire the blocks of ``store`` (whose ``on_fault`` is :meth:`on_fault`)."""
        self._store = store

    def __contains__(self, ref: object) -> bool:
        return ref in self._tasks

    def on_fault(self, block: StoredBlock, kind: str) -> None:
        """The store's listener: ``block`` was found ``kind``, on the loop or in a thread."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = running or self.loop
        if loop is None or loop.is_closed():  # nothing runs: nothing to withdraw either
            if self._store is not None and self._store.drop(block):
                self._count(block, kind)
        elif loop is running:
            self._retire(block, kind)
        else:  # queued before the worker's result, so a reader awaiting it finds the task
            loop.call_soon_threadsafe(self._retire, block, kind)

    async def settle(self, ref: BlockRef) -> None:
        """Wait until the block under ``ref`` is retired, if it is being retired."""
        task = self._tasks.get(ref)
        if task is not None:
            await asyncio.shield(task)

    async def close(self) -> None:
        """Let the retirements under way finish."""
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _retire(self, block: StoredBlock, kind: str) -> None:
        ref = block.meta.ref
        store = self._store
        if store is None or ref in self._tasks or store.get(ref, touch=False) is not block:
            return  # already on its way out, or gone
        self._count(block, kind)
        task = asyncio.create_task(self._withdraw_and_drop(store, block), name="kvsp-holder-fault")
        self._tasks[ref] = task
        task.add_done_callback(lambda _: self._tasks.pop(ref, None))

    def _count(self, block: StoredBlock, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        _log.warning("stored block %s is %s: withdrawn and deleted", block.meta.ref, kind)

    async def _withdraw_and_drop(self, store: BlockStore, block: StoredBlock) -> None:
        await self._withdraw(block.meta.ref)  # §6.6: withdraw before dropping leased data
        store.drop(block)
