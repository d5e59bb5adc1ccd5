"""Paged KV buffers on the engine's device and per-(page, layer) readiness (DESIGN.md §5).

One tensor per engine, ``[num_pages, layers, 2, block_tokens, kv_heads, head_dim]`` in the kv
dtype: page = one block of ``block_tokens`` tokens. For a fixed (page, layer, K|V) the slice
``[block_tokens, kv_heads, head_dim]`` is contiguous and in exactly the order of a §4.3
``kvsp-layout-1`` section (token slowest, dimension fastest), and K is followed by V, so a
layer of a container maps onto one contiguous run of the page's memory. Elements are stored in
the host's native order, which must be little-endian (§4.3) for the bytes to be the wire bytes.

A page being loaded carries one :class:`ReadyEvent` per layer; the forward pass of layer l for
new tokens waits only on layer l of the loaded pages, so loading overlaps computation.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from kvsp.errors import BadRequest, Conflict

KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""The §11.2.3 element types the engine can hold (``int8`` needs scales and is not offered)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a registered element type name.

    Raises:
        BadRequest: not one of :data:`KV_DTYPES`.
    """
    dtype = KV_DTYPES.get(name)
    if dtype is None:
        raise BadRequest(f"kv dtype {name!r} is not supported (one of {', '.join(KV_DTYPES)})")
    return dtype


class LayerLoadFailed(Conflict):
    """A loaded layer that will never become ready: its digest mismatched, its transfer
    failed or timed out. The engine drops the page and recomputes it."""

    def __init__(self, detail: str, *, page: int, layer: int) -> None:
        super().__init__(detail)
        self.page = page
        self.layer = layer


class ReadyEvent:
    """Readiness of one (page, layer): set by the sink after verification, or failed.

    On CPU it is a host event; on CUDA :meth:`set` also carries the ``torch.cuda.Event``
    recorded after the layer's copy, and :meth:`wait` makes the current stream wait on it
    (no host stall for the copy itself).
    """

    __slots__ = ("_device_event", "_event", "_failure", "layer", "page")

    def __init__(self, page: int, layer: int) -> None:
        self.page = page
        self.layer = layer
        self._event = threading.Event()
        self._failure: str | None = None
        self._device_event: torch.cuda.Event | None = None

    def is_set(self) -> bool:
        """Whether the layer is ready (verified and, on CUDA, its copy issued)."""
        return self._event.is_set() and self._failure is None

    @property
    def failed(self) -> bool:
        """Whether the layer will never become ready."""
        return self._failure is not None

    def set(self, device_event: torch.cuda.Event | None = None) -> None:
        """Mark the layer ready (after its digest was verified); on CUDA, with the event
        recorded after the layer's copy into the page."""
        if not self._event.is_set():
            self._device_event = device_event
            self._event.set()

    def fail(self, reason: str) -> None:
        """Mark the layer as never becoming ready; a ready layer stays ready."""
        if not self._event.is_set():
            self._failure = reason
            self._event.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the layer is ready; on CUDA order the current stream after its copy.

        Raises:
            LayerLoadFailed: the layer failed or ``timeout`` seconds passed.
        """
        if not self._event.wait(timeout):
            self.fail(f"timed out after {timeout} s")
        if self._failure is not None:
            raise LayerLoadFailed(
                f"page {self.page} layer {self.layer}: {self._failure}",
                page=self.page,
                layer=self.layer,
            )
        if self._device_event is not None:
            self._device_event.wait()  # the current stream runs on after the copy


@dataclass(slots=True)
class KVSequence:
    """One sequence's view of the cache: its page table and how many tokens have KV."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    """The tokens whose KV is in the pages, in order (``len`` = the sequence length)."""

    @property
    def length(self) -> int:
        """Tokens with KV in the cache."""
        return len(self.tokens)


