"""Site labels on records and command lines (spec §4.4 extension members): ``site``/``zone``
on the Instance Status Record and Replica Records, ``relay`` on the status record, strict
parsing, absent when unset; ``--site``/``--zone`` on instance, holder and relay; and the
record an instance fetches its relay's copy of a block by (kvsp.prefetch.through_relay)."""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from kvsp.cli import build_parser
from kvsp.errors import BadRequest, RecordError
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import kv_namespace
from kvsp.prefetch import through_relay
from kvsp.records import InstanceStatusRecord, Link, ReplicaRecord, Residency
from kvsp.registries import Codec, InstanceState, Tier
from kvsp.services.holder.app import holder_config
from kvsp.services.instance.app import instance_config
from kvsp.stores.redis_records import decode_record, encode_record
from kvsp.transfer.moqt_transfer import record_namespace
from kvsp.web.sites import site_labels

RELAY = "moqt://relay.example:4443/"
DIGESTS = tuple(hashlib.sha256(b"layer %d" % n).digest() for n in range(4))


def status(**members: object) -> dict[str, object]:
    record = InstanceStatusRecord(
        instance="https://ii.example/kvsp/",
        epoch=5,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=4,
        kv_utilization=0.25,
        prefill_tokens_per_s=100.0,
        decode_tokens_per_s=10.0,
        links=(Link(holder="https://h.example/kvsp/", mbit_per_s=10.0, rtt_us=5.0),),
        requested_state=None,
        ttl_ms=3000,
    )
    return {**record.to_json(), **members}


def replica(codec: int = Codec.RAW.value, digests: bool = True) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=BlockKey(b"\x07" * 32),
        compat_id=CompatId(b"\x01" * 32),
        scope_id=ScopeId(b"\x02" * 16),
        holder="https://central.example/kvsp/",
        codec=codec,
        size=4096,
        digest=hashlib.sha256(b"".join(DIGESTS)).digest(),
        layer_digests=DIGESTS if digests else None,
        residency=(Residency(tier=Tier.HOST, first=0, last=3),),
        ttl_ms=60_000,
        lease_base="https://central.example/kvsp/",
        site="central",
        zone="z1",
    )


def test_status_members_round_trip_and_are_absent_when_unset() -> None:
    bare = InstanceStatusRecord.from_json(status())
    assert (bare.site, bare.zone, bare.relay) == (None, None, None)
    assert not {"site", "zone", "relay"} & set(bare.to_json())
    labelled = InstanceStatusRecord.from_json(status(site="edge-1", zone="a", relay=RELAY))
    assert (labelled.site, labelled.zone, labelled.relay) == ("edge-1", "a", RELAY)
    assert InstanceStatusRecord.from_json(labelled.to_json()) == labelled
    carrier = status(relay="moqt+tls://relay.example:4444/")
    assert InstanceStatusRecord.from_json(carrier).relay == "moqt+tls://relay.example:4444/"


@pytest.mark.parametrize(
    ("members", "path"),
    [
        ({"site": "Edge"}, "$.site"),
        ({"site": ""}, "$.site"),
        ({"site": "a" * 64}, "$.site"),
        ({"site": None}, "$.site"),
        ({"zone": "z 1"}, "$.zone"),
        ({"zone": ["a"]}, "$.zone"),
        ({"relay": "https://relay.example/"}, "$.relay"),  # a relay is reached over MOQT
        ({"relay": 1}, "$.relay"),
    ],
)
def test_bad_status_members_name_their_path(members: dict[str, object], path: str) -> None:
    with pytest.raises(RecordError) as caught:
        InstanceStatusRecord.from_json(status(**members))
    assert caught.value.path == path


def test_replica_labels_round_trip() -> None:
    record = replica()
    body = record.to_json()
    assert (body["site"], body["zone"]) == ("central", "z1")
    assert ReplicaRecord.from_json(body) == record
    del body["site"], body["zone"]
    assert ReplicaRecord.from_json(body).site is None
    with pytest.raises(RecordError) as caught:
        ReplicaRecord.from_json({**body, "zone": "Z1"})
    assert caught.value.path == "$.zone"


def test_the_redis_compact_form_keeps_the_labels() -> None:
    # the Redis store keeps records in a compact form; the labels must survive it, or every
    # PC on Redis would place as if no holder had a site
    for record in (
        replica(),
        replace(replica(), zone=None),
        replace(replica(), site=None, zone=None),
        replace(replica(), lease_base=None, residency=None),
    ):
        data = b"pad" + encode_record(record)
        decoded = decode_record(data, 3, record.block_key, record.compat_id, record.scope_id)
        assert decoded == record


def test_the_relay_copy_of_a_block_it_does_not_hold() -> None:
    original = replica()
    derived = through_relay(original, RELAY)
    assert derived is not None
    assert derived.holder == RELAY and derived.lease_base is None
    assert (derived.digest, derived.layer_digests, derived.size) == (
        original.digest,
        original.layer_digests,
        original.size,
    )
    # the namespace names the block itself (DESIGN §4), as a MOQT client checks
    assert record_namespace(derived) == kv_namespace(
        original.compat_id, original.scope_id, original.block_key
    )
    assert ReplicaRecord.from_json(derived.to_json()) == derived  # a valid record
    # not over MOQT: another codec, no layer digests to verify with, or no moqt:// relay
    assert through_relay(replica(codec=Codec.RAW.value + 1), RELAY) is None
    assert through_relay(replica(digests=False), RELAY) is None
    assert through_relay(original, "moqt+tls://relay.example:4444/") is None


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


INSTANCE = ("instance", "--control", "http://127.0.0.1:1/", "--token-file", "t")


def test_site_flags_on_instance_holder_and_relay(tmp_path: Path) -> None:
    args = parse(*INSTANCE, "--site", "edge", "--zone", "rack-2", "--relay", RELAY)
    config = instance_config(args)
    assert (config.site, config.zone, config.relay) == ("edge", "rack-2", RELAY)
    holder = holder_config(parse("holder", "--site", "central", "--state", str(tmp_path)))
    assert (holder.site, holder.zone) == ("central", None)
    relay = parse("relay", "--site", "edge", "--zone", "z")
    assert site_labels(relay).site == "edge" and site_labels(relay).zone == "z"
    unlabelled = instance_config(parse(*INSTANCE))
    assert (unlabelled.site, unlabelled.zone, unlabelled.relay) == (None, None, None)


@pytest.mark.parametrize("service", [INSTANCE, ("holder",), ("relay",)])
def test_a_bad_label_is_refused_on_the_command_line(
    service: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*service, "--site", "Edge_1")
    assert "does not match" in capsys.readouterr().err
    with pytest.raises(BadRequest, match="--zone needs --site"):
        site_labels(parse(*service, "--zone", "a"))
