"""§6.5 prefetch directives at the instance: the state table, the loaded prefix, the deadline,
and the book of directives (idempotent re-sends)."""

from __future__ import annotations

import itertools
import uuid

import pytest

from kvsp.errors import Conflict, IllegalTransition, NotFound
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.prefetch import (
    FINAL_STATES,
    TRANSITIONS,
    DirectiveBook,
    DirectiveProgress,
    check_transition,
)
from kvsp.records import DirectiveBlock, PrefetchDirective
from kvsp.registries import DirectiveState

P, PA, C, F = (
    DirectiveState.PENDING,
    DirectiveState.PARTIAL,
    DirectiveState.COMPLETE,
    DirectiveState.FAILED,
)
ALLOWED = {(P, P), (P, PA), (P, C), (P, F)}


def key(n: int) -> BlockKey:
    return BlockKey(bytes([n]) * 32)


def directive(count: int = 3, deadline_ms: int = 50, ident: int = 1) -> PrefetchDirective:
    return PrefetchDirective(
        directive=uuid.UUID(int=ident, version=4),
        request_ref="r",
        scope_id=ScopeId(b"\x0a" * 16),
        compat_id=CompatId(b"\x0c" * 32),
        blocks=tuple(
            DirectiveBlock(block_key=key(i), sources=("http://h1.test/",)) for i in range(count)
        ),
        deadline_ms=deadline_ms,
        lease_ms=2000,
    )


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(DirectiveState, repeat=2)))
def test_every_pair_is_allowed_or_illegal(src: DirectiveState, dst: DirectiveState) -> None:
    if (src, dst) in ALLOWED:
        check_transition(src, dst)
        assert (src, dst) in TRANSITIONS
    else:
        with pytest.raises(IllegalTransition) as caught:
            check_transition(src, dst)
        assert caught.value.status == 409
        assert caught.value.problem == "kvsp-conflict"


def test_table_is_exactly_the_spec_moves() -> None:
    assert set(TRANSITIONS) == ALLOWED
    assert frozenset({PA, C, F}) == FINAL_STATES


def test_loading_every_block_completes_in_prefix_order() -> None:
    progress = DirectiveProgress(directive(3), received_ms=1000)
    assert progress.state is P and progress.loaded == ()
    assert progress.block_loaded(key(0)) is P
    assert progress.block_loaded(key(1)) is P
    assert progress.block_loaded(key(2)) is C
    status = progress.status()
    assert status.state is C
    assert status.loaded == (key(0), key(1), key(2))
    assert progress.final


def test_a_block_is_still_to_load_while_pending_and_after_the_prefix() -> None:
    progress = DirectiveProgress(directive(3), received_ms=0)
    assert [progress.still_to_load(key(i)) for i in range(4)] == [True, True, True, False]
    progress.block_loaded(key(0))
    assert [progress.still_to_load(key(i)) for i in range(3)] == [False, True, True]
    progress.block_failed(key(1), "gone")
    assert not any(progress.still_to_load(key(i)) for i in range(3))


def test_out_of_order_block_is_refused_and_changes_nothing() -> None:
    progress = DirectiveProgress(directive(3), received_ms=0)
    with pytest.raises(IllegalTransition):
        progress.block_loaded(key(1))
    with pytest.raises(IllegalTransition):
        progress.block_failed(key(2), "gone")
    assert progress.state is P and progress.loaded == ()


def test_a_failed_block_ends_the_prefix_partial() -> None:
    progress = DirectiveProgress(directive(3), received_ms=0)
    progress.block_loaded(key(0))
    assert progress.block_failed(key(1), "404 everywhere") is PA
    assert progress.loaded == (key(0),)
    assert progress.detail is not None and "block 1" in progress.detail
    with pytest.raises(IllegalTransition):
        progress.block_loaded(key(1))  # final: nothing moves any more
    assert progress.state is PA


def test_a_failed_first_block_fails_the_directive() -> None:
    progress = DirectiveProgress(directive(2), received_ms=0)
    assert progress.block_failed(key(0), "no source") is F
    assert progress.status().loaded == ()


def test_deadline_gives_partial_with_the_loaded_prefix() -> None:
    progress = DirectiveProgress(directive(4, deadline_ms=50), received_ms=1000)
    assert progress.remaining_ms(1000) == 50
    progress.block_loaded(key(0))
    progress.block_loaded(key(1))
    assert not progress.expire(1049)
    assert progress.expire(1050)
    assert progress.state is PA
    assert progress.loaded == (key(0), key(1))
    assert progress.remaining_ms(2000) == 0
    assert not progress.expire(5000)  # already stopped


def test_deadline_with_nothing_loaded_fails() -> None:
    progress = DirectiveProgress(directive(2, deadline_ms=0), received_ms=10)
    assert progress.expire(10)
    assert progress.state is F


def test_abort_stops_only_pending_directives() -> None:
    progress = DirectiveProgress(directive(1), received_ms=0)
    progress.block_loaded(key(0))
    progress.abort("shutdown")
    assert progress.state is C
    other = DirectiveProgress(directive(2), received_ms=0)
    other.abort("shutdown")
    assert other.state is F and other.detail == "shutdown"


def test_book_is_idempotent_and_refuses_another_body() -> None:
    book = DirectiveBook()
    first, new = book.add(directive(3), now_ms=0)
    again, new_again = book.add(directive(3), now_ms=99)
    assert new and not new_again and again is first
    assert first.deadline_at_ms == 50  # the first receipt set the deadline
    with pytest.raises(Conflict):
        book.add(directive(2), now_ms=0)
    assert book.get(directive(3).directive) is first
    with pytest.raises(NotFound):
        book.get(uuid.UUID(int=99, version=4))
    assert book.pending() == [first]


def test_book_forgets_the_oldest_stopped_directives() -> None:
    book = DirectiveBook(keep=2)
    for i in range(1, 5):
        progress, _ = book.add(directive(1, ident=i), now_ms=0)
        progress.block_failed(key(0), "x")
    running, _ = book.add(directive(1, ident=9), now_ms=0)
    assert len(book) == 3  # two stopped kept, the pending one never dropped
    with pytest.raises(NotFound):
        book.get(directive(1, ident=1).directive)
    assert book.get(directive(1, ident=9).directive) is running
