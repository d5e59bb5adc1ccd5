"""Layer sinks of the transformers engine: verified layers straight into a prefix's per-layer
K/V tensors (DESIGN.md §5; spec §4.3, §6.5, §6.7).

:class:`HFPrefixLoad` preallocates, for each layer of the model, one K and one V tensor of
``[blocks × block_tokens, kv_heads, head_dim]`` float32 — the §4.3 ``kvsp-layout-1`` order, so
the rows of block j are exactly the octets of block j's K (or V) section. Its
:class:`HFBlockSink` of block j is a :class:`~kvsp.container_reader.LayerSink`: the reader of a
transfer (:meth:`kvsp.transfer.block_client.BlockClient.get_block`,
:meth:`kvsp.transfer.moqt_client.MoqtBlockClient.stream_block`, ``sink=``) writes each layer's
wire octets into byte views of those rows, with no intermediate copy. On a CUDA device the
tensors are pinned host memory and each layer goes to the device in one copy when a sequence
adopts the prefix.

A layer counts only once it is committed, i.e. after the reader verified it against the Replica
Record's layer digest (§6.7): :meth:`HFBlockSink.commit` per verified layer (what
``stream_block`` yields), or :meth:`HFBlockSink.accept` with the block ``get_block`` returned.
Octets that failed verification may lie in the rows, but the block is never committed, and
:meth:`kvsp.engine.transformers_engine.HFCore.prefill` adopts only the leading blocks whose
every layer was committed; that block and every one after it are recomputed (§6.5).

A sequence adopting blocks 0..n-1 takes views of the tensors' first ``n × block_tokens`` rows as
its cache (``[1, kv_heads, tokens, head_dim]``, transposed views, no copy on CPU); the model's
first forward appends to them, which copies them once into its own cache tensors, as it does
for every cache. From adoption on, the load refuses further octets.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvsp.container import Container, Geometry
from kvsp.errors import ContainerError, Incompatible

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True, slots=True)
class SinkBlock:
    """Block ``block`` of ``load``, waiting in a page of the engine for a sequence."""

    load: HFPrefixLoad
    block: int


class HFPrefixLoad:
    """Blocks 0..n-1 of a prefix, loading through :meth:`sink` into per-layer K/V tensors.

    ``pages`` are the engine's pages accounting for the blocks (one each); pass them as
    ``loaded_prefix_pages`` to :meth:`~kvsp.engine.transformers_engine.HFCore.prefill`.

    Raises:
        ValueError: fewer than one block, or pages of another count.
        Incompatible: a big-endian host (the wire is little-endian float32).
    """

    def __init__(
        self, geometry: Geometry, block_tokens: int, pages: Sequence[int], device: torch.device
    ) -> None:
        if not pages:
            raise ValueError("a prefix load needs at least one block")
        if sys.byteorder != "little":
            raise Incompatible("the wire's little-endian float32 needs a little-endian host")
        if geometry.element_size != 4:
            raise Incompatible("the transformers engine loads float32 KV only")
        self.geometry = geometry
        self.block_tokens = block_tokens
        self.pages = list(pages)
        self.device = device
        rows = (len(self.pages) * block_tokens, geometry.kv_heads, geometry.head_dim)
        pin = device.type == "cuda"
        self.keys = [self._empty(rows, pin) for _ in range(geometry.layers)]
        """Per layer, the K rows of every block (``[tokens, kv_heads, head_dim]``)."""
        self.values = [self._empty(rows, pin) for _ in range(geometry.layers)]
        """Per layer, the V rows of every block."""
        self.section_length = geometry.section_length(block_tokens)
        self._lock = threading.Lock()
        self._adopted = False
        self._sinks = [HFBlockSink(self, j) for j in range(len(self.pages))]

    @staticmethod
    def _empty(shape: tuple[int, int, int], pin: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, pin_memory=pin)

    def __len__(self) -> int:
        return len(self._sinks)

    def sink(self, block: int) -> HFBlockSink:
        """The sink of block ``block`` (0-based position in the prefix)."""
        return self._sinks[block]

    @property
    def sinks(self) -> list[HFBlockSink]:
        """The sinks of blocks 0..n-1."""
        return list(self._sinks)

    @property
    def verified_blocks(self) -> int:
        """How many leading blocks have every layer committed (verified)."""
        with self._lock:
            return self._leading()

    def _leading(self) -> int:
        count = 0
        for sink in self._sinks:
            if not sink._complete():
                break
            count += 1
        return count

    def adopt(self, blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the first ``blocks`` blocks, per layer ``[1, kv_heads, tokens, head_dim]``
        (on the engine's device); from now on every sink refuses octets (engine thread).

        Raises:
            ContainerError: fewer leading blocks are verified.
        """
        with self._lock:
            if blocks > self._leading():
                raise ContainerError(f"block {self._leading()} of the prefix is not verified")
            self._adopted = True
        tokens = blocks * self.block_tokens
        return (
            [self._cache_view(t, tokens) for t in self.keys],
            [self._cache_view(t, tokens) for t in self.values],
        )

    def close(self, reason: str = "the prefix load was given up") -> None:
        """Refuse every further octet (the engine freed or adopted the pages)."""
        with self._lock:
            self._adopted = True
        for sink in self._sinks:
            sink.abort(reason)

    def rows(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``block``'s K and V rows of ``layer`` (``[block_tokens, kv_heads, head_dim]``)."""
        rows = slice(block * self.block_tokens, (block + 1) * self.block_tokens)
        return self.keys[layer][rows], self.values[layer][rows]

    def _cache_view(self, part: torch.Tensor, tokens: int) -> torch.Tensor:
        view = part[:tokens].permute(1, 0, 2).unsqueeze(0)
        if self.device.type == "cpu":
            return view
        return view.to(self.device, non_blocking=True)


def _byte_view(part: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory."""
    array: np.ndarray[tuple[int], np.dtype[np.uint8]] = part.numpy().reshape(-1).view(np.uint8)
    return array.data


def _address(data: memoryview) -> int:
    """The address of a memoryview's first octet."""
    array = np.frombuffer(data, dtype=np.uint8)
    address: int = array.__array_interface__["data"][0]
    return address


class HFBlockSink:
    """The :class:`~kvsp.container_reader.LayerSink` of one block of an :class:`HFPrefixLoad`.

    The reader writes layer l's K and V sections into the block's rows of the layer's tensors;
    the layer counts once :meth:`commit` (or :meth:`accept`) says it was verified.
    """

    def __init__(self, load: HFPrefixLoad, block: int) -> None:
        self.load = load
        self.block = block
        self._committed = [False] * load.geometry.layers
        self._open: set[int] = set()
        self.error: str | None = None
        """Why the block failed (it is then recomputed); ``None``: it did not."""

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        """Writable views of the block's rows of layer ``index`` (K, then V).

        Raises:
            Incompatible: the layer or the section sizes do not fit (another token count or
                geometry).
            ContainerError: the block failed or was adopted, or the layer is already committed.
        """
        load, section = self.load, self.load.section_length
        if not 0 <= index < len(self._committed):
            raise Incompatible(f"layer {index} beyond the model's {len(self._committed)} layers")
        if k_len != section or v_len != section:
            raise Incompatible(
                f"layer {index}: sections of {k_len} and {v_len} octets, a block holds {section}"
                f" ({load.block_tokens} tokens)"
            )
        with load._lock:
            if load._adopted or self.error is not None:
                raise ContainerError(f"block {self.block} takes no more octets")
            if self._committed[index]:
                raise ContainerError(f"layer {index} of block {self.block} is already loaded")
            self._open.add(index)
        k, v = load.rows(index, self.block)
        return _byte_view(k), _byte_view(v)

    def commit(self, index: int) -> None:
        """Layer ``index`` was verified against its layer digest: it counts from now on.

        Raises:
            ContainerError: no buffer of that layer was handed out, or the block failed.
        """
        with self.load._lock:
            if self.error is not None:
                raise ContainerError(f"block {self.block} failed: {self.error}")
            if index not in self._open:
                raise ContainerError(f"layer {index} committed, its buffer was not handed out")
            self._open.discard(index)
            self._committed[index] = True

    def accept(self, block: Container) -> None:
        """Commit every layer of ``block``, the whole block a transfer returned verified.

        A layer whose octets did not land in the sink (a transport that kept its own buffer)
        is copied in, once. A :class:`~kvsp.transfer.verify.VerifiedBlock` not checked against
        the producer's layer digests (``producer_verified`` false) is refused.

        Raises:
            Incompatible: not the whole block of this geometry, or not verified per layer.
            ContainerError: the block failed or was adopted.
        """
        layers = len(self._committed)
        b = self.load.block_tokens
        try:
            if not getattr(block, "producer_verified", False):
                raise Incompatible("a block not verified against its layer digests")
            if (block.first_layer, block.layer_count, block.token_count) != (0, layers, b):
                raise Incompatible(
                    f"layers {block.first_layer}+{block.layer_count} of {block.token_count}"
                    f" tokens; the prefix needs all {layers} layers of {b} tokens"
                )
            for layer in block.layers:
                index = layer.index
                if index not in self.missing():
                    continue  # committed as the transfer yielded it
                k_rows, v_rows = self.load.rows(index, self.block)
                if _address(layer.k) == k_rows.data_ptr() and _address(layer.v) == (
                    v_rows.data_ptr()
                ):
                    self._mark(index)  # the reader wrote it into the rows: no copy
                    continue
                k, v = self.layer_buffer(index, layer.k.nbytes, layer.v.nbytes)
                k[:] = layer.k.cast("B")
                v[:] = layer.v.cast("B")
                self.commit(index)
        except BaseException as exc:
            self.abort(str(exc))
            raise

    def _mark(self, index: int) -> None:
        with self.load._lock:
            if self.load._adopted or self.error is not None:
                raise ContainerError(f"block {self.block} takes no more octets")
            self._open.discard(index)
            self._committed[index] = True

    def abort(self, reason: str) -> None:
        """The block failed: none of its layers counts, and it takes no more octets."""
        with self.load._lock:
            if self.error is None and not self._complete_locked():
                self.error = reason
            self._open.clear()

    def _complete_locked(self) -> bool:
        return all(self._committed)

    def _complete(self) -> bool:
        return self.error is None and all(self._committed)

    @property
    def complete(self) -> bool:
        """Whether every layer of the block was committed (and none failed)."""
        with self.load._lock:
            return self._complete()

    def missing(self) -> list[int]:
        """Layers not (yet) committed."""
        with self.load._lock:
            return [i for i, done in enumerate(self._committed) if not done]
