"""The transformers engine: any supported decoder-only ``AutoModelForCausalLM`` checkpoint
behind the instance agent (DESIGN.md §5–6; spec §4.1, §4.3, §6.5, §6.8).

Public contract::

    kvsp serve instance ... --engine transformers --model DIR [--device cpu] [--block-tokens N]

    HFEngine(model_dir, *, device="cpu", num_pages=1024, block_tokens=16, kv_dtype="fp32",
             held_blocks=None, model=None)

:class:`HFEngine` is the shared :class:`~kvsp.engine.adapter.CoreEngine` (the engine thread,
sampling, held blocks, resume) over :class:`HFCore`. The model is loaded from local files only
(``local_files_only``, no remote code, safetensors only), in float32 with eager attention;
:mod:`kvsp.engine.hf_checkpoint` refuses the models it would describe wrongly and computes
the Compatibility Descriptor from the files. A one-token forward at start-up checks that the
model's cache has one full-attention layer per ``num_hidden_layers``, each of the descriptor's
shape (``[1, kv_heads, tokens, head_dim]`` for K and V); any other cache is refused.

Each sequence owns a transformers ``DynamicCache``. A loaded block's layer l is one copy of its
K and of its V section (``[block_tokens, kv_heads, head_dim]`` on the wire, §4.3
``kvsp-layout-1``) into the layer's ``[1, kv_heads, tokens, head_dim]`` tensors; export is the
same copy the other way. Prefill runs in chunks that end on block boundaries, so a prompt whose
first blocks were loaded runs the same forward calls on the same cache contents as a full
recompute: on one machine the logits and the KV bytes are bit-identical. A loaded block whose
layer fails its digest is dropped with every block after it and recomputed (§6.5).
Transfers can also write a prefix's layers straight into per-layer tensors as they arrive and
verify (:meth:`HFCore.prefix_sinks`, :mod:`kvsp.engine.hf_sink`); a sequence adopts the leading
blocks whose every layer was verified.
Page accounting: a sequence holds one page (of ``num_pages``) per started block.

torch and transformers are imported only here and in :mod:`kvsp.engine.hf_checkpoint`, and
nothing imports this module unless ``--engine transformers`` is chosen.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsp.container import (
    Buffer,
    Container,
    Geometry,
    byte_view,
    decode_container,
    encode_container,
)
from kvsp.container import verify_layers as verify_container_layers
from kvsp.engine.adapter import CoreEngine, CoreSequence
from kvsp.engine.api import ComputedBlock, check_loaded_block
from kvsp.engine.engine import UNKNOWN_TOKEN, EngineStats, Throughput
from kvsp.engine.hf_checkpoint import UnsupportedModel, describe_checkpoint, load_config
from kvsp.engine.hf_sink import HFPrefixLoad, SinkBlock
from kvsp.engine.kvcache import KVSequence
from kvsp.errors import BadRequest, Conflict, InsufficientStorage, KVSPError, LayersUnavailable

KV_DTYPE = "fp32"
"""The one KV element type offered: the model runs in float32."""
_WIRE = np.dtype("<f4")


@dataclass(slots=True)
class HFSequence(KVSequence):
    """A sequence with its transformers ``DynamicCache`` (``None`` until it has KV)."""

    cache: Any = None
    adopted: int = 0
    """Leading blocks taken from loaded pages rather than computed."""


@dataclass(slots=True)
class PrefixLoad:
    """The pages of a loaded prefix and why loading stopped early (``None``: it did not)."""

    pages: list[int] = field(default_factory=list)
    error: KVSPError | None = None


class BlockPool:
    """Page accounting of the KV memory and the loaded blocks waiting for a sequence."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise BadRequest("the KV cache needs at least one page")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.loaded: dict[int, Container | SinkBlock] = {}

    @property
    def used_pages(self) -> int:
        """Pages allocated."""
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` free pages.

        Raises:
            Conflict: fewer are free.
        """
        if count > len(self._free):
            raise Conflict(f"{count} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the pool, with any loaded block still waiting in one."""
        for page in pages:
            entry = self.loaded.pop(page, None)
            if isinstance(entry, SinkBlock):
                entry.load.sink(entry.block).abort("its page was freed")
            self._free.append(page)


class HFCore:
    """A transformers causal LM with per-sequence caches (an
    :class:`~kvsp.engine.adapter.EngineCore`; engine thread only).

    Raises:
        CheckpointError: the folder cannot be loaded.
        UnsupportedModel: a model the engine refuses; the message names the feature.
        BadRequest: a kv dtype other than fp32.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        num_pages: int = 1024,
        block_tokens: int = 16,
        kv_dtype: str = KV_DTYPE,
        model: str | None = None,
    ) -> None:
        if kv_dtype != KV_DTYPE:
            raise BadRequest(f"--engine transformers computes {KV_DTYPE} KV, not {kv_dtype!r}")
        config = load_config(model_dir)
        self.descriptor = describe_checkpoint(
            model_dir, block_tokens=block_tokens, kv_dtype=kv_dtype, model=model, config=config
        )
        self.geometry = Geometry.from_descriptor(self.descriptor)
        self.block_tokens = block_tokens
        self.device = torch.device(device)
        self.model = _load_model(model_dir, self.device)
        self.vocab_size: int = int(self.model.config.vocab_size)
        self.cache = BlockPool(num_pages)
        self.prefill_rate = Throughput()
        self.decode_rate = Throughput()
        self._check_cache_shape()

    def stats(self) -> EngineStats:
        """Measured prefill and decode tokens/s and the share of pages in use."""
        return EngineStats(
            prefill_tokens_per_s=self.prefill_rate.per_second,
            decode_tokens_per_s=self.decode_rate.per_second,
            kv_utilization=self.cache.used_pages / self.cache.num_pages,
        )

    # -- sequences ---------------------------------------------------------------------------

    def new_sequence(self) -> HFSequence:
        """An empty sequence."""
        return HFSequence()

    def free(self, seq: KVSequence) -> None:
        """Release the sequence's pages and cache (idempotent)."""
        self.cache.free(seq.pages)
        seq.pages.clear()
        seq.tokens.clear()
        _hf(seq).cache = None

    def close(self) -> None:
        """Nothing runs in the background."""

    # -- loading -------------------------------------------------------------------------------

    def import_loaded(self, block: Container, layer_digests: Sequence[bytes] | None = None) -> int:
        """Take one decoded block into a fresh page (its octets are copied when a sequence
        adopts the page); with ``layer_digests`` each layer is verified first (§6.7).

        Raises:
            Incompatible: a block of another geometry.
            DigestMismatch: a layer differs from its digest.
            Conflict: no free page.
        """
        check_loaded_block(block, self.descriptor, self.geometry)
        if layer_digests is not None:
            verify_container_layers(block, layer_digests)
        (page,) = self.cache.allocate(1)
        self.cache.loaded[page] = block
        return page

    def import_block(self, container: Buffer, layer_digests: Sequence[bytes] | None = None) -> int:
        """Decode a KVB1 container (§4.3) and take it into a fresh page.

        Raises:
            ContainerError: not a container of this geometry.
            Incompatible: a block of another geometry.
            DigestMismatch: a layer differs from its digest.
            Conflict: no free page.
        """
        return self.import_loaded(decode_container(container, self.geometry), layer_digests)

    def load_prefix(
        self, containers: Sequence[Buffer], layer_digests: Sequence[Sequence[bytes]]
    ) -> PrefixLoad:
        """Import blocks 0..n-1 of a prefix, verifying each layer, up to the first one that
        fails (kept as ``error``): it and every block after it are left to the prefill.

        Raises:
            Conflict: no free page.
        """
        load = PrefixLoad()
        for container, digests in zip(containers, layer_digests, strict=True):
            try:
                load.pages.append(self.import_block(container, digests))
            except Conflict:
                self.cache.free(load.pages)
                raise
            except KVSPError as exc:
                load.error = exc
                break
        return load

    def prefix_sinks(self, blocks: int) -> HFPrefixLoad:
        """Pages and layer sinks for blocks 0..``blocks``-1 of a prefix (see
        :mod:`kvsp.engine.hf_sink`): transfers write verified layers straight into the
        prefix's per-layer K/V tensors; ``prefill(..., loaded_prefix_pages=load.pages)``
        adopts the leading blocks whose every layer was verified and recomputes the rest.

        Raises:
            Conflict: too few free pages.
            ValueError: ``blocks`` below one.
        """
        if blocks < 1:
            raise ValueError("a prefix load needs at least one block")
        pages = self.cache.allocate(blocks)
        load = HFPrefixLoad(self.geometry, self.block_tokens, pages, self.device)
        for j, page in enumerate(pages):
            self.cache.loaded[page] = SinkBlock(load, j)
        return load

    def adopt_pages(self, seq: KVSequence, pages: Sequence[int]) -> None:
        """Make loaded ``pages`` the first blocks of the empty ``seq``; their tokens are known
        only by their Block Keys (§6.8 resume), so the sequence records unknown tokens.

        Raises:
            BadRequest: ``seq`` is not empty.
        """
        if seq.length or seq.pages:
            raise BadRequest("loaded pages go into an empty sequence")
        self._install(_hf(seq), list(pages))
        seq.tokens.extend([UNKNOWN_TOKEN] * (len(pages) * self.block_tokens))

    def _verified_prefix(self, pages: list[int]) -> list[int]:
        """The leading ``pages`` whose blocks are verified; the others are freed (their
        blocks are recomputed)."""
        for i, page in enumerate(pages):
            entry = self.cache.loaded.get(page)
            if isinstance(entry, SinkBlock) and not entry.load.sink(entry.block).complete:
                self.cache.free(pages[i:])
                return pages[:i]
        return pages

    def _install(self, seq: HFSequence, pages: list[int]) -> None:
        """Copy the loaded blocks of ``pages`` into a new cache of ``seq``: per layer, one copy
        of each block's K and V section into the layer's tensors; blocks 0..n-1 of one sink
        load become the cache as views of its tensors, with no copy.

        Raises:
            LayersUnavailable: a page whose block is not loaded, or not verified.
        """
        missing = [p for p in pages if p not in self.cache.loaded]
        if missing or len(self._verified_prefix(list(pages))) != len(pages):
            raise LayersUnavailable(f"pages {missing or pages} hold no verified block")
        blocks = [self.cache.loaded.pop(page) for page in pages]
        seq.cache = self._new_cache()
        seq.pages.extend(pages)
        seq.adopted = len(pages)
        if not blocks:
            return
        sink_load = _whole_sink_prefix(blocks)
        if sink_load is not None:
            keys, values = sink_load.adopt(len(blocks))
            for layer, k, v in zip(seq.cache.layers, keys, values, strict=True):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            return
        b, kv_heads, head_dim = self.block_tokens, self.geometry.kv_heads, self.geometry.head_dim
        shape = (1, kv_heads, len(blocks) * b, head_dim)
        for index, layer in enumerate(seq.cache.layers):
            k, v = torch.empty(shape, dtype=torch.float32), torch.empty(shape, dtype=torch.float32)
            k_np, v_np = k.numpy(), v.numpy()
            for j, block in enumerate(blocks):
                rows = slice(j * b, (j + 1) * b)
                if isinstance(block, SinkBlock):
                    k_rows, v_rows = block.load.rows(index, block.block)
                    k[0, :, rows] = k_rows.transpose(0, 1)
                    v[0, :, rows] = v_rows.transpose(0, 1)
                    continue
                section = block.layers[index]
                k_np[0, :, rows] = _section(section.k, b, kv_heads, head_dim).transpose(1, 0, 2)
                v_np[0, :, rows] = _section(section.v, b, kv_heads, head_dim).transpose(1, 0, 2)
            k, v = k.to(self.device), v.to(self.device)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v

    # -- compute -------------------------------------------------------------------------------

    def prefill(
        self,
        seq: KVSequence,
        tokens: Sequence[int],
        *,
        loaded_prefix_pages: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` to ``seq`` and return the last one's logits ``[vocab]``; with
        ``loaded_prefix_pages`` (into an empty sequence) those pages hold the first blocks of
        ``tokens`` and only the rest is computed. Pages of a :meth:`prefix_sinks` load count up
        to the first block not verified in every layer; it and the later ones are freed and
        computed (``seq.adopted`` says how many were taken).

        Raises:
            BadRequest: nothing to compute, or a prefix that does not fit ``tokens``.
            Conflict: the KV cache is full.
        """
        hf = _hf(seq)
        target = seq.tokens + [int(t) for t in tokens]
        if loaded_prefix_pages is not None:
            self._adopt(hf, target, list(loaded_prefix_pages))
        if len(target) <= seq.length:
            raise BadRequest("prefill needs at least one token to compute")
        began = time.perf_counter()
        computed = len(target) - seq.length
        logits = self._compute(hf, target[seq.length :])
        self._synchronize()
        self.prefill_rate.add(computed, time.perf_counter() - began)
        return logits

    def decode(self, seq: KVSequence, token: int) -> torch.Tensor:
        """Append one token; return its logits ``[vocab]``.

        Raises:
            Conflict: the KV cache is full.
        """
        began = time.perf_counter()
        logits = self._compute(_hf(seq), [int(token)])
        self._synchronize()
        self.decode_rate.add(1, time.perf_counter() - began)
        return logits

    def _adopt(self, seq: HFSequence, target: list[int], pages: list[int]) -> None:
        if seq.length or seq.pages:
            raise BadRequest("a loaded prefix goes into an empty sequence")
        pages = self._verified_prefix(pages)
        covered = len(pages) * self.block_tokens
        if covered > len(target):
            raise BadRequest(f"{len(pages)} loaded blocks exceed the {len(target)} tokens")
        if pages and covered == len(target):
            # the last token's logits are needed: recompute the last block like a full prefill
            self.cache.free(pages[-1:])
            pages, covered = pages[:-1], covered - self.block_tokens
        self._install(seq, pages)
        seq.tokens.extend(target[:covered])

    def _compute(self, seq: HFSequence, pending: list[int]) -> torch.Tensor:
        """Run ``pending`` through the model in chunks ending on block boundaries."""
        b = self.block_tokens
        if seq.cache is None:
            seq.cache = self._new_cache()
        logits: torch.Tensor | None = None
        while pending:
            start = seq.length
            if seq.cache.get_seq_length() != start:
                raise Conflict(f"cache holds {seq.cache.get_seq_length()} tokens, not {start}")
            n = min(len(pending), (start // b + 1) * b - start)
            needed = -(-(start + n) // b) - len(seq.pages)
            if needed > 0:
                seq.pages.extend(self.cache.allocate(needed))
            ids = torch.tensor([pending[:n]], dtype=torch.long, device=self.device)
            with torch.no_grad():
                out = self.model(input_ids=ids, cache=seq.cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
            seq.tokens.extend(pending[:n])
            pending = pending[n:]
        if logits is None:
            raise BadRequest("nothing to compute")
        return logits

    # -- export --------------------------------------------------------------------------------

    def block_container(self, seq: KVSequence, block_index: int) -> bytes:
        """Block ``block_index`` of ``seq`` as a KVB1 container with every layer (§4.3).

        Raises:
            LayersUnavailable: the block is not complete in ``seq``.
        """
        b, cache = self.block_tokens, _hf(seq).cache
        if cache is None or not 0 <= block_index < seq.length // b:
            raise LayersUnavailable(f"block {block_index} is not a complete block of the sequence")
        rows = slice(block_index * b, (block_index + 1) * b)
        sections = [
            (_wire(layer.keys[0, :, rows]), _wire(layer.values[0, :, rows]))
            for layer in cache.layers
        ]
        return encode_container(sections, first_layer=0, token_count=b, geometry=self.geometry)

    # -- internals -------------------------------------------------------------------------------

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _check_cache_shape(self) -> None:
        """Refuse a model whose cache is not one full-attention layer of the descriptor's
        shape per layer (the §4.3 geometry).

        Raises:
            UnsupportedModel: the message names the layer and what it holds.
        """
        from transformers.cache_utils import DynamicLayer

        seq = self.new_sequence()
        try:
            self._compute(seq, [0])
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UnsupportedModel(f"a one-token forward with a DynamicCache fails: {exc}") from exc
        d = self.descriptor
        layers = seq.cache.layers
        if len(layers) != d.layers:
            raise UnsupportedModel(f"the cache has {len(layers)} layers, config.json {d.layers}")
        want = (1, d.kv_heads, 1, d.head_dim)
        for i, layer in enumerate(layers):
            got = (tuple(layer.keys.shape), tuple(layer.values.shape))
            if type(layer) is not DynamicLayer or got != (want, want):
                raise UnsupportedModel(
                    f"layer {i}: a {type(layer).__name__} holding K/V {got}; per-layer KV "
                    f"must be {want} in a full-attention layer"
                )
        self.free(seq)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _whole_sink_prefix(blocks: Sequence[Container | SinkBlock]) -> HFPrefixLoad | None:
    """The sink load whose blocks 0..n-1 ``blocks`` are, in order; ``None`` otherwise."""
    first = blocks[0]
    if not isinstance(first, SinkBlock):
        return None
    for j, block in enumerate(blocks):
        if not isinstance(block, SinkBlock) or block.load is not first.load or block.block != j:
            return None
    return first.load


def _hf(seq: KVSequence) -> HFSequence:
    if not isinstance(seq, HFSequence):
        raise TypeError("not a sequence of the transformers engine")
    return seq


def _section(data: memoryview, tokens: int, kv_heads: int, head_dim: int) -> np.ndarray[Any, Any]:
    """A §4.3 section as a read-only ``[tokens, kv_heads, head_dim]`` array (no copy)."""
    return np.frombuffer(data, dtype=_WIRE).reshape(tokens, kv_heads, head_dim)


def _wire(part: torch.Tensor) -> memoryview:
    """``[kv_heads, tokens, head_dim]`` of a layer as its §4.3 section's octets."""
    host = part.transpose(0, 1).contiguous().to("cpu")
    return byte_view(host.numpy(), "KV section")


