"""The relay's deadline heaps (:mod:`relay.deadlines`): what comes due is what its owner still
counts, whatever compaction dropped, and the heap stays proportional to the live keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import deadlines
from relay.deadlines import Deadlines

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 5), st.integers(0, 100)),
        st.tuples(st.just("forget"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("tick"), st.just(0), st.integers(0, 30)),
        st.tuples(st.just("compact"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_what_comes_due_is_what_the_owner_still_counts(ops: list[tuple[str, int, int]]) -> None:
    """An owner as the cache is one: it sets and moves a key's deadline (pushing each one),
    forgets keys, and at each tick takes the entries due whose deadline is the key's current
    one. With compaction after every few pushes, and on demand, each tick names exactly the
    keys a scan of the owner's state names."""
    current: dict[int, int] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadlines, "COMPACT_FLOOR", 3)
        heap: Deadlines[int] = Deadlines(current.get)
    now = 0
    for op, key, value in ops:
        if op == "set":
            current[key] = now + value
            heap.push(now + value, key)
        elif op == "forget":
            current.pop(key, None)
        elif op == "compact":
            heap.compact()
        else:
            now += value
            came = {k for deadline, k in heap.pop_due(now) if current.get(k) == deadline}
            expected = {k for k, deadline in current.items() if deadline <= now}
            assert came == expected
            for k in came:
                del current[k]
        assert len(heap) <= 2 * 6  # twice the keys there are, however many pushes


def test_an_entry_queued_again_when_due_outlives_compaction() -> None:
    """The holder queues what came due again at the time it came (until it acts on it): such
    an entry is later than the key's deadline and must survive compaction; an entry earlier
    than the key's deadline (the deadline moved on) must not."""
    due = {"a": 10, "b": 50}
    heap: Deadlines[str] = Deadlines(due.get)
    heap.push(10, "a")
    heap.push(20, "b")  # then b's deadline moved on to 50
    heap.push(50, "b")
    assert [key for _, key in heap.pop_due(15)] == ["a"]
    heap.push(15, "a")  # named again at 15
    heap.compact()
    assert len(heap) == 2
    assert list(heap.pop_due(100)) == [(15, "a"), (50, "b")]
    assert not heap
