"""The reference engine facade (DESIGN.md §6): prefill, decode, generate, blocks in and out.

Prefill runs in chunks aligned to absolute positions (``prefill_chunk``, by default one block).
Because a loaded prefix always ends on a block boundary, a prompt whose first blocks were
loaded runs exactly the same chunks, with the same shapes and the same cache contents, as a
full recompute: on one machine the logits are bit-identical. Larger chunks are faster and
agree to float rounding only.

A prefix can be loaded while prefill runs (:meth:`Engine.load_prefix`): layer l of the new
tokens waits only for layer l of the loaded pages. A block that fails verification is dropped
with every block after it, and prefill recomputes from there (§6.5: "served with the loaded
prefix and the remaining tokens are recomputed").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsp.compat import compat_id
from kvsp.container import Buffer
from kvsp.engine.blocks import LayerRange, container_layer_digests, import_container, page_container
from kvsp.engine.checkpoint import descriptor_for, load_weights
from kvsp.engine.config import read_config
from kvsp.engine.kvcache import KVSequence, LayerLoadFailed, PagedKVCache
from kvsp.engine.model import LlamaModel
from kvsp.engine.rope import Rope
from kvsp.engine.sampler import Sampler
from kvsp.engine.sink import PrefixLoad, Staging
from kvsp.engine.tokenizer import ByteTokenizer, load_tokenizer
from kvsp.errors import BadRequest, KVSPError, LayersUnavailable
from kvsp.ids import CompatId

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNKNOWN_TOKEN = -1
"""Stands for a token of a loaded block whose id is not known (:meth:`Engine.adopt_pages`)."""


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    """One complete block of a prompt as a KVB1 container with its layer digests (§4.3)."""

    index: int
    container: bytes
    layer_digests: tuple[bytes, ...]


@dataclass(slots=True)
class Throughput:
    """Tokens processed and the seconds they took."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """Account one call."""
        self.tokens += tokens
        self.seconds += seconds

    @property
    def per_second(self) -> float:
        """Tokens per second so far (0 before any)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Measured figures for the Instance Status Record (§4.4)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_utilization: float


