"""Reuse of loaded KV blocks is exact (DESIGN.md §5–6; spec §4.3, §6.5, §6.7).

A prompt's blocks exported by engine A as KVB1 containers, fed through the ContainerReader and
the DeviceSink into engine B's pages, give B the same logits, bit for bit, as B's own full
recompute: prefill runs in block-aligned chunks, so both paths run identical operations on
identical cache contents. A corrupted layer is caught, never marked ready, and recomputed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")


from kvsp.container import KVB1_HEADER, decode_container, header_size  # noqa: E402
from kvsp.container_reader import ContainerReader  # noqa: E402
from kvsp.engine.blocks import geometry_of, page_container, page_container_parts  # noqa: E402
from kvsp.engine.checkpoint import init_model  # noqa: E402
from kvsp.engine.engine import Engine, ExportedBlock  # noqa: E402
from kvsp.engine.kvcache import LayerLoadFailed  # noqa: E402
from kvsp.engine.sampler import Sampler  # noqa: E402
from kvsp.engine.sink import BlockLoader, DeviceSink  # noqa: E402
from kvsp.errors import DigestMismatch, Incompatible  # noqa: E402
from tests.support.polling import eventually  # noqa: E402

torch.set_num_threads(1)
B = 8
PROMPT = [(7 * i + 3) % 256 for i in range(45)]  # 5 complete blocks and 5 tail tokens
LOADED = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("reuse"), seed=11, layers=3, hidden=64, heads=4, kv_heads=2
    )


def _engine(model_dir: Path, **kw: object) -> Engine:
    return Engine(model_dir, num_pages=24, block_tokens=B, **kw)  # type: ignore[arg-type]


def _layer_chunks(container: bytes) -> list[bytes]:
    """The container cut at its header and at every layer boundary."""
    count = KVB1_HEADER.unpack_from(container)[5]
    size = header_size(count)
    layer = (len(container) - size) // count
    cuts = [0, size, *(size + (i + 1) * layer for i in range(count))]
    return [container[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_loaded_prefix_is_bit_exact(model_dir: Path, kv_dtype: str) -> None:
    a, b = _engine(model_dir, kv_dtype=kv_dtype), _engine(model_dir, kv_dtype=kv_dtype)
    assert a.compat_id == b.compat_id
    blocks = a.export_prompt_blocks(PROMPT)
    assert [x.index for x in blocks] == [0, 1, 2, 3, 4]

    full_seq = b.new_sequence()
    full = b.prefill(full_seq, PROMPT, all_logits=True)
    # the loaded KV bytes equal what B computes itself for that prefix
    for i, block in enumerate(blocks):
        assert b.block_container(full_seq, i) == block.container

    load = b.load_prefix(
        [[x.container] for x in blocks[:LOADED]], [x.layer_digests for x in blocks[:LOADED]]
    )
    seq = b.new_sequence()
    part = b.prefill(seq, PROMPT, loaded_prefix_pages=load.pages, all_logits=True)
    assert load.error is None and load.loaded == LOADED
    assert seq.pages[:LOADED] == load.pages
    assert part.shape[0] == len(PROMPT) - LOADED * B
    assert torch.equal(part, full[LOADED * B :])  # bit-exact, not merely close
    for i in range(LOADED):
        page = load.pages[i]
        assert torch.equal(b.cache.kv[page], b.cache.kv[full_seq.pages[i]])

    sampler = Sampler()
    reference = list(b.generate(PROMPT, 8, sampler))
    load2 = b.load_prefix([[x.container] for x in blocks], [x.layer_digests for x in blocks])
    assert list(b.generate(PROMPT, 8, sampler, loaded_prefix_pages=load2.pages)) == reference
    b.free(seq)
    b.free(full_seq)
    b.close()
    assert b.cache.used_pages == 0


def test_wider_chunks_agree_to_rounding(model_dir: Path) -> None:
    """With prefill chunks of 4 blocks a 3-block prefix cuts a chunk: close, not identical."""
    a, b = _engine(model_dir), _engine(model_dir, prefill_chunk=4 * B)
    blocks = a.export_prompt_blocks(PROMPT)
    seq = b.new_sequence()
    full = b.prefill(seq, PROMPT)
    pages = [b.import_block(x.container, x.layer_digests) for x in blocks[:LOADED]]
    seq2 = b.new_sequence()
    part = b.prefill(seq2, PROMPT, loaded_prefix_pages=pages)
    assert torch.allclose(part, full, rtol=0, atol=1e-5)  # measured 7e-7
    assert int(torch.argmax(part)) == int(torch.argmax(full))


def test_layer_l_waits_only_for_layer_l(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill computes layers 0 and 1 of the new tokens while layer 2 is still loading."""
    a, b = _engine(model_dir), _engine(model_dir)
    blocks = a.export_prompt_blocks(PROMPT)[:LOADED]
    gate = threading.Event()

    def source(block: ExportedBlock, last: bool) -> Iterator[bytes]:
        for i, piece in enumerate(_layer_chunks(block.container)):
            if last and i == 3:  # header, layer 0, layer 1 delivered; layer 2 held back
                assert gate.wait(30)
            yield piece

    waited: list[int] = []
    original = b._wait

    def recording_wait(prefix: list[int], layer: int) -> None:
        waited.append(layer)
        original(prefix, layer)

    monkeypatch.setattr(b, "_wait", recording_wait)
    load = b.load_prefix(
        [source(x, i == LOADED - 1) for i, x in enumerate(blocks)],
        [x.layer_digests for x in blocks],
    )
    result: list[torch.Tensor] = []
    seq = b.new_sequence()
    worker = threading.Thread(
        target=lambda: result.append(b.prefill(seq, PROMPT, loaded_prefix_pages=load.pages))
    )
    worker.start()
    eventually(lambda: 2 in waited, 30, "the prefill to wait on layer 2", interval=0.005)
    assert waited[:3] == [0, 1, 2]  # layers 0 and 1 ran before layer 2 had arrived
    events = b.cache.events(load.pages[-1])
    assert events is not None and events[1].is_set() and not events[2].is_set()
    gate.set()
    worker.join(30)
    assert result and load.error is None
    ref_seq = a.new_sequence()
    assert torch.equal(result[0], a.prefill(ref_seq, PROMPT))


