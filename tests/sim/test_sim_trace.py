"""Trace loading and the hash-id to Block Key mapping (kvsp/sim/trace.py, spec §4.2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsp.errors import KVSPError
from kvsp.keys import block_keys
from kvsp.sim.config import ClusterConfig
from kvsp.sim.replicas import SCOPE_KEY, ClusterIndex
from kvsp.sim.trace import KeyMapper, TraceError, load_trace, parse_trace, to_requests

B = 512
COMPAT = ClusterIndex(ClusterConfig()).compat_id


@pytest.fixture(scope="module")
def mapper() -> KeyMapper:
    return KeyMapper(SCOPE_KEY, COMPAT, B)


def _line(ts: float = 0, length: int = 3 * B, ids: object = (1, 2, 3), out: int = 5) -> str:
    ids = list(ids) if isinstance(ids, tuple) else ids
    return json.dumps(
        {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}
    )


def test_equal_hash_id_prefixes_give_equal_keys(mapper: KeyMapper) -> None:
    a = mapper.keys([7, 8, 9, 10], 4)
    b = mapper.keys([7, 8, 9, 11], 4)
    assert a[:3] == b[:3] and a[3] != b[3]
    # The same hash id after a different prefix is a different block (chained keys).
    c = mapper.keys([6, 8, 9], 3)
    assert c[0] != a[0] and c[1] != a[1] and c[2] != a[2]


def test_keys_are_the_real_chain_over_the_synthetic_tokens(mapper: KeyMapper) -> None:
    ids = [3, 1, 4, 1, 5]
    expected = block_keys(SCOPE_KEY, COMPAT, mapper.tokens(ids), B)
    assert list(mapper.keys(ids, 5)) == expected
    # A memoized prefix continues the chain without changing it.
    assert list(mapper.keys([3, 1, 4, 1, 5, 9], 6))[:5] == expected


def test_only_complete_blocks_have_keys(mapper: KeyMapper) -> None:
    trace = parse_trace([_line(length=2 * B + 100, ids=(1, 2, 3))], B)
    (request,) = to_requests(trace, mapper, B)
    assert len(request.keys) == 2 and request.input_tokens == 2 * B + 100


def test_arrivals_are_relative_microseconds(mapper: KeyMapper) -> None:
    trace = parse_trace([_line(ts=1000), "", _line(ts=1500)], B)
    assert [r.arrival_us for r in to_requests(trace, mapper, B)] == [0.0, 500_000.0]


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "JSON object"),
        (_line(ts=-1), "timestamp"),
        (_line(ts=True), "timestamp"),
        (_line(length=0), "input_length"),
        (_line(out=-1), "output_length"),
        (_line(ids="1,2,3"), "hash_ids"),
        (_line(ids=(1, -2, 3)), "hash_ids"),
        (_line(ids=(1, 2.0, 3)), "hash_ids"),
        (_line(ids=(1, 2)), "2 ids for 3 complete blocks"),
        (_line(ts=0.5), "goes back"),
    ],
)
def test_bad_lines_raise_with_their_number(bad: str, words: str) -> None:
    lines = [_line(ts=1), "   ", bad]
    with pytest.raises(TraceError) as info:
        parse_trace(lines, B)
    assert isinstance(info.value, KVSPError)
    assert info.value.line == 3 and "line 3" in str(info.value) and words in str(info.value)


def test_load_trace_reads_files_and_reports_missing_ones(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line() + "\n" + _line(ts=2) + "\n", encoding="utf-8")
    assert [r.line for r in load_trace(path, B)] == [1, 2]
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl", B)