class PagedKVCache:
    """The engine's paged KV tensor, its page allocator and the readiness of loaded pages.

    Raises:
        BadRequest: an unsupported kv dtype, or a big-endian host (§4.3 is little-endian).
    """

    def __init__(
        self,
        *,
        num_pages: int,
        layers: int,
        block_tokens: int,
        kv_heads: int,
        head_dim: int,
        kv_dtype: str,
        device: torch.device | str = "cpu",
    ) -> None:
        if sys.byteorder != "little":
            # §4.3: elements are little-endian; the pages hold native order.
            raise BadRequest("the paged KV cache needs a little-endian host")
        self.kv_dtype = kv_dtype
        self.dtype = torch_dtype(kv_dtype)
        self.device = torch.device(device)
        self.layers = layers
        self.block_tokens = block_tokens
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        shape = (num_pages, layers, 2, block_tokens, kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))
        self._events: dict[int, list[ReadyEvent]] = {}
        self._bytes: npt.NDArray[np.uint8] | None = None
        if self.device.type == "cpu":  # the pages' octets, shared with the tensor
            self._bytes = self.kv.view(torch.uint8).numpy()

    @property
    def num_pages(self) -> int:
        """Pages in the cache."""
        return int(self.kv.shape[0])

    @property
    def section_length(self) -> int:
        """Octets of one K or V section of one page (§4.3 codec raw)."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.kv.element_size()

    @property
    def used_pages(self) -> int:
        """Pages allocated to sequences or loads."""
        return self.num_pages - len(self._free)

    def utilization(self) -> float:
        """Fraction of the pages in use (the status record's ``kv_utilization``, §4.4)."""
        return self.used_pages / self.num_pages

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free pages.

        Raises:
            Conflict: not enough free pages.
        """
        if count > len(self._free):
            raise Conflict(f"KV cache full: {count} pages asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool (their readiness events are dropped)."""
        for page in pages:
            self._events.pop(page, None)
            self._free.append(page)

    # -- readiness of loaded pages ------------------------------------------------------------

    def begin_load(self, page: int) -> list[ReadyEvent]:
        """Create the page's per-layer readiness events (all pending) and return them."""
        events = [ReadyEvent(page, layer) for layer in range(self.layers)]
        self._events[page] = events
        return events

    def events(self, page: int) -> list[ReadyEvent] | None:
        """The page's readiness events, or None when the page is not being loaded."""
        return self._events.get(page)

    def wait_layer(self, pages: Sequence[int], layer: int, timeout: float | None) -> None:
        """Wait until ``layer`` of every loaded page among ``pages`` is ready, in page order.

        Raises:
            LayerLoadFailed: one of them failed or timed out (the first in page order).
        """
        for page in pages:
            events = self._events.get(page)
            if events is not None:
                events[layer].wait(timeout)

    def settle(self, pages: Iterable[int]) -> None:
        """Forget the events of loaded pages once consumed: the stream is ordered after them."""
        for page in pages:
            events = self._events.get(page)
            if events is not None and all(e.is_set() for e in events):
                del self._events[page]

    # -- tensors and bytes ----------------------------------------------------------------------

    def write(
        self, layer: int, pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K and V ``[n, kv_heads, head_dim]`` of n tokens at (page, slot) pairs."""
        self.kv[pages, layer, 0, slots] = k.to(self.dtype)
        self.kv[pages, layer, 1, slots] = v.to(self.dtype)

    def gather(
        self, layer: int, pages: torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, kv_heads, head_dim]`` of a sequence's first ``length`` tokens."""
        both = self.kv[pages, layer].to(dtype)  # [pages, 2, B, kv_heads, head_dim]
        k = both[:, 0].reshape(-1, self.kv_heads, self.head_dim)[:length]
        v = both[:, 1].reshape(-1, self.kv_heads, self.head_dim)[:length]
        return k, v

    def layer_views(self, page: int, layer: int) -> tuple[memoryview, memoryview]:
        """Writable byte views of the K and V sections of (page, layer) — CPU cache only.

        Raises:
            ValueError: the cache is not in host memory.
        """
        if self._bytes is None:
            raise ValueError("byte views of a device cache need a staging buffer")
        k: npt.NDArray[np.uint8] = self._bytes[page, layer, 0]
        v: npt.NDArray[np.uint8] = self._bytes[page, layer, 1]
        return k.reshape(-1).data, v.reshape(-1).data

    def host_page_bytes(self, page: int, timeout: float | None = None) -> memoryview:
        """The page's bytes (layers × K, V sections) as a flat host view; a device page is
        copied to host memory once, a CPU page is not copied. A page being loaded is read
        only once all its layers are ready.

        Raises:
            LayerLoadFailed: a layer of a loading page failed or timed out.
        """
        for event in self._events.get(page, ()):
            event.wait(timeout)
        if self._bytes is not None:
            local: npt.NDArray[np.uint8] = self._bytes[page]
            return local.reshape(-1).data
        host: npt.NDArray[np.uint8] = self.kv[page].cpu().contiguous().view(torch.uint8).numpy()
        return host.reshape(-1).data
