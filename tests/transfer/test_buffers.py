"""BufferPool: receive buffers are lent again only once nothing made from them is alive."""

from __future__ import annotations

import gc
import random
import threading

import numpy as np
import pytest

from kvsp.transfer.buffers import BufferPool

SIZE = 4096


def address(view: memoryview) -> int:
    """Where a buffer's memory starts (no reference to it is kept)."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def test_a_buffer_is_writable_contiguous_octets_of_the_size_asked() -> None:
    view = BufferPool().take(SIZE)
    assert (len(view), view.format, view.itemsize, view.readonly) == (SIZE, "B", 1, False)
    assert view.c_contiguous
    view[:] = bytes(range(256)) * (SIZE // 256)
    assert bytes(view[:4]) == b"\x00\x01\x02\x03"


def test_a_dropped_buffer_is_lent_again() -> None:
    pool = BufferPool()
    first = pool.take(SIZE)
    where = address(first)
    del first
    assert pool.idle_bytes == SIZE
    again = pool.take(SIZE)
    assert address(again) == where
    assert (pool.allocated, pool.reused, pool.idle_bytes) == (1, 1, 0)


def test_a_slice_keeps_its_buffer_lent() -> None:
    pool = BufferPool()
    view = pool.take(SIZE)
    view[:] = b"\xaa" * SIZE
    part = view[100:200]
    del view
    other = pool.take(SIZE)
    other[:] = b"\x55" * SIZE
    assert bytes(part) == b"\xaa" * 100, "a live slice's memory was lent again"
    assert (pool.allocated, pool.reused) == (2, 0)
    del part
    assert pool.idle_bytes == SIZE


def test_arrays_made_from_a_buffer_keep_it_lent() -> None:
    pool = BufferPool()
    view = pool.take(SIZE)
    view[:] = b"\x01" * SIZE
    array = np.frombuffer(view[8:], dtype=np.uint16).reshape(-1, 4)
    del view
    pool.take(SIZE)[:] = b"\x02" * SIZE
    assert int(array.sum()) == 0x0101 * (SIZE - 8) // 2
    assert pool.reused == 0
    del array
    assert pool.idle_bytes == 2 * SIZE  # the second buffer came back at once


def test_a_tensor_made_from_a_buffer_keeps_it_lent() -> None:
    torch = pytest.importorskip("torch")
    pool = BufferPool()
    view = pool.take(SIZE)
    view[:] = b"\x03" * SIZE
    tensor = torch.frombuffer(view, dtype=torch.uint8)
    del view
    pool.take(SIZE)[:] = b"\x04" * SIZE
    assert int(tensor.sum()) == 3 * SIZE and pool.reused == 0
    del tensor
    gc.collect()
    assert pool.idle_bytes == 2 * SIZE  # the second buffer came back at once


def test_sizes_are_not_mixed() -> None:
    pool = BufferPool()
    dropped = pool.take(SIZE)
    del dropped
    larger = pool.take(SIZE + 1)
    assert len(larger) == SIZE + 1
    assert (pool.allocated, pool.reused, pool.idle_bytes) == (2, 0, SIZE)


def test_idle_buffers_are_bounded() -> None:
    pool = BufferPool(max_bytes=3 * SIZE)
    views = [pool.take(SIZE) for _ in range(5)]
    del views
    assert pool.idle_bytes == 3 * SIZE
    none_kept = BufferPool(0)
    kept = none_kept.take(SIZE)
    del kept
    assert none_kept.idle_bytes == 0
    assert len(none_kept.take(SIZE)) == SIZE and none_kept.reused == 0


def test_clear_drops_the_idle_buffers() -> None:
    pool = BufferPool()
    lent, idle = pool.take(SIZE), pool.take(SIZE)
    del idle
    pool.clear()
    assert pool.idle_bytes == 0
    del lent
    assert pool.idle_bytes == SIZE  # a lent buffer still comes back


def test_a_closed_pool_keeps_nothing() -> None:
    pool = BufferPool()
    lent, idle = pool.take(SIZE), pool.take(SIZE)
    del idle
    pool.close()
    assert pool.idle_bytes == 0
    del lent
    assert pool.idle_bytes == 0  # freed, not kept
    assert len(pool.take(SIZE)) == SIZE and pool.reused == 0


def test_a_buffer_in_a_reference_cycle_comes_back_when_collected() -> None:
    pool = BufferPool()
    cycle: list[object] = [pool.take(SIZE)]
    cycle.append(cycle)
    del cycle
    gc.collect()
    assert pool.idle_bytes == SIZE


def test_a_buffer_can_come_back_while_its_pool_is_locked_on_the_same_thread() -> None:
    """The garbage collector can drop the last reference at any allocation, also inside the
    pool's own locked section; that must not deadlock."""
    pool = BufferPool()
    lent = [pool.take(SIZE)]

    def drop_under_the_lock() -> None:
        with pool._lock:
            lent.clear()

    thread = threading.Thread(target=drop_under_the_lock, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "deadlock: the buffer came back under the held lock"
    assert pool.idle_bytes == SIZE


@pytest.mark.parametrize(("max_bytes", "size"), [(-1, 0), (0, -1)])
def test_bad_arguments(max_bytes: int, size: int) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        BufferPool(max_bytes).take(size)


def test_empty_buffer() -> None:
    pool = BufferPool()
    assert len(pool.take(0)) == 0


def test_buffers_dropped_on_other_threads_are_never_lent_twice() -> None:
    """Threads take buffers, fill them with their own mark, hold some a while and drop them
    (so buffers come back on every thread); a buffer lent twice at once shows as a changed
    mark."""
    pool = BufferPool(max_bytes=8 * SIZE)
    failures: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[memoryview, bytes]] = []
        for step in range(400):
            view = pool.take(rng.choice((SIZE, 2 * SIZE)))
            mark = bytes([seed]) + step.to_bytes(2, "big")
            view[:3] = mark
            view[-3:] = mark
            held.append((view, mark))
            if len(held) > rng.randrange(1, 6):
                old, old_mark = held.pop(rng.randrange(len(held)))
                if bytes(old[:3]) != old_mark or bytes(old[-3:]) != old_mark:
                    failures.append(f"thread {seed} step {step}")
                del old

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert pool.reused > 0 and pool.idle_bytes <= 8 * SIZE
