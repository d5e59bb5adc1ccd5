"""Device sinks: container layers straight into the engine's KV pages (DESIGN.md §5, §4.3).

:class:`DeviceSink` is the :class:`~kvsp.container_reader.LayerSink` of one block going into
one page. On CPU ``layer_buffer`` hands the reader byte views of the page itself — a page's
(layer, K|V) slice is laid out exactly as a §4.3 section — so the wire octets land in place
with no intermediate copy. On CUDA it hands out a pinned host staging buffer of one layer;
once the reader has verified the layer, a non-blocking copy on a side stream moves it into the
page and one event per layer records that copy. The staging buffer is reused only after that
event completes, so a block in flight never holds more than one layer of staging.

A layer becomes ready only after the reader returned it from ``feed``, i.e. after its digest
matched the Replica Record (§6.7); a layer that fails never does, and the engine drops the
page and recomputes it. :class:`BlockLoader` drives reader and sink for one block;
:class:`PrefixLoad` loads a prefix's blocks in order on a background thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from kvsp.container import KVB1_HEADER, Buffer, Geometry, byte_view, header_size
from kvsp.container_reader import ContainerReader
from kvsp.engine.kvcache import PagedKVCache, ReadyEvent
from kvsp.errors import ContainerError, Incompatible


class Staging:
    """A pinned host buffer of one layer (K then V), its copy stream and last copy's event."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.host = torch.empty(2 * cache.section_length, dtype=torch.uint8, pin_memory=True)
        self.typed = self.host.view(cache.dtype).view(cache.kv.shape[2:])
        self.view = self.host.numpy().data
        self.stream = torch.cuda.Stream(cache.device)  # type: ignore[no-untyped-call]
        # work already queued on the page (a previous owner's kernels) comes first
        self.stream.wait_stream(torch.cuda.current_stream(cache.device))
        self.last_copy: torch.cuda.Event | None = None

    def acquire(self) -> memoryview:
        """The buffer, once the copy that last read it has completed."""
        if self.last_copy is not None:
            self.last_copy.synchronize()
            self.last_copy = None
        return self.view

    def copy_to(self, destination: torch.Tensor) -> torch.cuda.Event:
        """Copy the buffer into ``destination`` on the side stream; return the copy's event."""
        with torch.cuda.stream(self.stream):
            destination.copy_(self.typed, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self.last_copy = event
        return event


class DeviceSink:
    """The :class:`~kvsp.container_reader.LayerSink` of one block loading into one page.

    Raises:
        ValueError: a CUDA cache without a :class:`Staging` buffer.
    """

    def __init__(self, cache: PagedKVCache, page: int, *, staging: Staging | None = None) -> None:
        if cache.device.type != "cpu" and staging is None:
            raise ValueError("a device cache needs a pinned staging buffer")
        self.cache = cache
        self.page = page
        self.staging = staging
        self.events: list[ReadyEvent] = cache.events(page) or cache.begin_load(page)
        self._open: int | None = None

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        """Writable views for layer ``index``: the page itself (CPU) or the staging buffer.

        Raises:
            Incompatible: the layer or section sizes do not fit the page (other token count
                or geometry).
        """
        section = self.cache.section_length
        if not 0 <= index < self.cache.layers:
            raise Incompatible(f"layer {index} beyond the cache's {self.cache.layers} layers")
        if k_len != section or v_len != section:
            raise Incompatible(
                f"layer {index}: sections of {k_len} and {v_len} octets, a page holds {section}"
                f" ({self.cache.block_tokens} tokens)"
            )
        self._open = index
        if self.staging is None:
            return self.cache.layer_views(self.page, index)
        view = self.staging.acquire()
        return view[:section], view[section:]

    def commit(self, index: int) -> None:
        """Layer ``index`` was verified: make it ready (after its copy, on CUDA).

        Raises:
            ContainerError: ``index`` is not the layer whose buffer was handed out last.
        """
        if index != self._open:
            raise ContainerError(f"layer {index} committed, layer {self._open} was open")
        self._open = None
        if self.staging is None:
            self.events[index].set()
            return
        event = self.staging.copy_to(self.cache.kv[self.page, index])
        self.events[index].set(event)

    def abort(self, reason: str) -> None:
        """Fail every layer not yet ready; it will never become ready."""
        self._open = None
        for event in self.events:
            event.fail(reason)

    def missing(self) -> list[int]:
        """Layers not (yet) ready."""
        return [e.layer for e in self.events if not e.is_set()]


class BlockLoader:
    """One container into one page: the reader verifies each layer, then the sink commits it.

    ``layer_digests`` is the Replica Record's list (§6.7); without it layers are only parsed.
    With ``complete`` the container must bring every layer of the model.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        page: int,
        *,
        layer_digests: Sequence[bytes] | None = None,
        digest: bytes | None = None,
        staging: Staging | None = None,
        complete: bool = True,
    ) -> None:
        self.sink = DeviceSink(cache, page, staging=staging)
        geometry = Geometry(cache.layers, cache.kv_heads, cache.head_dim, cache.kv.element_size())
        try:
            self.reader = ContainerReader(
                geometry,
                layer_digests=layer_digests,
                digest=digest,
                sink=self.sink,
                hash_container=False,
            )
        except BaseException as exc:
            self.sink.abort(str(exc))
            raise
        self.complete = complete
        self._head = bytearray()  # the fixed header, for the layer count
        self._fed = 0
        self._bounds: list[int] = []  # container offsets where each layer ends
        self._next = 0  # index into _bounds of the layer in progress

    def feed(self, chunk: Buffer) -> list[int]:
        """Consume a chunk; return the layers it made ready (verified).

        The chunk goes to the reader in pieces that end at layer boundaries, so each layer is
        committed before the reader asks for the next layer's buffer (one staging buffer).

        Raises:
            KVSPError: what :meth:`ContainerReader.feed` raises; every layer not yet ready is
                then failed.
        """
        mv = byte_view(chunk, "chunk")
        ready: list[int] = []
        try:
            while mv:
                n = self._room(len(mv))
                piece, mv = mv[:n], mv[n:]
                if len(self._head) < KVB1_HEADER.size:
                    self._head += piece[: KVB1_HEADER.size - len(self._head)]
                self._fed += n
                for layer in self.reader.feed(piece):
                    self.sink.commit(layer.index)
                    ready.append(layer.index)
        except BaseException as exc:
            self.sink.abort(str(exc))
            raise
        return ready

    def _room(self, available: int) -> int:
        """Octets that may go to the reader before the next header or layer boundary."""
        header = self.reader.header
        if header is None:
            if self._fed < KVB1_HEADER.size:
                return min(available, KVB1_HEADER.size - self._fed)
            count = KVB1_HEADER.unpack_from(self._head)[5]
            return min(available, header_size(count) - self._fed)
        if not self._bounds:
            end = header.size
            for k_len, v_len in header.lengths:
                end += k_len + v_len
                self._bounds.append(end)
        while self._next < len(self._bounds) and self._bounds[self._next] <= self._fed:
            self._next += 1
        if self._next == len(self._bounds):
            return available  # past the last layer: the reader rejects the trailing octets
        return min(available, self._bounds[self._next] - self._fed)

    def close(self) -> None:
        """Declare the end of the container.

        Raises:
            ContainerError: truncated input, or (with ``complete``) layers missing.
        """
        try:
            self.reader.close()
            missing = self.sink.missing() if self.complete else []
            if missing:
                raise ContainerError(f"layers {missing[0]}..{missing[-1]} not in the container")
        except BaseException as exc:
            self.sink.abort(str(exc))
            raise

    def abort(self, reason: str) -> None:
        """Give up on the block: its layers not yet ready never will be."""
        self.sink.abort(reason)


def load_block(
    cache: PagedKVCache,
    page: int,
    chunks: Iterable[Buffer],
    *,
    layer_digests: Sequence[bytes] | None = None,
    staging: Staging | None = None,
) -> None:
    """Load one whole container, chunk by chunk, into ``page``.

    Raises:
        KVSPError: a bad container or a digest mismatch (the page's layers not ready fail).
    """
    loader = BlockLoader(cache, page, layer_digests=layer_digests, staging=staging)
    try:
        for chunk in chunks:
            loader.feed(chunk)
    except BaseException as exc:
        loader.abort(str(exc))
        raise
    loader.close()


class PrefixLoad:
    """Blocks 0..n-1 of a prefix loading into ``pages`` on a background thread, in order.

    Each layer becomes ready as soon as it is verified. On the first failure the thread stops
    and every layer of that block and the later ones that is not ready fails; ``error`` and
    ``failed_block`` say what happened. One staging buffer serves all blocks (CUDA).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        pages: Sequence[int],
        sources: Sequence[Iterable[Buffer]],
        layer_digests: Sequence[Sequence[bytes] | None],
    ) -> None:
        if not len(pages) == len(sources) == len(layer_digests):
            raise ValueError("pages, sources and layer_digests differ in length")
        self.cache = cache
        self.pages = list(pages)
        self._sources = list(sources)
        self._digests = list(layer_digests)
        self.loaded = 0
        self.error: BaseException | None = None
        self.failed_block: int | None = None
        for page in self.pages:
            cache.begin_load(page)
        self._thread = threading.Thread(target=self._run, name="kvsp-prefix-load", daemon=True)

    def start(self) -> PrefixLoad:
        """Start the loading thread; returns self."""
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to stop touching the pages."""
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the thread is still loading."""
        return self._thread.is_alive()

    def _run(self) -> None:
        staging = Staging(self.cache) if self.cache.device.type != "cpu" else None
        try:
            self._load_all(staging)
        finally:
            if staging is not None and staging.last_copy is not None:
                staging.last_copy.synchronize()  # no copy may outlive the staging buffer

    def _load_all(self, staging: Staging | None) -> None:
        for i, page in enumerate(self.pages):
            try:
                load_block(
                    self.cache,
                    page,
                    self._sources[i],
                    layer_digests=self._digests[i],
                    staging=staging,
                )
            except BaseException as exc:  # reported through error and failed_block
                self.error, self.failed_block = exc, i
                for later in self.pages[i:]:
                    for event in self.cache.events(later) or ():
                        event.fail(f"block {i} failed: {exc}")
                return
            self.loaded = i + 1
