"""A deterministic CPU engine for tests and the default instance (DESIGN.md §1 "an agent around
an engine"; spec §4.3 for the KV it produces).

It is a small integer recurrent network, not a transformer, but everything the protocol sees is
real: KV tensors of the descriptor's geometry (``layers × token × kv_heads × head_dim`` in
``kv_dtype``, layout kvsp-layout-1), computed with a matrix-vector product per token per layer,
so the prefill and decode rates it reports are measured from wall time; a KV memory of
``capacity_blocks`` blocks; and a token generator where the next token is a hash of the
context. The weights are seeded from the Compatibility ID, so two instances with the same
descriptor compute bit-identical blocks for the same prefix.

Per token ``t`` and layer ``l``, with ``x`` the token's embedding for layer 0 and the layer
below's state above it: ``h_l[t] = squash(A_l @ h_l[t-1] + B_l @ x)``, ``K_l[t] = h_l[t]``,
``V_l[t] = squash(W_l @ h_l[t])``. States are integers in [-127, 127] stored as ``h / 128``,
which every supported element type (fp32, fp16, bf16, int8 as ``h``) holds exactly; so a
loaded block gives back the very state that computed it, and generation after a loaded prefix
equals generation after a recomputed one. Integer arithmetic keeps results independent of BLAS.

There is no distribution to sample from: greedy takes a hash of the top layer's state, and the
sampled methods hash that state with the step's draw (:func:`~kvsp.engine.api.step_draw`
of the seed and the step), which keeps what §6.8 relies on: a seeded choice is a pure function
of the context, the seed and the step. ``decode_delay_s`` stands in for the device time of a
decode round (the engine thread sleeps that long after each), so that tests and demos can watch
a generation in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import numpy as np

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Container, Geometry, encode_container
from kvsp.engine import api
from kvsp.engine.api import GREEDY, ComputedBlock, EngineStats, Sampling, step_draw
from kvsp.engine.worker import Decoding, EngineWorker, Outcome
from kvsp.errors import BadRequest, Incompatible, InsufficientStorage, LayersUnavailable
from kvsp.ids import BlockKey
from kvsp.registries import Codec

FloatArray = np.ndarray[Any, np.dtype[np.float64]]
Int8Array = np.ndarray[Any, np.dtype[np.int8]]

EMBEDDINGS = 1024
"""Rows of the embedding table; tokens are hashed onto them."""
WEIGHT_RANGE = 3
"""Weights are integers in [-WEIGHT_RANGE, WEIGHT_RANGE]."""
SCALE = 128.0
"""A state ``h`` is stored as ``h / SCALE``: exact in every supported element type."""
SUPPORTED_DTYPES = frozenset({"fp32", "fp16", "bf16", "int8"})
RATE_WINDOW = 64
"""Calls over which the prefill and decode rates are measured."""
MATVEC_CHUNK = 1 << 16
"""Elements per matrix-vector product: OpenBLAS turns multi-threaded above about this size,
which costs far more than it gains on a busy small machine, so larger matrices are applied in
row chunks."""


def toy_descriptor(
    *,
    layers: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    kv_dtype: str = "fp16",
    block_tokens: int = 16,
) -> CompatibilityDescriptor:
    """The toy engine's default Compatibility Descriptor (§4.1) with the given geometry."""
    return CompatibilityDescriptor(
        model="kvsp-toy",
        model_digest=hashlib.sha256(b"kvsp-toy-1 weights").digest(),
        tokenizer_digest=hashlib.sha256(b"kvsp-toy-1 tokenizer: uint32 ids").digest(),
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        positional="none",
        block_tokens=block_tokens,
    )


def _squash(pre: FloatArray) -> FloatArray:
    """Mix integers into [-127, 127] (a hash, standing in for an activation)."""
    mixed: FloatArray = (((pre.astype(np.int64) * 2654435761) >> 13) % 255 - 127).astype(np.float64)
    return mixed


