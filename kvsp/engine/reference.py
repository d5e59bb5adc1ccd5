"""The torch reference engine behind the instance agent (DESIGN.md §5–6; an
:class:`~kvsp.engine.api.InferenceEngine`).

An adapter over :class:`kvsp.engine.engine.Engine`: loaded containers (verified by the agent
against their Replica Records, §6.7) go into fresh KV pages, the engine computes the rest of
the prompt with the loaded pages as its prefix, and the complete blocks it computed come back
as KVB1 containers for the agent to publish (§4.3, §6.1). Tokens are chosen by
:class:`kvsp.engine.sampler.Sampler` (greedy by default), whose draw at step s is a pure
function of the seed and s, so a session resumed at ``output_offset`` (§6.8) continues the same
sample: :meth:`TorchEngine.resume` loads the checkpoint's blocks, computes the rest of the
prompt in the same position-aligned chunks as the original prefill and replays the output
tokens by single decode steps, as the original run computed them, so on one machine the logits
and the tokens are bit-identical. The rates in :meth:`TorchEngine.stats` are the engine's
measured tokens per second and its KV pages in use.

Threading is the toy engine's: the one engine thread of :mod:`kvsp.engine.worker` owns the
model and the paged cache and runs, each round, one queued job (a prefill or a release) and
then one decode step of every sequence being generated, so the event loop never waits on
compute. Held blocks (§6.5 prefetch targets and blocks computed here) stay in host memory as
containers and are copied into pages when a prompt uses them.

torch is imported only by this module and the torch engine's own submodules of
:mod:`kvsp.engine`; nothing imports this module unless ``--engine reference`` is chosen.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import Container, Geometry
from kvsp.engine import api
from kvsp.engine.api import GREEDY, ComputedBlock, EngineStats, Sampling
from kvsp.engine.worker import Decoding, EngineWorker
from kvsp.errors import BadRequest, Conflict, InsufficientStorage
from kvsp.ids import BlockKey

if TYPE_CHECKING:
    import torch

    from kvsp.engine.engine import Engine
    from kvsp.engine.kvcache import KVSequence
    from kvsp.engine.sampler import Sampler


class TorchSequence:
    """One prompt in the reference engine (an :class:`~kvsp.engine.api.EngineSequence`)."""

    def __init__(self, engine: TorchEngine, seq: KVSequence, loaded_blocks: int) -> None:
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
    """A reference sequence being decoded: the first token comes from the logits the prefill
    (or resume) left, each later one from a decode step."""

    def __init__(self, seq: TorchSequence, sampler: Sampler, step: int, count: int) -> None:
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


class TorchEngine:
    """The reference engine behind the instance agent.

    Raises:
        CheckpointError: the model folder cannot be loaded.
        BadRequest: an unsupported ``kv_dtype`` or ``dtype``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        num_pages: int = 1024,
        block_tokens: int = 16,
        kv_dtype: str = "fp32",
        dtype: str = "fp32",
        prefill_chunk: int | None = None,
        held_blocks: int | None = None,
    ) -> None:
        from kvsp.engine.engine import Engine

        self.engine: Engine = Engine(
            model_dir,
            device=device,
            num_pages=num_pages,
            block_tokens=block_tokens,
            kv_dtype=kv_dtype,
            dtype=dtype,
            prefill_chunk=prefill_chunk,
        )
        self._descriptor = self.engine.descriptor
        self.geometry = Geometry.from_descriptor(self._descriptor)
        self.vocab = self.engine.config.vocab_size
        self.held_capacity = held_blocks if held_blocks is not None else num_pages
        self._held: OrderedDict[BlockKey, Container] = OrderedDict()
        self.worker = EngineWorker("kvsp-torch-engine")
        """The engine thread: it owns the model and the paged cache."""

    @property
    def descriptor(self) -> CompatibilityDescriptor:
        """The Compatibility Descriptor of the model's checkpoint files (§4.1)."""
        return self._descriptor

    def stats(self) -> EngineStats:
        """The engine's measured prefill and decode tokens/s and the KV pages in use."""
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

    async def prefill(self, prompt: Sequence[int], loaded: Sequence[Container]) -> TorchSequence:
        """Copy ``loaded`` into pages as the first blocks of ``prompt``, compute the rest.

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
        bad = next((t for t in prompt if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BadRequest(
                f"token {bad} is outside the model's {self.vocab} ids", path="$.prompt"
            )
        for block in loaded:
            self._check_block(block)
        return await asyncio.wrap_future(
            self.worker.submit(self._run_prefill, list(prompt), loaded)
        )

    def _run_prefill(self, prompt: list[int], loaded: Sequence[Container]) -> TorchSequence:
        """Import, compute and export on the engine thread."""
        engine, b = self.engine, self._descriptor.block_tokens

        def compute(seq: TorchSequence, adopted: list[int]) -> None:
            seq.logits = engine.prefill(seq.kv, prompt, loaded_prefix_pages=adopted)
            seq.computed = [
                ComputedBlock(i, engine.block_container(seq.kv, i))
                for i in range(len(loaded), len(prompt) // b)
            ]

        return self._build(loaded, len(prompt), compute)

    async def resume(
        self, loaded: Sequence[Container], prefill: Sequence[int], replay: Sequence[int]
    ) -> TorchSequence:
        """Copy ``loaded`` into pages as a session's first blocks, compute ``prefill`` as a
        prefill, then replay ``replay`` by single decode steps (§6.8 steps 1-2).

        Raises:
            BadRequest: nothing to compute, or a token outside the vocabulary.
            Incompatible: a loaded block of another geometry.
            InsufficientStorage: no free KV pages for the context.
        """
        if not prefill and not replay:
            raise BadRequest("nothing to compute after the loaded blocks")
        bad = next((t for t in (*prefill, *replay) if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BadRequest(f"token {bad} is outside the model's {self.vocab} ids")
        for block in loaded:
            self._check_block(block)
        job = self.worker.submit(self._run_resume, loaded, list(prefill), list(replay))
        return await asyncio.wrap_future(job)

    def _run_resume(
        self, loaded: Sequence[Container], prefill: list[int], replay: list[int]
    ) -> TorchSequence:
        """Import, compute and replay on the engine thread."""
        engine = self.engine

        def compute(seq: TorchSequence, adopted: list[int]) -> None:
            engine.adopt_pages(seq.kv, adopted)
            logits = engine.prefill(seq.kv, prefill) if prefill else None
            for token in replay:
                logits = engine.decode(seq.kv, token)
            seq.logits = logits

        total = len(loaded) * self._descriptor.block_tokens + len(prefill) + len(replay)
        return self._build(loaded, total, compute)

    def _build(
        self,
        loaded: Sequence[Container],
        tokens: int,
        compute: Callable[[TorchSequence, list[int]], None],
    ) -> TorchSequence:
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
        seq = TorchSequence(self, engine.new_sequence(), len(loaded))
        try:
            for block in loaded:
                # verified by the agent against the Replica Record's digests (§6.7)
                pages.append(engine.import_block(block.encode()))
            adopted, pages = pages, []  # the sequence owns them from here on
            compute(seq, adopted)
        except BaseException as exc:
            engine.cache.free(pages)
            self.free(seq)
            if isinstance(exc, Conflict):
                raise InsufficientStorage(f"the KV cache is full: {exc}") from exc
            raise
        return seq

    def free(self, seq: TorchSequence) -> None:
        """Release ``seq``'s pages (engine thread; idempotent)."""
        if not seq.released:
            seq.released = True
            self.engine.free(seq.kv)

    async def aclose(self) -> None:
        """Stop the engine thread (after the round it is running) and background loads."""
        await self.worker.aclose()
        self.engine.close()
