"""The engine interface an inference instance drives (DESIGN.md §1: "an agent around an
engine"; spec §4.4 Instance Status Record for the measured figures).

An engine computes KV caches of the geometry of its Compatibility Descriptor (§4.1), takes
loaded blocks as the prefix of a prompt, computes the rest, and generates tokens. It knows
nothing of scopes, holders or HTTP: the instance computes the Block Keys (§4.2), finds held
blocks, publishes computed ones and streams tokens.

Engines run their compute off the event loop (on the one engine thread of
:mod:`kvsp.engine.worker`, standing in for the device), so that transfers and verification
interleave with generation (§6.5: prefetch MUST NOT block requests already admitted). Two
implementations: :mod:`kvsp.engine.toy` (CPU, deterministic, for tests and the default) and
the torch reference engine behind an adapter.

Sessions (§6.8) need three more things of an engine: a :class:`Sampling` whose draw at step s is
a pure function of (seed, s), so a sampler restored at ``step`` continues the same sample;
:meth:`EngineSequence.block` to export a block of generated tokens once its KV is complete;
and :meth:`InferenceEngine.resume`, which takes loaded blocks whose tokens are known by their
keys only, computes the rest of the prompt as a prefill and replays output tokens by decode
steps, exactly as the run that produced them did.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import Container, Geometry
from kvsp.errors import Incompatible, RecordError
from kvsp.ids import BlockKey
from kvsp.registries import Codec

SAMPLER_LABEL = b"KVSP-SAMPLER-1\x00"
"""``"KVSP-SAMPLER-1" || 0x00``, the prefix of each step's draw (both engines)."""
_STEP_INPUT = struct.Struct("!QQ")
SAMPLING_METHODS: Mapping[str, frozenset[str]] = {
    "greedy": frozenset(),
    "temperature": frozenset({"temperature"}),
    "top-k": frozenset({"k", "temperature"}),
    "top-p": frozenset({"p", "temperature"}),
}
"""Method → the parameters it takes (the reference engine's sampler accepts these)."""
_REQUIRED = {"temperature": "temperature", "top-k": "k", "top-p": "p"}
_UINT64 = 2**64 - 1


def step_draw(seed: int, step: int) -> bytes:
    """The 32 octets of randomness of sampler step ``step``: a pure function of (seed, step)."""
    return hashlib.sha256(SAMPLER_LABEL + _STEP_INPUT.pack(seed, step)).digest()


def check_sampling_param(key: str, value: object, path: str) -> None:
    """Check one sampler parameter's value (the method's own rules: k, p, temperature).

    Raises:
        RecordError: not a finite number, or out of the parameter's range; ``path`` names it.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordError("expected a finite number", path=path)
    if key == "k" and (value != int(value) or value < 1):
        raise RecordError("k must be an integer >= 1", path=path)
    if key == "p" and not 0 < value <= 1:
        raise RecordError("p must be in (0, 1]", path=path)
    if key == "temperature" and value <= 0:
        raise RecordError("temperature must be > 0", path=path)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How a sequence picks its tokens: ``method`` with ``params`` and ``seed``.

    With a seed, the choice at step s depends only on the logits (or state), the seed and s
    (§6.8 "restores the sampler with the given method, parameters, seed, and step"). Without
    one (``None``) the engine draws a private seed for each run, so a resumed run samples anew:
    such a sampler is not deterministic.

    Raises:
        RecordError: an unknown method, a parameter it does not take or out of range, a missing
            required one, or a seed outside 0..2^64-1.
    """

    method: str = "greedy"
    params: Mapping[str, float] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        allowed = SAMPLING_METHODS.get(self.method)
        if allowed is None:
            known = ", ".join(SAMPLING_METHODS)
            raise RecordError(f"unknown method {self.method!r} ({known})", path="$.method")
        for key, value in self.params.items():
            if key not in allowed:
                raise RecordError(f"{self.method} takes no such parameter", path=f"$.params.{key}")
            check_sampling_param(key, value, f"$.params.{key}")
        needed = _REQUIRED.get(self.method)
        if needed is not None and needed not in self.params:
            raise RecordError(f"{self.method} needs {needed}", path=f"$.params.{needed}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed <= _UINT64):
            raise RecordError("seed must be an integer in 0..2^64-1", path="$.seed")

    @property
    def reproducible(self) -> bool:
        """Whether the same state gives the same tokens again: greedy, or seeded."""
        return self.method == "greedy" or self.seed is not None

    def run_seed(self) -> int:
        """The seed a run uses: the given one, else a fresh private one."""
        return self.seed if self.seed is not None else secrets.randbits(63)


GREEDY = Sampling()


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


def check_loaded_block(
    block: Container, descriptor: CompatibilityDescriptor, geometry: Geometry
) -> None:
    """Accept ``block`` as loaded KV only if it is a whole raw block of the engine's geometry:
    every layer, ``block_tokens`` tokens, sections of the descriptor's size (§4.3).

    Raises:
        Incompatible: a block of another geometry, a layer range or a compressed codec.
    """
    section = geometry.section_length(descriptor.block_tokens)
    if (
        block.codec != Codec.RAW
        or block.first_layer != 0
        or block.layer_count != descriptor.layers
        or block.token_count != descriptor.block_tokens
        or any(x.k.nbytes != section or x.v.nbytes != section for x in block.layers)
    ):
        raise Incompatible("a loaded block must be a whole raw block of this geometry")


def lookup_held(
    held: OrderedDict[BlockKey, Container], keys: Sequence[BlockKey]
) -> list[Container]:
    """The blocks in ``held`` of the leading ``keys``, up to the first one not held; each one
    found becomes the most recently used."""
    found = []
    for key in keys:
        block = held.get(key)
        if block is None:
            break
        held.move_to_end(key)
        found.append(block)
    return found


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

    def tokens(
        self, max_tokens: int, sampling: Sampling = GREEDY, step: int = 0
    ) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` tokens, one decode step each; the first is chosen at
        sampler step ``step`` from the state the prefill (or resume) left."""
        ...

    async def block(self, index: int) -> bytes:
        """Block ``index`` of the sequence (prompt or generated) as a KVB1 container with
        every layer (§4.3), once its KV is complete.

        Raises:
            LayersUnavailable: the block is not complete yet.
        """
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

    async def resume(
        self, loaded: Sequence[Container], prefill: Sequence[int], replay: Sequence[int]
    ) -> EngineSequence:
        """Rebuild a session's context (§6.8 steps 1-2): ``loaded`` as its first blocks (their
        tokens unknown), then ``prefill`` computed as one prefill (the rest of the prompt),
        then ``replay`` fed one decode step each (output tokens already delivered).

        Raises:
            BadRequest: nothing after the loaded blocks to compute.
            Incompatible: a loaded container of another geometry.
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