class Engine:
    """A Llama-family model with paged KV on one device.

    Raises:
        CheckpointError: the checkpoint cannot be loaded.
        BadRequest: an unsupported dtype, or ``prefill_chunk`` not a multiple of the block.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        num_pages: int = 256,
        block_tokens: int = 16,
        kv_dtype: str = "fp32",
        dtype: str = "fp32",
        prefill_chunk: int | None = None,
        load_timeout_s: float = 60.0,
        model: str | None = None,
    ) -> None:
        chunk = prefill_chunk or block_tokens
        if chunk % block_tokens or dtype not in COMPUTE_DTYPES:
            raise BadRequest("prefill_chunk must be a multiple of block_tokens; dtype fp32/bf16")
        self.device = torch.device(device)
        self.config = read_config(model_dir)
        self.descriptor = descriptor_for(
            model_dir, block_tokens=block_tokens, kv_dtype=kv_dtype, model=model
        )
        rope = Rope.from_positional(
            self.descriptor.positional, self.config.head_dim, self.config.rope_scaling
        )
        weights = load_weights(
            model_dir, self.config, device=self.device, dtype=COMPUTE_DTYPES[dtype]
        )
        self.model = LlamaModel(self.config, weights, rope)
        self.cache = PagedKVCache(
            num_pages=num_pages,
            layers=self.config.num_hidden_layers,
            block_tokens=block_tokens,
            kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            kv_dtype=kv_dtype,
            device=self.device,
        )
        self.block_tokens = block_tokens
        self.prefill_chunk = chunk
        self.load_timeout_s = load_timeout_s
        self.tokenizer = _tokenizer_or_none(model_dir)
        self.prefill_rate = Throughput()
        self.decode_rate = Throughput()
        self._loads: list[PrefixLoad] = []

    @property
    def compat_id(self) -> CompatId:
        """The Compatibility ID of the caches this engine makes and takes (§4.1)."""
        return compat_id(self.descriptor)

    def stats(self) -> EngineStats:
        """Measured prefill and decode tokens/s and KV utilization."""
        return EngineStats(
            prefill_tokens_per_s=self.prefill_rate.per_second,
            decode_tokens_per_s=self.decode_rate.per_second,
            kv_utilization=self.cache.utilization(),
        )

    # -- sequences ---------------------------------------------------------------------------

    def new_sequence(self) -> KVSequence:
        """An empty sequence (no pages yet)."""
        return KVSequence()

    def adopt_pages(self, seq: KVSequence, pages: Sequence[int]) -> None:
        """Make ``pages`` (each a whole loaded block) the first blocks of the empty ``seq``
        without computing anything. Their tokens are known only by their Block Keys (§6.8
        resume), so the sequence records :data:`UNKNOWN_TOKEN` for them; only its length is
        ever read.

        Raises:
            BadRequest: ``seq`` is not empty.
        """
        if seq.length or seq.pages:
            raise BadRequest("loaded pages go into an empty sequence")
        seq.pages.extend(pages)
        seq.tokens.extend([UNKNOWN_TOKEN] * (len(pages) * self.block_tokens))

    def free(self, seq: KVSequence) -> None:
        """Release the sequence's pages (waiting for loads still writing into them)."""
        self._quiesce(seq.pages)
        self.cache.free(seq.pages)
        seq.pages.clear()
        seq.tokens.clear()

    def close(self) -> None:
        """Wait for every background load to stop."""
        for load in self._loads:
            load.join()
        self._loads.clear()

    # -- loading -------------------------------------------------------------------------------

    def load_prefix(
        self,
        sources: Sequence[Iterable[Buffer]],
        layer_digests: Sequence[Sequence[bytes] | None] | None = None,
    ) -> PrefixLoad:
        """Start loading blocks 0..n-1 of a prefix (each an iterable of container chunks) into
        fresh pages on a background thread; pass ``load.pages`` to :meth:`prefill`.

        Raises:
            Conflict: not enough free pages.
        """
        digests = list(layer_digests) if layer_digests is not None else [None] * len(sources)
        pages = self.cache.allocate(len(sources))
        load = PrefixLoad(self.cache, pages, sources, digests)
        self._loads = [x for x in self._loads if x.running]
        self._loads.append(load)
        return load.start()

    def import_block(self, container: Buffer, layer_digests: Sequence[bytes] | None = None) -> int:
        """Load one container synchronously into a fresh page and return the page.

        Raises:
            KVSPError: a bad container or a digest mismatch (the page is released).
        """
        (page,) = self.cache.allocate(1)
        staging = Staging(self.cache) if self.device.type != "cpu" else None
        try:
            import_container(
                self.cache, page, container, layer_digests=layer_digests, staging=staging
            )
        except BaseException:
            self.cache.free([page])
            raise
        finally:
            if staging is not None and staging.last_copy is not None:
                staging.last_copy.synchronize()
        return page

    # -- compute -------------------------------------------------------------------------------

    def prefill(
        self,
        seq: KVSequence,
        tokens: Sequence[int],
        *,
        loaded_prefix_pages: Sequence[int] | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Append ``tokens`` to ``seq``, computing their KV; return the last token's logits
        ``[vocab]`` (``[n, vocab]`` for the computed tokens with ``all_logits``).

        With ``loaded_prefix_pages`` the sequence must be empty and those pages hold (or are
        loading) the KV of the first ``len(pages)`` blocks of ``tokens``; only the rest is
        computed. A loaded block that fails is recomputed with all blocks after it.

        Raises:
            BadRequest: nothing to compute, or a prefix that does not fit ``tokens``.
            Conflict: the KV cache is full.
        """
        target = seq.tokens + [int(t) for t in tokens]
        if loaded_prefix_pages is not None:
            self._adopt(seq, target, list(loaded_prefix_pages))
        if len(target) <= seq.length:
            raise BadRequest("prefill needs at least one token to compute")
        began = time.perf_counter()
        computed = len(target) - seq.length
        while True:
            try:
                logits = self._compute(seq, target[seq.length :], all_logits)
                break
            except LayerLoadFailed as exc:
                self._drop_from(seq, exc.page)
                computed = len(target) - seq.length
        self._synchronize()
        self.prefill_rate.add(computed, time.perf_counter() - began)
        self.cache.settle(seq.pages)
        return logits if all_logits else logits[-1]

    def decode(self, seq: KVSequence, token: int) -> torch.Tensor:
        """Append one token; return its logits ``[vocab]``."""
        began = time.perf_counter()
        logits = self._compute(seq, [int(token)], False)
        self._synchronize()
        self.decode_rate.add(1, time.perf_counter() - began)
        return logits[-1]

    def generate(
        self,
        tokens: Sequence[int],
        max_new_tokens: int,
        sampler: Sampler,
        *,
        generated: Sequence[int] = (),
        loaded_prefix_pages: Sequence[int] | None = None,
        stop_tokens: Iterable[int] = (),
    ) -> Iterator[int]:
        """Yield up to ``max_new_tokens`` sampled tokens after the prompt ``tokens``.

        ``generated`` are output tokens already delivered (§6.8 resume): they are replayed by
        decode steps, exactly as the original run computed them, and sampling continues at
        step ``len(generated)``, so the output equals the uninterrupted run's tail.
        """
        stops = set(stop_tokens)
        seq = self.new_sequence()
        try:
            logits = self.prefill(seq, tokens, loaded_prefix_pages=loaded_prefix_pages)
            for token in generated:
                logits = self.decode(seq, token)
            for i in range(max_new_tokens):
                token = sampler.sample(logits, len(generated) + i)
                yield token
                if token in stops or i + 1 == max_new_tokens:
                    return
                logits = self.decode(seq, token)
        finally:
            self.free(seq)

    # -- export --------------------------------------------------------------------------------

    def block_container(
        self, seq: KVSequence, block_index: int, layers: LayerRange | None = None
    ) -> bytes:
        """Block ``block_index`` of ``seq`` as a KVB1 container (§4.3), layers ``first..last``.

        Raises:
            LayersUnavailable: the block is not complete in ``seq`` or the range is bad.
        """
        if not 0 <= block_index < seq.length // self.block_tokens:
            raise LayersUnavailable(f"block {block_index} is not a complete block of the sequence")
        return page_container(self.cache, seq.pages[block_index], layers=layers)

    def export_blocks(self, seq: KVSequence) -> list[ExportedBlock]:
        """Every complete block of ``seq`` with its layer digests."""
        out = []
        for i in range(seq.length // self.block_tokens):
            container = self.block_container(seq, i)
            digests = tuple(container_layer_digests(container, self.cache))
            out.append(ExportedBlock(i, container, digests))
        return out

    def export_prompt_blocks(self, tokens: Sequence[int]) -> list[ExportedBlock]:
        """Prefill ``tokens`` in a fresh sequence and export its complete blocks."""
        seq = self.new_sequence()
        try:
            self.prefill(seq, tokens)
            return self.export_blocks(seq)
        finally:
            self.free(seq)

    # -- internals -------------------------------------------------------------------------------

    def _adopt(self, seq: KVSequence, target: list[int], pages: list[int]) -> None:
        if seq.length or seq.pages:
            raise BadRequest("a loaded prefix goes into an empty sequence")
        covered = len(pages) * self.block_tokens
        if covered > len(target):
            raise BadRequest(f"{len(pages)} loaded blocks exceed the {len(target)} tokens")
        if pages and covered == len(target):
            # the last token's logits are needed: recompute the last block like a full prefill
            self._quiesce(pages[-1:])
            self.cache.free(pages[-1:])
            pages, covered = pages[:-1], covered - self.block_tokens
        seq.pages.extend(pages)
        seq.tokens.extend(target[:covered])

    def _compute(self, seq: KVSequence, pending: list[int], all_logits: bool) -> torch.Tensor:
        """Run ``pending`` through the model in position-aligned chunks."""
        chunk, outputs = self.prefill_chunk, []
        while pending:
            start = seq.length
            n = min(len(pending), (start // chunk + 1) * chunk - start)
            self._ensure_pages(seq, start + n)
            prefix = seq.pages[: start // self.block_tokens]
            tokens = torch.tensor(pending[:n], dtype=torch.long, device=self.device)
            pages = torch.tensor(seq.pages, dtype=torch.long, device=self.device)
            logits = self.model.forward(
                tokens,
                start=start,
                pages=pages,
                cache=self.cache,
                wait=functools.partial(self._wait, prefix),
                all_logits=all_logits,
            )
            outputs.append(logits)
            seq.tokens.extend(pending[:n])
            pending = pending[n:]
        return torch.cat(outputs) if all_logits else outputs[-1]

    def _wait(self, prefix: list[int], layer: int) -> None:
        self.cache.wait_layer(prefix, layer, self.load_timeout_s)

    def _ensure_pages(self, seq: KVSequence, length: int) -> None:
        needed = -(-length // self.block_tokens) - len(seq.pages)
        if needed > 0:
            seq.pages.extend(self.cache.allocate(needed))

    def _drop_from(self, seq: KVSequence, page: int) -> None:
        """Drop the failed loaded page and every page after it; their tokens are recomputed."""
        index = seq.pages.index(page)
        dropped = seq.pages[index:]
        self._quiesce(dropped)
        self.cache.free(dropped)
        del seq.pages[index:]
        del seq.tokens[index * self.block_tokens :]

    def _quiesce(self, pages: Iterable[int]) -> None:
        wanted = set(pages)
        for load in self._loads:
            if wanted.intersection(load.pages):
                load.join()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _tokenizer_or_none(folder: str | Path) -> ByteTokenizer | None:
    try:
        return load_tokenizer(folder)
    except KVSPError:
        return None  # another tokenizer format: the engine works on token ids alone