class _Matrix:
    """A weight matrix applied in row chunks of at most :data:`MATVEC_CHUNK` elements."""

    def __init__(self, values: FloatArray) -> None:
        rows = max(1, MATVEC_CHUNK // values.shape[1])
        self.chunks = [values[i : i + rows] for i in range(0, values.shape[0], rows)]

    def __matmul__(self, vector: FloatArray) -> FloatArray:
        if len(self.chunks) == 1:
            single: FloatArray = self.chunks[0] @ vector
            return single
        return np.concatenate([chunk @ vector for chunk in self.chunks])


def encode_states(states: Int8Array, kv_dtype: str) -> bytes:
    """States ``[tokens, width]`` as a K or V section in ``kv_dtype`` (little-endian, §4.3)."""
    if kv_dtype == "int8":
        return states.astype("i1").tobytes()
    values = states.astype("<f4") / np.float32(SCALE)
    if kv_dtype == "fp32":
        return values.tobytes()
    if kv_dtype == "fp16":
        return values.astype("<f2").tobytes()
    # bf16 is the top half of fp32; exact here, since a state has at most 8 significant bits.
    return (values.view("<u4") >> 16).astype("<u2").tobytes()


def decode_states(section: memoryview, kv_dtype: str, width: int) -> Int8Array:
    """A K or V section in ``kv_dtype`` back into states ``[tokens, width]``, clipped to
    [-127, 127] (octets from another producer may hold anything)."""
    if kv_dtype == "int8":
        raw = np.frombuffer(section, dtype="i1").astype(np.int64)
    else:
        if kv_dtype == "bf16":
            values = (np.frombuffer(section, dtype="<u2").astype("<u4") << 16).view("<f4")
        else:
            values = np.frombuffer(section, dtype="<f4" if kv_dtype == "fp32" else "<f2")
        raw = np.rint(np.nan_to_num(values.astype(np.float64)) * SCALE).astype(np.int64)
    states: Int8Array = np.clip(raw, -127, 127).astype(np.int8).reshape(-1, width)
    return states


class _Weights:
    """The layers' matrices and the embedding table, seeded from the Compatibility ID."""

    def __init__(self, descriptor: CompatibilityDescriptor) -> None:
        width = descriptor.kv_heads * descriptor.head_dim
        seed = int.from_bytes(compat_id(descriptor)[:8], "big")
        rng = np.random.default_rng(seed)
        r = WEIGHT_RANGE
        self.width = width
        # Small integers held as float64: every product and partial sum is an integer far
        # below 2**53, so BLAS computes them exactly in any summation order.
        self.recurrent = [
            _Matrix(rng.integers(-r, r + 1, size=(width, 2 * width)).astype(np.float64))
            for _ in range(descriptor.layers)
        ]
        self.value = [
            _Matrix(rng.integers(-r, r + 1, size=(width, width)).astype(np.float64))
            for _ in range(descriptor.layers)
        ]
        self.embeddings = rng.integers(-127, 128, size=(EMBEDDINGS, width)).astype(np.float64)

    def embed(self, token: int) -> FloatArray:
        row: FloatArray = self.embeddings[(token * 2654435761 % 2**32) % EMBEDDINGS]
        return row


class _Rate:
    """Tokens per second over the last :data:`RATE_WINDOW` calls (added on the engine
    thread, read on the event loop's)."""

    def __init__(self) -> None:
        self._calls: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)
        self._lock = threading.Lock()

    def add(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._calls.append((tokens, seconds))

    def per_second(self) -> float:
        with self._lock:
            calls = list(self._calls)
        tokens = sum(t for t, _ in calls)
        seconds = sum(s for _, s in calls)
        return tokens / seconds if seconds > 0 else 0.0


class ToySequence:
    """One prompt in the toy engine (an :class:`~kvsp.engine.api.EngineSequence`)."""

    def __init__(self, engine: ToyEngine, loaded_blocks: int) -> None:
        self._engine = engine
        layers, width = engine.descriptor.layers, engine.weights.width
        self.loaded_blocks = loaded_blocks
        self.computed: list[ComputedBlock] = []
        self.length = 0
        self.blocks_accounted = 0
        self.released = False
        self._keys: Int8Array = np.zeros((layers, 256, width), dtype=np.int8)
        self._values: Int8Array = np.zeros((layers, 256, width), dtype=np.int8)
        self._state: list[FloatArray] = [np.zeros(width) for _ in range(layers)]

    def _grow(self, tokens: int) -> None:
        have = self._keys.shape[1]
        if self.length + tokens <= have:
            return
        size = max(2 * have, self.length + tokens)
        pad = ((0, 0), (0, size - have), (0, 0))
        self._keys = np.pad(self._keys, pad)
        self._values = np.pad(self._values, pad)

    def load(self, blocks: Sequence[Container]) -> None:
        """Copy loaded blocks into KV memory and take the state after their last token."""
        engine = self._engine
        dtype, width = engine.descriptor.kv_dtype, engine.weights.width
        for block in blocks:
            tokens = block.token_count
            self._grow(tokens)
            span = slice(self.length, self.length + tokens)
            for layer in block.layers:
                self._keys[layer.index, span] = decode_states(layer.k, dtype, width)
                self._values[layer.index, span] = decode_states(layer.v, dtype, width)
            self.length += tokens
        if self.length:
            last = self.length - 1
            self._state = [self._keys[i, last].astype(np.float64) for i in range(len(self._state))]

    def compute(self, tokens: Sequence[int]) -> None:
        """Run the network over ``tokens``, appending their K and V (one matvec per token per
        layer and one more for V)."""
        weights = self._engine.weights
        self._grow(len(tokens))
        for token in tokens:
            x = weights.embed(int(token))
            t = self.length
            for layer, (recurrent, value) in enumerate(
                zip(weights.recurrent, weights.value, strict=True)
            ):
                h = _squash(recurrent @ np.concatenate((self._state[layer], x)))
                self._state[layer] = h
                self._keys[layer, t] = h
                self._values[layer, t] = _squash(value @ h)
                x = h
            self.length += 1

    def container(self, index: int) -> bytes:
        """Block ``index`` of the sequence as a KVB1 container with every layer (§4.3)."""
        engine = self._engine
        b, dtype = engine.descriptor.block_tokens, engine.descriptor.kv_dtype
        span = slice(index * b, (index + 1) * b)
        sections = [
            (encode_states(self._keys[i, span], dtype), encode_states(self._values[i, span], dtype))
            for i in range(engine.descriptor.layers)
        ]
        return encode_container(
            sections, first_layer=0, token_count=b, codec=Codec.RAW, geometry=engine.geometry
        )

    def choose(self, method: str, seed: int, step: int) -> int:
        """The token the context gives at sampler ``step``: a hash of the top layer's state
        (greedy), or of that state and the step's draw (the sampled methods)."""
        top = self._state[-1].astype(np.int8).tobytes()
        if method != "greedy":
            top += step_draw(seed, step)
        digest = hashlib.blake2b(top, digest_size=8).digest()
        return int.from_bytes(digest, "big") % self._engine.vocab

    def step(self, token: int, method: str, seed: int, step: int) -> int:
        """One decode step on the engine thread: take ``token``, return the next."""
        began = time.perf_counter()
        self.compute([token])
        following = self.choose(method, seed, step)
        self._engine.decode_rate.add(1, time.perf_counter() - began)
        return following

    def _complete_block(self, index: int) -> bytes:
        """Block ``index`` as a container, if its KV is complete (engine thread)."""
        if not 0 <= index < self.length // self._engine.descriptor.block_tokens:
            raise LayersUnavailable(f"block {index} is not a complete block of the sequence")
        return self.container(index)

    async def block(self, index: int) -> bytes:
        """Block ``index`` (prompt or generated) as a KVB1 container, read on the engine
        thread between decode rounds.

        Raises:
            LayersUnavailable: the block is not complete yet.
        """
        return await asyncio.wrap_future(self._engine.worker.submit(self._complete_block, index))

    async def tokens(
        self, max_tokens: int, sampling: Sampling = GREEDY, step: int = 0
    ) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` tokens, the first at sampler step ``step``. The engine
        thread runs the decode steps on its own, one step per running sequence per round, and
        hands each token to this loop; a busy event loop delays delivery but never the engine."""
        if max_tokens <= 0 or self.released:
            return
        decoding = _Decoding(self, sampling, step, max_tokens)
        async with aclosing(self._engine.worker.stream(decoding)) as tokens:
            async for token in tokens:
                yield token

    async def release(self) -> None:
        """Free the sequence's KV memory (idempotent)."""
        self._engine.free(self)


class _Decoding(Decoding):
    """A toy sequence being decoded: the first token comes from the state the prefill left,
    each later one from a decode step; each token delivered charges the sequence's grown
    length to KV memory."""

    def __init__(self, seq: ToySequence, sampling: Sampling, step: int, count: int) -> None:
        super().__init__(step, count)
        self.seq = seq
        self.method = sampling.method
        self.seed = sampling.run_seed()

    def next_token(self) -> int | None:
        """The context's next token (engine thread); ``None`` once the sequence is released."""
        if self.seq.released:
            return None
        if self.token is None:
            return self.seq.choose(self.method, self.seed, self.next_step)
        return self.seq.step(self.token, self.method, self.seed, self.next_step)

    def deliver(self, value: Outcome) -> None:
        """Charge the token to KV memory, then queue it (event loop thread)."""
        if value is not None:
            self.seq._engine.account(self.seq)
        super().deliver(value)


class ToyEngine:
    """The deterministic CPU engine (an :class:`~kvsp.engine.api.InferenceEngine`).

    Raises:
        Incompatible: a ``kv_dtype`` other than fp32, fp16, bf16 or int8.
        ValueError: ``capacity_blocks`` or ``vocab`` below 1, or a negative delay.
    """

    def __init__(
        self,
        descriptor: CompatibilityDescriptor | None = None,
        *,
        capacity_blocks: int = 1024,
        vocab: int = 32_000,
        decode_delay_s: float = 0.0,
    ) -> None:
        self._descriptor = descriptor or toy_descriptor()
        if self._descriptor.kv_dtype not in SUPPORTED_DTYPES:
            known = ", ".join(sorted(SUPPORTED_DTYPES))
            raise Incompatible(f"the toy engine stores {known}, not {self._descriptor.kv_dtype}")
        if capacity_blocks < 1 or vocab < 1 or not decode_delay_s >= 0:
            raise ValueError("capacity_blocks and vocab must be at least 1, the delay >= 0")
        self.decode_delay_s = decode_delay_s
        self.geometry = Geometry.from_descriptor(self._descriptor)
        self.weights = _Weights(self._descriptor)
        self.capacity_blocks = capacity_blocks
        self.vocab = vocab
        self.prefill_rate = _Rate()
        self.decode_rate = _Rate()
        self._held: OrderedDict[BlockKey, Container] = OrderedDict()
        self._sequences: set[ToySequence] = set()
        self._sequence_blocks = 0
        self.worker = EngineWorker("kvsp-toy-engine", round_delay_s=decode_delay_s)
        """The engine thread: it computes prefills and decode rounds."""

    @property
    def descriptor(self) -> CompatibilityDescriptor:
        """The Compatibility Descriptor of the blocks it makes and takes (§4.1)."""
        return self._descriptor

    def stats(self) -> EngineStats:
        """Measured prefill and decode rates and the KV memory in use."""
        used = self._sequence_blocks + len(self._held)
        return EngineStats(
            prefill_tokens_per_s=self.prefill_rate.per_second(),
            decode_tokens_per_s=self.decode_rate.per_second(),
            kv_utilization=min(1.0, used / self.capacity_blocks),
        )

    # -- KV memory (on the event loop's thread only) --------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._descriptor.block_tokens)

    def _make_room(self, blocks: int) -> bool:
        while self._sequence_blocks + len(self._held) + blocks > self.capacity_blocks:
            if not self._held:
                return False
            self._held.popitem(last=False)
        return True

    def account(self, seq: ToySequence) -> None:
        """Charge ``seq``'s grown length to KV memory (evicting held blocks as needed; a
        running sequence is never stopped, so utilization saturates at 1)."""
        if seq.released:
            return
        blocks = self._blocks_for(seq.length)
        extra = blocks - seq.blocks_accounted
        if extra > 0:
            self._make_room(extra)
            self._sequence_blocks += extra
            seq.blocks_accounted = blocks

    def free(self, seq: ToySequence) -> None:
        """Release ``seq``'s KV memory (idempotent)."""
        if seq.released:
            return
        seq.released = True
        self._sequences.discard(seq)
        self._sequence_blocks -= seq.blocks_accounted
        seq.blocks_accounted = 0

    def hold(self, key: BlockKey, block: Container) -> bool:
        """Keep a block for later prompts (LRU among held blocks); whether it is held."""
        self._check_block(block)
        if key in self._held:
            self._held.move_to_end(key)
            return True
        if not self._make_room(1):
            return False
        self._held[key] = block
        return True

    def lookup(self, keys: Sequence[BlockKey]) -> list[Container]:
        """The held blocks of the leading ``keys``, up to the first one not held."""
        return api.lookup_held(self._held, keys)

    # -- compute --------------------------------------------------------------------------------

    def _check_block(self, block: Container) -> None:
        api.check_loaded_block(block, self._descriptor, self.geometry)

    async def prefill(self, prompt: Sequence[int], loaded: Sequence[Container]) -> ToySequence:
        """Load ``loaded`` as the first blocks of ``prompt`` and compute the rest.

        Raises:
            BadRequest: an empty prompt, or more loaded blocks than the prompt has.
            Incompatible: a loaded block of another geometry.
            InsufficientStorage: the running sequences fill KV memory.
        """
        b = self._descriptor.block_tokens
        if not prompt:
            raise BadRequest("a prompt needs at least one token", path="$.prompt")
        if len(loaded) > len(prompt) // b:
            raise BadRequest("more loaded blocks than the prompt has")
        for block in loaded:
            self._check_block(block)
        seq = self._admit(len(prompt), len(loaded))
        return await self._compute(seq, self._run_prefill, prompt, loaded)

    async def resume(
        self, loaded: Sequence[Container], prefill: Sequence[int], replay: Sequence[int]
    ) -> ToySequence:
        """Take ``loaded`` as the first blocks of a session's context, compute ``prefill``,
        then ``replay`` token by token (§6.8 steps 1-2).

        Raises:
            BadRequest: nothing to compute after the loaded blocks.
            Incompatible: a loaded block of another geometry.
            InsufficientStorage: the running sequences fill KV memory.
        """
        if not prefill and not replay:
            raise BadRequest("nothing to compute after the loaded blocks")
        for block in loaded:
            self._check_block(block)
        total = len(loaded) * self._descriptor.block_tokens + len(prefill) + len(replay)
        seq = self._admit(total, len(loaded))
        return await self._compute(seq, self._run_resume, loaded, prefill, replay)

    def _admit(self, tokens: int, loaded_blocks: int) -> ToySequence:
        """A new sequence charged with the KV memory of ``tokens`` tokens.

        Raises:
            InsufficientStorage: the running sequences fill KV memory.
        """
        blocks = self._blocks_for(tokens)
        if not self._make_room(blocks):
            raise InsufficientStorage("the toy engine's KV memory is full")
        seq = ToySequence(self, loaded_blocks)
        self._sequences.add(seq)
        self._sequence_blocks += blocks
        seq.blocks_accounted = blocks
        return seq

    async def _compute(self, seq: ToySequence, run: Callable[..., None], *args: Any) -> ToySequence:
        """Run ``run(seq, *args)`` on the engine thread; free ``seq`` if it fails."""
        try:
            await asyncio.wrap_future(self.worker.submit(run, seq, *args))
        except BaseException:
            self.free(seq)
            raise
        return seq

    def _run_resume(
        self,
        seq: ToySequence,
        loaded: Sequence[Container],
        prefill: Sequence[int],
        replay: Sequence[int],
    ) -> None:
        began = time.perf_counter()
        seq.load(loaded)
        seq.compute(prefill)
        if prefill:
            self.prefill_rate.add(len(prefill), time.perf_counter() - began)
        for token in replay:
            seq.compute([token])

    def _run_prefill(
        self, seq: ToySequence, prompt: Sequence[int], loaded: Sequence[Container]
    ) -> None:
        b = self._descriptor.block_tokens
        began = time.perf_counter()
        seq.load(loaded)
        rest = prompt[seq.length :]
        seq.compute(rest)
        if rest:
            self.prefill_rate.add(len(rest), time.perf_counter() - began)
        seq.computed = [
            ComputedBlock(i, seq.container(i)) for i in range(len(loaded), len(prompt) // b)
        ]

    async def aclose(self) -> None:
        """Stop the engine thread (after the round it is running)."""
        await self.worker.aclose()
