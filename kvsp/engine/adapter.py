"""The instance-facing adapter shared by the torch engines (DESIGN.md §1, §5–6; an
:class:`~kvsp.engine.api.InferenceEngine` over an :class:`EngineCore`).

A core computes one sequence at a time on the engine thread: it imports loaded KVB1 blocks
(§4.3) as pages, prefills the rest of a prompt in block-aligned chunks, decodes single tokens
and exports complete blocks. :class:`CoreEngine` puts that core behind the instance agent:
loaded containers (verified by the agent against their Replica Records, §6.7) become the first
blocks of a sequence, the complete blocks the core computed come back for publishing (§6.1),
tokens are chosen by :class:`kvsp.engine.sampler.Sampler`, whose draw at step s is a pure
function of the seed and s, and :meth:`CoreEngine.resume` rebuilds a session (§6.8) by loading
its blocks, computing the rest of the prompt as a prefill and replaying the delivered output
tokens by single decode steps, exactly as the original run computed them.

Threading: the one engine thread of :mod:`kvsp.engine.worker` owns the core and runs, each
round, one queued job (a prefill, a resume or a release) and then one decode step of every
sequence being generated, so the event loop never waits on compute. Held blocks (§6.5
prefetch targets and blocks computed here) stay in host memory as containers and are imported
when a prompt uses them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Protocol

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import Buffer, Container, Geometry
from kvsp.engine import api
from kvsp.engine.api import GREEDY, ComputedBlock, EngineStats, Sampling
from kvsp.engine.worker import Decoding, EngineWorker
from kvsp.errors import BadRequest, Conflict, InsufficientStorage
from kvsp.ids import BlockKey

if TYPE_CHECKING:
    import torch

    from kvsp.engine.kvcache import KVSequence
    from kvsp.engine.sampler import Sampler


class PageAllocator(Protocol):
    """The KV pages of a core: one page holds one block of one sequence."""

    @property
    def num_pages(self) -> int:
        """Pages in all."""
        ...

    @property
    def used_pages(self) -> int:
        """Pages allocated."""
        ...

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the pool."""
        ...


class Rates(Protocol):
    """A core's measured figures (§4.4)."""

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill tokens per second."""
        ...

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens per second."""
        ...

    @property
    def kv_utilization(self) -> float:
        """Share of the pages in use."""
        ...


