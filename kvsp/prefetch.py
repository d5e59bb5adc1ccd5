"""Prefetch directives at the instance (spec §6.5): the directive state machine.

:class:`~kvsp.registries.DirectiveState` lives in the registries module; its transition table
is here, with what causes each move:

========== ========== ================================================================
from       to         when
========== ========== ================================================================
pending    pending    progress: the next block of the prefix was loaded
pending    complete   every block of the directive is loaded
pending    partial    the deadline passed, or a block failed at every source, after at
                      least one block was loaded ("the request is then served with the
                      loaded prefix and the remaining tokens are recomputed")
pending    failed     the same, with nothing loaded
========== ========== ================================================================

partial, complete and failed are final. Loaded keys are reported in prefix order and only as
a prefix: because Block Keys are chained (§4.2), a block is useless without every block before
it, so the first block that cannot be loaded ends the prefix. The module is sans-I/O: the
instance's shell runs the transfers and feeds the outcomes in with ``now_ms``, and the
transfers' timings into :class:`LinkMeter`, which turns them into the §4.4 ``links``.

A directive may name the instance's own edge relay as a source of a block the relay does not
hold yet (the PC does so when the instance can reach none of the block's holders,
:mod:`kvsp.placement`): the IS then has no record of the relay's copy, and
:func:`through_relay` derives the one the instance fetches with from another holder's record of
the same block (the relay passes the FETCH to whoever announced the scope, DESIGN §4).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Final

from kvsp.errors import Conflict, IllegalTransition, NotFound
from kvsp.ids import BlockKey
from kvsp.moqt_mapping import encode_namespace_octets, kv_namespace
from kvsp.records import DirectiveStatus, Link, PrefetchDirective, ReplicaRecord
from kvsp.registries import Codec, DirectiveState

TRANSITIONS: Final[Mapping[tuple[DirectiveState, DirectiveState], str]] = {
    (DirectiveState.PENDING, DirectiveState.PENDING): "progress",
    (DirectiveState.PENDING, DirectiveState.COMPLETE): "all blocks loaded",
    (DirectiveState.PENDING, DirectiveState.PARTIAL): "stopped with a loaded prefix",
    (DirectiveState.PENDING, DirectiveState.FAILED): "stopped with nothing loaded",
}
"""(from, to) → why the move happens (§6.5); any pair not listed is illegal."""

FINAL_STATES: Final = frozenset(
    {DirectiveState.PARTIAL, DirectiveState.COMPLETE, DirectiveState.FAILED}
)


def check_transition(src: DirectiveState, dst: DirectiveState) -> None:
    """Allow ``src → dst`` only if the table has it.

    Raises:
        IllegalTransition: the table has no such move (409 kvsp-conflict).
    """
    if (src, dst) not in TRANSITIONS:
        raise IllegalTransition(f"directive state {src} -> {dst} is not allowed")


class DirectiveProgress:
    """One directive's state and loaded prefix (§6.5); pure, ``now_ms`` passed in.

    The deadline is ``deadline_ms`` after the directive was received.
    """

    __slots__ = ("_loaded", "deadline_at_ms", "detail", "directive", "keys", "state")

    def __init__(self, directive: PrefetchDirective, received_ms: int) -> None:
        self.directive = directive
        self.keys: tuple[BlockKey, ...] = tuple(b.block_key for b in directive.blocks)
        self.deadline_at_ms = received_ms + directive.deadline_ms
        self.state = DirectiveState.PENDING
        self.detail: str | None = None
        self._loaded: list[BlockKey] = []

    @property
    def loaded(self) -> tuple[BlockKey, ...]:
        """The keys loaded so far, in prefix order."""
        return tuple(self._loaded)

    @property
    def next_index(self) -> int:
        """The index of the block the prefix needs next."""
        return len(self._loaded)

    @property
    def final(self) -> bool:
        """Whether the directive has stopped (partial, complete or failed)."""
        return self.state in FINAL_STATES

    def still_to_load(self, key: BlockKey) -> bool:
        """Whether the directive is pending and lists ``key`` after its loaded prefix."""
        if self.state is not DirectiveState.PENDING:
            return False
        try:
            self.keys.index(key, self.next_index)
        except ValueError:
            return False
        return True

    def remaining_ms(self, now_ms: int) -> int:
        """Milliseconds left before the deadline (0 once it passed)."""
        return max(0, self.deadline_at_ms - now_ms)

    def _move(self, dst: DirectiveState, detail: str | None = None) -> DirectiveState:
        check_transition(self.state, dst)
        self.state = dst
        if detail is not None:
            self.detail = detail
        return dst

    def _stop(self, detail: str) -> DirectiveState:
        return self._move(DirectiveState.PARTIAL if self._loaded else DirectiveState.FAILED, detail)

    def block_loaded(self, key: BlockKey) -> DirectiveState:
        """The next block of the prefix is held; returns the new state.

        Raises:
            IllegalTransition: the directive has stopped, or ``key`` is not the next block of
                the prefix.
        """
        if self.state is not DirectiveState.PENDING:
            raise IllegalTransition(f"directive is {self.state}; no further blocks load")
        if self.next_index >= len(self.keys) or self.keys[self.next_index] != key:
            raise IllegalTransition("blocks are loaded in prefix order")
        self._loaded.append(key)
        done = len(self._loaded) == len(self.keys)
        return self._move(DirectiveState.COMPLETE if done else DirectiveState.PENDING)

    def block_failed(self, key: BlockKey, reason: str) -> DirectiveState:
        """The next block could not be loaded from any source: the prefix ends here.

        Raises:
            IllegalTransition: the directive has stopped, or ``key`` is not the next block.
        """
        if self.state is not DirectiveState.PENDING:
            raise IllegalTransition(f"directive is {self.state}; no further blocks load")
        if self.next_index >= len(self.keys) or self.keys[self.next_index] != key:
            raise IllegalTransition("blocks fail in prefix order")
        return self._stop(f"block {self.next_index} unavailable: {reason}")

    def expire(self, now_ms: int) -> bool:
        """Stop the directive if its deadline has passed at ``now_ms``; whether it did.

        A directive that already stopped is left alone (returns ``False``).
        """
        if self.state is not DirectiveState.PENDING or now_ms < self.deadline_at_ms:
            return False
        self._stop(f"deadline passed after {len(self._loaded)} of {len(self.keys)} blocks")
        return True

    def abort(self, reason: str) -> None:
        """Stop a pending directive for a reason other than its blocks (shutdown)."""
        if self.state is DirectiveState.PENDING:
            self._stop(reason)

    def status(self) -> DirectiveStatus:
        """The body of GET prefetch/{directive} (§6.5)."""
        return DirectiveStatus(
            directive=self.directive.directive,
            state=self.state,
            loaded=tuple(self._loaded),
            detail=self.detail,
        )


class DirectiveBook:
    """The directives an instance knows, by id, keeping at most ``keep`` that have stopped."""

    __slots__ = ("_by_id", "_forgotten", "keep")

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._by_id: OrderedDict[uuid.UUID, DirectiveProgress] = OrderedDict()
        self._forgotten: dict[DirectiveState, int] = {}  # final states of pruned directives

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, directive: PrefetchDirective, now_ms: int) -> tuple[DirectiveProgress, bool]:
        """Record a directive; returns its progress and whether it is new.

        The same directive sent again (same id and body) is the same directive: POST prefetch
        is idempotent.

        Raises:
            Conflict: a directive with this id but another body is known.
        """
        known = self._by_id.get(directive.directive)
        if known is not None:
            if known.directive != directive:
                raise Conflict(f"directive {directive.directive} was sent with another body")
            return known, False
        progress = DirectiveProgress(directive, now_ms)
        self._by_id[directive.directive] = progress
        self._prune()
        return progress, True

    def get(self, directive: uuid.UUID) -> DirectiveProgress:
        """The progress of a known directive.

        Raises:
            NotFound: no such directive (never received, or forgotten long after it stopped).
        """
        progress = self._by_id.get(directive)
        if progress is None:
            raise NotFound(f"no directive {directive}")
        return progress

    def pending(self) -> list[DirectiveProgress]:
        """The directives still loading."""
        return [p for p in self._by_id.values() if not p.final]

    def outcome_counts(self) -> dict[DirectiveState, int]:
        """How many directives are in each state, counting forgotten ones by their final
        state: since start, for operations metrics."""
        counts = dict(self._forgotten)
        for progress in self._by_id.values():
            counts[progress.state] = counts.get(progress.state, 0) + 1
        return counts

    def _prune(self) -> None:
        stopped = [d for d, p in self._by_id.items() if p.final]
        for directive in stopped[: max(0, len(stopped) - self.keep)]:
            state = self._by_id.pop(directive).state
            self._forgotten[state] = self._forgotten.get(state, 0) + 1


class LinkMeter:
    """Measured links to source holders (§4.4 ``links``): only holders actually observed."""

    def __init__(self, window: int = 16) -> None:
        self.window = window
        self._rtt: dict[str, deque[float]] = {}
        self._transfers: dict[str, deque[tuple[int, float]]] = {}

    def record_rtt(self, holder: str, seconds: float) -> None:
        """A request/answer round trip to ``holder`` (time to the first byte of the answer)."""
        self._rtt.setdefault(holder, deque(maxlen=self.window)).append(seconds)

    def record_transfer(self, holder: str, octets: int, seconds: float) -> None:
        """A verified block of ``octets`` received from ``holder`` in ``seconds``."""
        self._transfers.setdefault(holder, deque(maxlen=self.window)).append((octets, seconds))

    def links(self) -> tuple[Link, ...]:
        """One link per holder with both a transfer and a round trip observed."""
        out = []
        for holder, transfers in sorted(self._transfers.items()):
            octets = sum(o for o, _ in transfers)
            seconds = sum(s for _, s in transfers)
            rtts = self._rtt.get(holder)
            if octets > 0 and seconds > 0 and rtts:
                rate = 8 * octets / seconds / 1e6
                out.append(Link(holder=holder, mbit_per_s=rate, rtt_us=min(rtts) * 1e6))
        return tuple(out)


def through_relay(template: ReplicaRecord, relay: str) -> ReplicaRecord | None:
    """The record of ``template``'s block as the ``moqt://`` ``relay`` serves it when it does
    not hold it: the same octets and digests, the relay as holder, the block's namespace
    (DESIGN §4), no lease base (the relay cannot lease what it does not hold: the copy is
    fetched unleased, and a miss is a miss as §6.1 allows). ``None`` when the block cannot
    travel over MOQT (a codec other than raw, or no layer digests to check it with).
    """
    if template.codec != Codec.RAW or template.layer_digests is None:
        return None
    if relay[:7].lower() != "moqt://":
        return None
    fields = kv_namespace(template.compat_id, template.scope_id, template.block_key)
    return dataclasses.replace(
        template,
        holder=relay,
        residency=None,
        moqt_namespace=encode_namespace_octets(fields),
        lease_base=None,
        moqt_carriers=None,
        site=None,
        zone=None,
    )