def test_corrupted_layer_is_never_ready_and_recomputed(model_dir: Path) -> None:
    a, b = _engine(model_dir), _engine(model_dir)
    blocks = a.export_prompt_blocks(PROMPT)[:LOADED]
    bad = bytearray(blocks[1].container)
    size = header_size(3)
    section = (len(bad) - size) // 6
    bad[size + 2 * 2 * section + 5] ^= 0x01  # one bit of layer 2's K section
    sources = [[blocks[0].container], [bytes(bad)], [blocks[2].container]]
    load = b.load_prefix(sources, [x.layer_digests for x in blocks])
    load.join(30)
    assert isinstance(load.error, DigestMismatch) and "layer 2" in str(load.error)
    assert load.failed_block == 1 and load.loaded == 1
    events = b.cache.events(load.pages[1])
    assert events is not None
    assert [e.is_set() for e in events] == [True, True, False]  # verified layers only
    assert events[2].failed
    later = b.cache.events(load.pages[2])
    assert later is not None and not any(e.is_set() for e in later)
    with pytest.raises(LayerLoadFailed):
        events[2].wait(0)

    seq = b.new_sequence()
    logits = b.prefill(seq, PROMPT, loaded_prefix_pages=load.pages)
    assert seq.pages[0] == load.pages[0]  # the good block is kept
    assert seq.length == len(PROMPT)
    ref = a.new_sequence()
    assert torch.equal(logits, a.prefill(ref, PROMPT))
    for i in range(5):
        assert b.block_container(seq, i) == a.block_container(ref, i)