class EngineCore(Protocol):
    """What :class:`CoreEngine` needs of a model with a KV cache (engine thread only)."""

    @property
    def descriptor(self) -> CompatibilityDescriptor:
        """The Compatibility Descriptor of the caches it makes and takes (§4.1)."""
        ...

    @property
    def cache(self) -> PageAllocator:
        """Its KV pages."""
        ...

    def stats(self) -> Rates:
        """Measured prefill and decode rates and KV utilization."""
        ...

    def new_sequence(self) -> KVSequence:
        """An empty sequence."""
        ...

    def import_block(self, container: Buffer) -> int:
        """Load one verified container into a fresh page and return the page."""
        ...

    def adopt_pages(self, seq: KVSequence, pages: Sequence[int]) -> None:
        """Make loaded ``pages`` the first blocks of the empty ``seq`` (tokens unknown)."""
        ...

    def prefill(
        self,
        seq: KVSequence,
        tokens: Sequence[int],
        *,
        loaded_prefix_pages: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` (the first blocks loaded into ``loaded_prefix_pages``), computing
        the rest; the last token's logits."""
        ...

    def decode(self, seq: KVSequence, token: int) -> torch.Tensor:
        """Append one token; its logits."""
        ...

    def block_container(self, seq: KVSequence, block_index: int) -> bytes:
        """Block ``block_index`` of ``seq`` as a KVB1 container with every layer."""
        ...

    def free(self, seq: KVSequence) -> None:
        """Release the sequence's pages."""
        ...

    def close(self) -> None:
        """Stop background work."""
        ...


class CoreSequence:
    """One prompt in a :class:`CoreEngine` (an :class:`~kvsp.engine.api.EngineSequence`)."""

    def __init__(self, engine: CoreEngine, seq: KVSequence, loaded_blocks: int) -> None:
        self._engine = engine
        self.kv = seq
        self.loaded_blocks = loaded_blocks
        self.computed: list[ComputedBlock] = []
        self.logits: torch.Tensor | None = None
        """The logits of the last token computed: the first token is chosen from them."""
        self.released = False

    async def tokens(
        self, max_tokens: int, sampling: Sampling = GREEDY, step: int = 0
    ) -> AsyncIterator[int]:
        """Up to ``max_tokens`` tokens, the first at sampler step ``step``; the engine thread
        chooses the first from the prefill's logits and decodes one more per round.

        Raises:
            InsufficientStorage: the KV cache filled up while decoding.
        """
        if max_tokens <= 0 or self.released:
            return
        from kvsp.engine.sampler import Sampler

        sampler = Sampler(
            method=sampling.method, params=dict(sampling.params), seed=sampling.run_seed()
        )
        decoding = _Decoding(self, sampler, step, max_tokens)
        async with aclosing(self._engine.worker.stream(decoding)) as tokens:
            async for token in tokens:
                yield token

    async def block(self, index: int) -> bytes:
        """Block ``index`` (prompt or generated) as a KVB1 container, read on the engine
        thread between decode rounds.

        Raises:
            LayersUnavailable: the block is not complete yet.
        """
        engine = self._engine.engine
        return await asyncio.wrap_future(
            self._engine.worker.submit(engine.block_container, self.kv, index)
        )

    async def release(self) -> None:
        """Free the sequence's pages on the engine thread (idempotent)."""
        if self.released:
            return
        try:
            await asyncio.wrap_future(self._engine.worker.submit(self._engine.free, self))
        except RuntimeError:
            self.released = True  # the engine is closed; its cache goes with it


class _Decoding(Decoding):
    """A sequence being decoded: the first token comes from the logits the prefill (or
    resume) left, each later one from a decode step."""

    def __init__(self, seq: CoreSequence, sampler: Sampler, step: int, count: int) -> None:
        super().__init__(step, count)
        self.seq = seq
        self.sampler = sampler

    def next_token(self) -> int | None:
        """The sampler's choice from the current logits (engine thread); ``None`` once the
        sequence is released or after sending a full cache as the error."""
        if self.seq.released:
            return None
        try:
            if self.token is None:
                logits = self.seq.logits
                if logits is None:
                    raise Conflict("the sequence has no logits to choose from")
            else:
                logits = self.seq._engine.engine.decode(self.seq.kv, self.token)
        except Conflict as exc:
            self.send(InsufficientStorage(f"KV cache full while decoding: {exc}"))
            return None
        return self.sampler.sample(logits, self.next_step)


class CoreEngine:
    """An :class:`EngineCore` behind the instance agent; ``vocab`` is the model's id count."""

    def __init__(self, core: EngineCore, *, vocab: int, held_blocks: int, thread_name: str) -> None:
        self.engine = core
        self._descriptor = core.descriptor
        self.geometry = Geometry.from_descriptor(self._descriptor)
        self.vocab = vocab
        self.held_capacity = held_blocks
        self._held: OrderedDict[BlockKey, Container] = OrderedDict()
        self.worker = EngineWorker(thread_name)
        """The engine thread: it owns the model and the KV cache."""

    @property
    def descriptor(self) -> CompatibilityDescriptor:
        """The Compatibility Descriptor of the model's checkpoint files (§4.1)."""
        return self._descriptor

    def stats(self) -> EngineStats:
        """The core's measured prefill and decode tokens/s and the KV pages in use."""
        measured = self.engine.stats()
        return EngineStats(
            prefill_tokens_per_s=measured.prefill_tokens_per_s,
            decode_tokens_per_s=measured.decode_tokens_per_s,
            kv_utilization=measured.kv_utilization,
        )

    # -- held blocks (event loop thread) ---------------------------------------------------------

    def _check_block(self, block: Container) -> None:
        api.check_loaded_block(block, self._descriptor, self.geometry)

    def hold(self, key: BlockKey, block: Container) -> bool:
        """Keep a verified block in host memory for later prompts (LRU); whether it is held.

        Raises:
            Incompatible: a block of another geometry.
        """
        self._check_block(block)
        if key in self._held:
            self._held.move_to_end(key)
            return True
        if self.held_capacity < 1:
            return False
        while len(self._held) >= self.held_capacity:
            self._held.popitem(last=False)
        self._held[key] = block
        return True

    def lookup(self, keys: Sequence[BlockKey]) -> list[Container]:
        """The held blocks of the leading ``keys``, up to the first one not held."""
        return api.lookup_held(self._held, keys)

    # -- compute -----------------------------------------------------------------------------

    def _check_tokens(self, tokens: Iterable[int], path: str | None) -> None:
        bad = next((t for t in tokens if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BadRequest(f"token {bad} is outside the model's {self.vocab} ids", path=path)

    async def prefill(self, prompt: Sequence[int], loaded: Sequence[Container]) -> CoreSequence:
        """Import ``loaded`` as the first blocks of ``prompt``, compute the rest.

        Raises:
            BadRequest: an empty prompt, a token outside the vocabulary, or more loaded
                blocks than the prompt has.
            Incompatible: a loaded block of another geometry.
            InsufficientStorage: no free KV pages for the prompt.
        """
        b = self._descriptor.block_tokens
        if not prompt:
            raise BadRequest("a prompt needs at least one token", path="$.prompt")
        if len(loaded) > len(prompt) // b:
            raise BadRequest("more loaded blocks than the prompt has")
        self._check_tokens(prompt, "$.prompt")
        for block in loaded:
            self._check_block(block)
        return await asyncio.wrap_future(
            self.worker.submit(self._run_prefill, list(prompt), loaded)
        )

    def _run_prefill(self, prompt: list[int], loaded: Sequence[Container]) -> CoreSequence:
        """Import, compute and export on the engine thread."""
        engine, b = self.engine, self._descriptor.block_tokens

        def compute(seq: CoreSequence, adopted: list[int]) -> None:
            seq.logits = engine.prefill(seq.kv, prompt, loaded_prefix_pages=adopted)
            seq.computed = [
                ComputedBlock(i, engine.block_container(seq.kv, i))
                for i in range(len(loaded), len(prompt) // b)
            ]

        return self._build(loaded, len(prompt), compute)

    async def resume(
        self, loaded: Sequence[Container], prefill: Sequence[int], replay: Sequence[int]
    ) -> CoreSequence:
        """Import ``loaded`` as a session's first blocks, compute ``prefill`` as a prefill,
        then replay ``replay`` by single decode steps (§6.8 steps 1-2).

        Raises:
            BadRequest: nothing to compute, or a token outside the vocabulary.
            Incompatible: a loaded block of another geometry.
            InsufficientStorage: no free KV pages for the context.
        """
        if not prefill and not replay:
            raise BadRequest("nothing to compute after the loaded blocks")
        self._check_tokens((*prefill, *replay), None)
        for block in loaded:
            self._check_block(block)
        job = self.worker.submit(self._run_resume, loaded, list(prefill), list(replay))
        return await asyncio.wrap_future(job)

    def _run_resume(
        self, loaded: Sequence[Container], prefill: list[int], replay: list[int]
    ) -> CoreSequence:
        """Import, compute and replay on the engine thread."""
        engine = self.engine

        def compute(seq: CoreSequence, adopted: list[int]) -> None:
            engine.adopt_pages(seq.kv, adopted)
            logits = engine.prefill(seq.kv, prefill) if prefill else None
            for token in replay:
                logits = engine.decode(seq.kv, token)
            seq.logits = logits

        total = len(loaded) * self._descriptor.block_tokens + len(prefill) + len(replay)
        return self._build(loaded, total, compute)

    def _import(self, block: Container) -> int:
        """Load one verified container into a fresh page of the core (engine thread)."""
        return self.engine.import_block(block.encode())

    def _build(
        self,
        loaded: Sequence[Container],
        tokens: int,
        compute: Callable[[CoreSequence, list[int]], None],
    ) -> CoreSequence:
        """A new sequence of ``tokens`` tokens: ``loaded`` imported into pages, which
        ``compute`` gives to the sequence before it computes the rest (engine thread).

        Raises:
            InsufficientStorage: too few free KV pages, or the cache filled up.
        """
        engine, b = self.engine, self._descriptor.block_tokens
        free = engine.cache.num_pages - engine.cache.used_pages
        if free < -(-tokens // b):
            raise InsufficientStorage(f"the KV cache has {free} free pages")
        pages: list[int] = []
        seq = CoreSequence(self, engine.new_sequence(), len(loaded))
        try:
            for block in loaded:
                # verified by the agent against the Replica Record's digests (§6.7)
                pages.append(self._import(block))
            adopted, pages = pages, []  # the sequence owns them from here on
            compute(seq, adopted)
        except BaseException as exc:
            engine.cache.free(pages)
            self.free(seq)
            if isinstance(exc, Conflict):
                raise InsufficientStorage(f"the KV cache is full: {exc}") from exc
            raise
        return seq

    def free(self, seq: CoreSequence) -> None:
        """Release ``seq``'s pages (engine thread; idempotent)."""
        if not seq.released:
            seq.released = True
            self.engine.free(seq.kv)

    async def aclose(self) -> None:
        """Stop the engine thread (after the round it is running) and background loads."""
        await self.worker.aclose()
        self.engine.close()
