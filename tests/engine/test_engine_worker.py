"""The one engine thread (:mod:`kvsp.engine.worker`): jobs and their errors, token streams,
an error in place of a token, and shutdown with work still queued."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

import pytest

from kvsp.engine.worker import Decoding, EngineWorker


class _Steps(Decoding):
    """Token ``10 * step`` at each step; at ``fail_at`` an error instead."""

    def __init__(self, step: int, count: int, fail_at: int | None = None) -> None:
        super().__init__(step, count)
        self.fail_at = fail_at
        self.threads: set[str] = set()

    def next_token(self) -> int | None:
        self.threads.add(threading.current_thread().name)
        if self.next_step == self.fail_at:
            self.send(ValueError("no logits"))
            return None
        return 10 * self.next_step


async def _tokens(worker: EngineWorker, decoding: Decoding) -> list[int]:
    return [token async for token in worker.stream(decoding)]


def test_jobs_run_on_the_engine_thread_and_errors_come_back() -> None:
    async def main() -> None:
        worker = EngineWorker("kvsp-test-engine")
        try:
            name = await asyncio.wrap_future(worker.submit(lambda: threading.current_thread().name))
            assert name == "kvsp-test-engine"
            with pytest.raises(ZeroDivisionError):
                await asyncio.wrap_future(worker.submit(divmod, 1, 0))
        finally:
            await worker.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            worker.submit(print)

    asyncio.run(main())


def test_streams_decode_one_token_a_round_and_raise_what_is_sent() -> None:
    async def main() -> None:
        worker = EngineWorker("kvsp-test-engine")
        try:
            first, second = _Steps(3, 4), _Steps(0, 5, fail_at=2)
            got = await asyncio.gather(
                _tokens(worker, first), _tokens(worker, second), return_exceptions=True
            )
            assert got[0] == [30, 40, 50, 60]
            assert isinstance(got[1], ValueError)
            assert first.threads == second.threads == {"kvsp-test-engine"}
            assert first.stopped and second.stopped
        finally:
            await worker.aclose()

    asyncio.run(main())


def test_a_stream_left_early_stops_its_decoding() -> None:
    async def main() -> None:
        worker = EngineWorker("kvsp-test-engine")
        try:
            decoding = _Steps(0, 1000)
            async with aclosing(worker.stream(decoding)) as tokens:
                async for token in tokens:
                    assert token == 0
                    break
            assert decoding.stopped
        finally:
            await worker.aclose()

    asyncio.run(main())


def test_close_cancels_queued_jobs_and_ends_streams() -> None:
    async def main() -> None:
        worker = EngineWorker("kvsp-test-engine", round_delay_s=0.001)
        started, release = threading.Event(), threading.Event()

        def busy() -> bool:
            started.set()
            return release.wait(10)

        running = worker.submit(busy)
        assert await asyncio.to_thread(started.wait, 5)  # the round in progress
        queued = worker.submit(int, "1")
        decoding = _Steps(0, 10**9)
        stream = asyncio.ensure_future(_tokens(worker, decoding))
        await asyncio.sleep(0)  # the stream starts its decoding
        closing = asyncio.ensure_future(worker.aclose())
        await asyncio.sleep(0)  # aclose takes the queue
        release.set()
        await closing
        assert await asyncio.wrap_future(running) is True
        assert queued.cancelled()
        assert await asyncio.wait_for(stream, 5) == []

    asyncio.run(main())
