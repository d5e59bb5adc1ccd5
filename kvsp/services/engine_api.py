"""The engine interface an inference instance drives (DESIGN.md §1: "an agent around an
engine"; spec §4.4 Instance Status Record for the measured figures).

An engine computes KV caches of the geometry of its Compatibility Descriptor (§4.1), takes
loaded blocks as the prefix of a prompt, computes the rest, and generates tokens. It knows
nothing of scopes, holders or HTTP: the instance computes the Block Keys (§4.2), finds held
blocks, publishes computed ones and streams tokens.

Engines run their compute off the event loop (a worker thread standing in for the device),
so that transfers and verification interleave with generation (§6.5: prefetch MUST NOT block
requests already admitted). Two implementations: :mod:`kvsp.services.toy_engine` (CPU,
deterministic, for tests and the default) and the torch reference engine behind an adapter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import Container
from kvsp.ids import BlockKey


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Measured figures for the Instance Status Record (§4.4): tokens per second of prefill
    and decode over recent work (0 before any), and the share of KV memory in use."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_utilization: float


@dataclass(frozen=True, slots=True)
class ComputedBlock:
    """A complete block of a prompt that the engine computed: its index in the prompt and its
    KVB1 container with every layer (§4.3)."""

    index: int
    container: bytes


class EngineSequence(Protocol):
    """One prompt in the engine: its prefix was loaded or computed, generation follows."""

    @property
    def loaded_blocks(self) -> int:
        """How many leading blocks came from loaded containers."""
        ...

    @property
    def computed(self) -> Sequence[ComputedBlock]:
        """The complete blocks of the prompt computed here, in order (after the loaded ones)."""
        ...

    def tokens(self, max_tokens: int) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` tokens, one decode step each."""
        ...

    async def release(self) -> None:
        """Free the sequence's KV memory (idempotent)."""
        ...


class InferenceEngine(Protocol):
    """What an instance needs of an engine."""

    @property
    def descriptor(self) -> CompatibilityDescriptor:
        """The Compatibility Descriptor of the caches it makes and takes (§4.1)."""
        ...

    def stats(self) -> EngineStats:
        """Measured prefill and decode rates and KV utilization."""
        ...

    async def prefill(self, prompt: Sequence[int], loaded: Sequence[Container]) -> EngineSequence:
        """Take ``loaded`` as the KV of blocks ``0..len(loaded)-1`` of ``prompt`` and compute
        the rest of the prompt.

        Raises:
            BadRequest: an empty prompt, or more loaded blocks than the prompt has.
            Incompatible: a loaded container of another geometry or token count.
            InsufficientStorage: no KV memory left for the sequence.
        """
        ...

    def hold(self, key: BlockKey, block: Container) -> bool:
        """Keep a verified block in KV memory for later prompts; whether it is held."""
        ...

    def lookup(self, keys: Sequence[BlockKey]) -> list[Container]:
        """The held blocks of the leading ``keys``, up to the first one not held."""
        ...

    async def aclose(self) -> None:
        """Stop the engine's workers."""
        ...