def test_import_block_rejects_a_mismatch(model_dir: Path) -> None:
    a, b = _engine(model_dir), _engine(model_dir)
    block = a.export_prompt_blocks(PROMPT)[0]
    bad = bytearray(block.container)
    bad[-1] ^= 0x80  # last layer's V section
    with pytest.raises(DigestMismatch):
        b.import_block(bytes(bad), block.layer_digests)
    assert b.cache.used_pages == 0
    page = b.import_block(block.container, block.layer_digests)
    assert page_container(b.cache, page) == block.container


def test_sink_writes_into_the_page_itself(model_dir: Path) -> None:
    b = _engine(model_dir)
    sink = DeviceSink(b.cache, 5)
    section = b.cache.section_length
    k, v = sink.layer_buffer(1, section, section)
    address = np.frombuffer(k, dtype=np.uint8).__array_interface__["data"][0]
    assert address == b.cache.kv[5, 1, 0].data_ptr()  # zero intermediate copy
    assert np.frombuffer(v, dtype=np.uint8).__array_interface__["data"][0] == (
        b.cache.kv[5, 1, 1].data_ptr()
    )
    with pytest.raises(Incompatible):
        sink.layer_buffer(1, section // 2, section // 2)  # a container of another token count


def test_reader_and_sink_by_hand(model_dir: Path) -> None:
    """The LayerSink protocol as a transport would drive it: ready only once verified."""
    a, b = _engine(model_dir), _engine(model_dir)
    block = a.export_prompt_blocks(PROMPT)[0]
    (page,) = b.cache.allocate(1)
    sink = DeviceSink(b.cache, page)
    reader = ContainerReader(geometry_of(b.cache), layer_digests=block.layer_digests, sink=sink)
    pieces = _layer_chunks(block.container)
    assert reader.feed(pieces[0] + pieces[1][:-1]) == []  # layer 0 lacks its last octet
    assert not sink.events[0].is_set()
    (layer,) = reader.feed(pieces[1][-1:])
    assert layer.index == 0 and not sink.events[0].is_set()  # verified, not yet committed
    sink.commit(0)
    assert sink.events[0].is_set() and sink.missing() == [1, 2]
    for piece in pieces[2:]:
        for layer in reader.feed(piece):
            sink.commit(layer.index)
    reader.close()
    assert sink.missing() == []
    assert page_container(b.cache, page) == block.container


def test_loader_fed_one_octet_at_a_time(model_dir: Path) -> None:
    a, b = _engine(model_dir), _engine(model_dir)
    block = a.export_prompt_blocks(PROMPT)[2]
    (page,) = b.cache.allocate(1)
    loader = BlockLoader(b.cache, page, layer_digests=block.layer_digests)
    ready = []
    for i in range(len(block.container)):
        ready += loader.feed(block.container[i : i + 1])
    loader.close()
    assert ready == [0, 1, 2]
    assert page_container(b.cache, page) == block.container


def test_export_parts_are_views_of_the_page(model_dir: Path) -> None:
    a = _engine(model_dir)
    seq = a.new_sequence()
    a.prefill(seq, PROMPT)
    parts = page_container_parts(a.cache, seq.pages[1], layers=(1, 2))
    data = b"".join(parts)
    assert data == a.block_container(seq, 1, layers=(1, 2))
    container = decode_container(data)
    assert (container.first_layer, container.layer_count, container.token_count) == (1, 2, B)
    first_k = parts[1]
    assert isinstance(first_k, memoryview)
    assert np.frombuffer(first_k, np.uint8).__array_interface__["data"][0] == (
        a.cache.kv[seq.pages[1], 1, 0].data_ptr()
    )
    # kvsp-layout-1: token slowest, dimension fastest, little-endian fp32
    k = np.frombuffer(container.layers[0].k, dtype="<f4").reshape(B, 2, 16)
    assert np.array_equal(k, a.cache.kv[seq.pages[1], 1, 0].numpy())
    stats = a.stats()
    assert stats.prefill_tokens_per_s > 0 and 0 < stats.kv_utilization <= 1