def _load_model(folder: str | Path, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # stderr is a log here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(folder),
                local_files_only=True,
                trust_remote_code=False,
                use_safetensors=True,
                attn_implementation="eager",
                dtype=torch.float32,
            )
    except (OSError, ValueError, KeyError) as exc:
        raise UnsupportedModel(f"{folder}: cannot load as a causal LM: {exc}") from exc
    return model.to(device).eval()


class HFEngine(CoreEngine):
    """The transformers engine behind the instance agent (an
    :class:`~kvsp.engine.api.InferenceEngine`).

    Raises:
        CheckpointError: the folder cannot be loaded.
        UnsupportedModel: a model the engine refuses; the message names the feature.
        BadRequest: a kv dtype other than fp32.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        num_pages: int = 1024,
        block_tokens: int = 16,
        kv_dtype: str = KV_DTYPE,
        held_blocks: int | None = None,
        model: str | None = None,
    ) -> None:
        self.core = HFCore(
            model_dir,
            device=device,
            num_pages=num_pages,
            block_tokens=block_tokens,
            kv_dtype=kv_dtype,
            model=model,
        )
        super().__init__(
            self.core,
            vocab=self.core.vocab_size,
            held_blocks=held_blocks if held_blocks is not None else num_pages,
            thread_name="kvsp-hf-engine",
        )

    def _import(self, block: Container) -> int:
        """Take the decoded block as it is: its sections are copied once, into the cache."""
        return self.core.import_loaded(block)

    async def prefix_sinks(self, blocks: int) -> HFPrefixLoad:
        """Pages and layer sinks for blocks 0..``blocks``-1 of a prompt (engine thread; see
        :meth:`HFCore.prefix_sinks`): pass ``load.sink(j)`` to a transfer as its ``sink``,
        commit or accept what it verified, then :meth:`prefill_loaded`.

        Raises:
            InsufficientStorage: too few free KV pages.
        """
        try:
            return await asyncio.wrap_future(self.worker.submit(self.core.prefix_sinks, blocks))
        except Conflict as exc:
            raise InsufficientStorage(f"the KV cache is full: {exc}") from exc

    async def prefill_loaded(self, prompt: Sequence[int], load: HFPrefixLoad) -> CoreSequence:
        """Prefill ``prompt`` whose first blocks ``load`` brought: its leading verified blocks
        are adopted, the rest of the prompt is computed (a failed block and every one after it
        included). ``loaded_blocks`` of the result counts the adopted blocks.

        Raises:
            BadRequest: an empty prompt, a token outside the vocabulary, or more blocks than
                the prompt has.
            InsufficientStorage: no free KV pages for the prompt.
        """
        if not prompt:
            raise BadRequest("a prompt needs at least one token", path="$.prompt")
        self._check_tokens(prompt, "$.prompt")
        job = self.worker.submit(self._run_prefill_loaded, list(prompt), load)
        return await asyncio.wrap_future(job)

    def _run_prefill_loaded(self, prompt: list[int], load: HFPrefixLoad) -> CoreSequence:
        """Adopt, compute and export on the engine thread."""
        core, b = self.core, self.core.block_tokens
        seq = CoreSequence(self, core.new_sequence(), 0)
        try:
            seq.logits = core.prefill(seq.kv, prompt, loaded_prefix_pages=load.pages)
            adopted = _hf(seq.kv).adopted
            seq.loaded_blocks = adopted
            seq.computed = [
                ComputedBlock(i, core.block_container(seq.kv, i))
                for i in range(adopted, len(prompt) // b)
            ]
        except BaseException as exc:
            waiting = core.cache.loaded
            core.cache.free(
                [
                    p
                    for p in load.pages
                    if isinstance(entry := waiting.get(p), SinkBlock) and entry.load is load
                ]
            )
            self.free(seq)
            if isinstance(exc, Conflict):
                raise InsufficientStorage(f"the KV cache is full: {exc}") from exc
            raise
        return seq
