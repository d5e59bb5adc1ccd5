"""``moqt._frozen``: read-only slices and objects the cyclic garbage collector does not walk,
what a relay's cache keeps (relay/cache.py; MOQT draft-16 §8)."""

from __future__ import annotations

import ctypes
import gc
import hashlib
import mmap
import socket
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

frozen = pytest.importorskip("moqt._frozen", reason="moqt._frozen was not built here")
FrozenSlice = frozen.FrozenSlice


def test_a_slice_holds_the_octets_of_the_view_it_was_made_from() -> None:
    data = bytes(range(256)) * 4
    piece = FrozenSlice(memoryview(data)[100:900])
    assert len(piece) == 800
    assert bytes(piece) == data[100:900]
    assert hashlib.sha256(piece).digest() == hashlib.sha256(data[100:900]).digest()
    assert repr(piece) == "<FrozenSlice of 800 octets>"
    assert not gc.is_tracked(piece)


@given(st.binary(max_size=4096), st.data())
def test_any_slice_of_any_buffer(data: bytes, draw: st.DataObject) -> None:
    start = draw.draw(st.integers(0, len(data)))
    stop = draw.draw(st.integers(start, len(data)))
    source = bytearray(data)
    piece = FrozenSlice(memoryview(source)[start:stop].toreadonly())
    assert len(piece) == stop - start and bytes(piece) == data[start:stop]
    assert bytes(FrozenSlice(piece)) == data[start:stop]  # of a slice: the same octets


def test_it_exports_read_only() -> None:
    piece = FrozenSlice(memoryview(bytearray(b"abcdef"))[1:4])
    view = memoryview(piece)
    assert view.readonly and view.format == "B" and view.tobytes() == b"bcd"
    with pytest.raises(TypeError):
        ctypes.c_char.from_buffer(piece)  # asks for a writable buffer
    with pytest.raises(TypeError):
        memoryview(piece)[0] = 1  # type: ignore[index]


def test_it_keeps_its_exporter_alive_and_locked() -> None:
    mapping = mmap.mmap(-1, 1 << 16)
    mapping[10:20] = b"0123456789"
    window = (ctypes.c_char * (1 << 16)).from_buffer(mapping)
    piece = FrozenSlice(memoryview(window).cast("B")[10:20].toreadonly())
    del window  # the slice holds the window, which holds the mapping
    gc.collect()
    with pytest.raises(BufferError):
        mapping.close()
    assert bytes(piece) == b"0123456789"
    del piece
    gc.collect()
    mapping.close()  # nothing exports it now

    growing = bytearray(b"hello world")
    piece = FrozenSlice(memoryview(growing)[6:])
    with pytest.raises(BufferError):
        growing.extend(b"!")  # a buffer something views cannot move
    del piece
    growing.extend(b"!")
    assert growing == b"hello world!"


def test_the_octets_go_to_a_socket_as_they_are() -> None:
    one, other = socket.socketpair()
    with one, other:
        one.sendmsg([FrozenSlice(memoryview(b"xxhelloxx")[2:7]), FrozenSlice(b" world")])
        assert other.recv(64) == b"hello world"


@pytest.mark.parametrize(
    "bad",
    [1, "text", None, memoryview(bytearray(16)).cast("I"), memoryview(bytes(16))[::2]],
    ids=["int", "str", "None", "typed", "strided"],
)
def test_what_is_not_contiguous_octets_is_refused(bad: object) -> None:
    with pytest.raises(TypeError):
        FrozenSlice(bad)  # type: ignore[arg-type]


def test_an_empty_slice() -> None:
    assert len(FrozenSlice(b"")) == 0 and bytes(FrozenSlice(memoryview(b"abc")[3:])) == b""


@dataclass(frozen=True, slots=True)
class Pair:
    a: int
    b: bytes


def test_untrack_takes_python_objects_and_tuples_off_the_collectors_lists() -> None:
    pair = Pair(1, b"x")
    assert gc.is_tracked(pair)
    assert frozen.untrack(pair) is pair and not gc.is_tracked(pair)
    assert frozen.untrack(pair) is pair  # again: harmless
    pieces = (FrozenSlice(b"abc"), b"def")
    assert not gc.is_tracked(frozen.untrack(pieces))
    del pair, pieces  # freed by their reference counts, as untracked objects are
    gc.collect()


@pytest.mark.parametrize(
    "bad", [[1], {"a": 1}, 5, memoryview(b"x")], ids=["list", "dict", "int", "memoryview"]
)
def test_untrack_refuses_what_it_cannot_vouch_for(bad: object) -> None:
    with pytest.raises(TypeError, match="untrack takes"):
        frozen.untrack(bad)
