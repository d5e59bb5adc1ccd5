"""In-process parts of the operator commands (:mod:`kvsp.ops_cli`): naming an instance by URL
or id, and the source each block of a ``kvsp prefetch`` directive is loaded from (§6.5)."""

from __future__ import annotations

import argparse
import hashlib

import pytest

from kvsp.cli import main
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.ops_cli import choose_sources, instance_ref
from kvsp.records import InstanceStatusRecord, Link, ReplicaRecord
from kvsp.registries import InstanceState

SELF = "http://instance.example/"
FAST = "http://fast.example/"
SLOW = "http://slow.example/"
UNMEASURED = "http://unmeasured.example/"


def record(holder: str, n: int = 0) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=BlockKey(hashlib.sha256(b"%d" % n).digest()),
        compat_id=CompatId(b"\x01" * 32),
        scope_id=ScopeId(b"\x02" * 16),
        holder=holder,
        codec=1,
        size=4096,
        digest=b"\x03" * 32,
        layer_digests=None,
        residency=None,
        ttl_ms=60_000,
    )


def status(*links: Link) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=SELF,
        epoch=1,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.0,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
        links=links,
        requested_state=None,
        ttl_ms=5000,
    )


def test_an_instance_is_named_by_url_or_hex_id() -> None:
    assert instance_ref("http://a.example:1/") == "http://a.example:1/"
    assert instance_ref("AB" * 16) == "ab" * 16
    for bad in ("ab" * 15, "zz" * 16, "a.example", "moqt://a.example/"):
        with pytest.raises(argparse.ArgumentTypeError):
            instance_ref(bad)


def test_sources_follow_measured_links_and_skip_what_the_instance_holds() -> None:
    links = (
        Link(holder=SLOW, mbit_per_s=100.0, rtt_us=10.0),
        Link(holder=FAST, mbit_per_s=10_000.0, rtt_us=500.0),
    )
    found = [
        (record(SLOW), record(FAST)),  # the faster measured link wins
        (record(UNMEASURED), record(SLOW)),  # measured before unmeasured
        (record(FAST), record(SELF)),  # already there: nothing to load
        (record(UNMEASURED),),  # the only one
    ]
    assert choose_sources(SELF, status(*links), found) == [FAST, SLOW, None, UNMEASURED]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["instance", "drain", "nothex", "--pc", "http://pc/", "--token-file", "t"])
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        main(["prefetch", "--pc", "http://pc/", "--token-file", "t", "--instance", "ab" * 16])
    assert exited.value.code == 2  # no prompt, no scope key, no descriptor
    assert "Traceback" not in capsys.readouterr().err


def test_an_unreadable_token_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["instance", "list", "--pc", "http://127.0.0.1:9/", "--token-file", "/nonexistent"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvsp: error: cannot read --token-file /nonexistent: No such file or directory"]
