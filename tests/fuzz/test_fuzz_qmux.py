"""Garbage in, CONNECTION_CLOSE out: a MOQT session over QMux (draft-ietf-quic-qmux-01 §3.2
records, §4 frames, §6 termination; RFC 9000 §20.1 codes) fed what a client sends, mutated.

``targets.qmux_target``: no exception escapes the connection or its session; the connection
alone ends with the same code and hands each stream the same octets whether the input comes
whole, an octet at a time or in uneven chunks; with the session answering after each piece it
ends at most once and sends nothing after its CONNECTION_CLOSE.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.support.fuzz_strategies import mutated, targets

SEEDS = targets.qmux_seeds()


def test_the_seeds_run_a_whole_session() -> None:
    for seed in SEEDS:
        targets.qmux_target(seed)
    closed, streams = targets.qmux_carried(SEEDS[0], "whole")
    assert closed is None and len(streams) == 3, streams.keys()  # both kinds of stream came


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(SEEDS))
def test_mutated_sessions_end_with_connection_close_however_they_are_cut(data: bytes) -> None:
    targets.qmux_target(data)


@pytest.mark.parametrize("end", range(0, 1600, 37))
def test_every_truncation_of_the_session_is_taken_alike(end: int) -> None:
    targets.qmux_target(SEEDS[0][:end])
