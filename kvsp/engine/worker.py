"""The one engine thread that both engines run their compute on (DESIGN.md §1 "an agent around
an engine"; spec §6.5: prefetch MUST NOT block requests already admitted).

An engine owns its model state on a single thread, the stand-in for the device: each round it
runs one queued job (a prefill, a resume, a block export, a release) and then one decode step
of every sequence being generated, so a long prompt delays each running generation by one
round at most and the event loop never waits on compute. Jobs come back as
:class:`concurrent.futures.Future` objects (await them with :func:`asyncio.wrap_future`);
tokens come back through :meth:`Decoding.send`, a thread-safe call onto the event loop of the
stream that asked for them, so a busy loop delays delivery but never the engine.

It imports only the standard library, no torch: the toy engine and its users run without the
torch extra.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
Outcome = int | BaseException | None
"""What the engine thread hands a token stream: a token, an error, or the end."""
JOIN_TIMEOUT_S = 10.0
"""How long :meth:`EngineWorker.aclose` waits for the round in progress to end."""


class Decoding(ABC):
    """A sequence being decoded by the engine thread, and where its tokens go.

    Made inside the token stream (it binds to the running event loop); the engine thread
    calls :meth:`step` once a round, the stream reads what :meth:`send` delivers.
    """

    def __init__(self, step: int, count: int) -> None:
        self.next_step = step
        self.token: int | None = None
        self.remaining = count
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Outcome] = asyncio.Queue()
        self.stopped = False

    @abstractmethod
    def next_token(self) -> int | None:
        """The token at sampler step :attr:`next_step` (engine thread): the first from the
        state the prefill or resume left, each later one by a decode step after
        :attr:`token`; ``None`` ends the stream (once any error has been sent)."""

    def deliver(self, value: Outcome) -> None:
        """Queue ``value`` for the stream (event loop thread)."""
        self.queue.put_nowait(value)

    def send(self, value: Outcome) -> bool:
        """Hand ``value`` to the event loop; ``False`` once the loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.deliver, value)
        except RuntimeError:
            return False
        return True

    def step(self) -> bool:
        """Decode one token (engine thread); whether the sequence goes on."""
        if self.stopped or self.remaining <= 0:
            return False
        token = self.next_token()
        if token is None:
            return False
        self.token = token
        self.next_step += 1
        self.remaining -= 1
        return self.send(token) and self.remaining > 0


class EngineWorker:
    """The engine thread: queued jobs, then a decode round, until :meth:`aclose`.

    ``round_delay_s`` is slept after each round that decoded anything (the toy engine's
    emulated device time).
    """

    def __init__(self, name: str, *, round_delay_s: float = 0.0) -> None:
        self.round_delay_s = round_delay_s
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._decoding: list[Decoding] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the engine thread before its next decode round.

        Raises:
            RuntimeError: the engine is closed.
        """
        future: Future[T] = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._jobs.append((lambda: fn(*args), future))
            self._wake.notify()
        return future

    async def stream(self, decoding: Decoding) -> AsyncGenerator[int, None]:
        """Have the engine thread decode ``decoding``, one token per round, and yield the
        tokens as they come; an error it sends is raised here.

        Raises:
            BaseException: whatever the engine thread sent in place of a token.
        """
        self.start_decode(decoding)
        try:
            while (value := await decoding.queue.get()) is not None:
                if isinstance(value, BaseException):
                    raise value
                yield value
        finally:
            decoding.stopped = True

    def start_decode(self, decoding: Decoding) -> None:
        """Have the engine thread decode ``decoding``'s sequence, one token per round."""
        with self._wake:
            self._decoding.append(decoding)
            self._wake.notify()

    @staticmethod
    def _execute(job: Callable[[], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = job()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _run(self) -> None:
        """Each round: one queued job, then one decode step of every running sequence."""
        while True:
            with self._wake:
                while not (self._jobs or self._decoding or self._closed):
                    self._wake.wait()
                if self._closed:
                    return
                job = self._jobs.popleft() if self._jobs else None
                batch = list(self._decoding)
            if job is not None:
                self._execute(*job)
            finished = [decoding for decoding in batch if not decoding.step()]
            if finished:
                with self._wake:
                    self._decoding = [d for d in self._decoding if d not in finished]
                for decoding in finished:
                    decoding.send(None)
            if batch and self.round_delay_s:
                time.sleep(self.round_delay_s)  # the emulated device time of the round

    async def aclose(self) -> None:
        """Stop the engine thread (after the round it is running), cancel the queued jobs
        and end the token streams."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            jobs, self._jobs = list(self._jobs), deque()
            decoding, self._decoding = self._decoding, []
        await asyncio.to_thread(self._thread.join, JOIN_TIMEOUT_S)
        for _, future in jobs:
            future.cancel()
        for each in decoding:
            each.send(None)  # ends their token streams
