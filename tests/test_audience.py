"""Audience-bound credentials (:mod:`kvsp.audience`, DESIGN.md §3): what a holder, relay or
instance receives opens nothing at the IS or PC, nor at another holder; a record's
``lease_base`` stays on its holder's origin (spec §4.4, §6.6)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kvsp.audience import (
    audience_credential,
    canonical_origin,
    credential_for_key,
    lease_base_allowed,
    same_origin,
)
from kvsp.errors import BadAudience, RecordError, Unauthorized, UnvouchedOrigin
from kvsp.moqt_mapping import encode_moqt_namespace
from kvsp.records import ReplicaRecord
from kvsp.transfer.block_client import lease_base
from kvsp.web.auth import Principals, principal_entry

HOLDER = "http://127.0.0.1:8471/"
OTHER_HOLDER = "http://127.0.0.1:8472/"
ALICE = "audience-test-alice-token-0123456789abcdef"
BOB = "audience-test-bob-token-0123456789abcdef"
LATE = "audience-test-late-token-0123456789abcdef"
NOW = 1_000_000


def principals() -> Principals:
    return Principals.from_entries(
        [
            principal_entry("alice", ALICE, ["instance"], None),
            principal_entry("bob", BOB, ["holder"], None),
            principal_entry("late", LATE, ["client"], None, expires_ms=NOW),
        ]
    )


def bearer(value: str) -> str:
    return f"Bearer {value}"


@pytest.mark.parametrize(
    ("uri", "origin"),
    [
        ("HTTP://Example.COM:80/kvsp/", "http://example.com"),
        ("https://h.example:443", "https://h.example"),
        ("https://h.example:8443/x?y", "https://h.example:8443"),
        ("moqt://Relay.example:443/kvsp", "moqt://relay.example"),
        ("moqt://127.0.0.1:4443/", "moqt://127.0.0.1:4443"),
        ("moqt+tls://127.0.0.1:4444/", "moqt+tls://127.0.0.1:4444"),
        ("moqt+unix://localhost/run/r.sock", "moqt+unix://localhost/run/r.sock"),
        ("http://[::1]:9/", "http://[::1]:9"),
    ],
)
def test_the_audience_is_the_canonical_origin(uri: str, origin: str) -> None:
    assert canonical_origin(uri) == origin
    assert canonical_origin(origin) == origin


@pytest.mark.parametrize("uri", ["ftp://h.example/", "http:///x", "http://h:99999/", "not a uri"])
def test_a_uri_without_an_origin_has_no_audience(uri: str) -> None:
    with pytest.raises(BadAudience):
        canonical_origin(uri)
    assert not same_origin(uri, uri)


def test_a_credential_is_accepted_where_it_is_bound_only() -> None:
    found = principals()
    own = frozenset({canonical_origin(HOLDER)})
    credential = bearer(audience_credential(ALICE, HOLDER))
    assert credential.startswith("Bearer kvsp-aud1.") and ALICE not in credential
    # the same credential from any path or spelling of the holder's URI
    assert credential == bearer(audience_credential(ALICE, "HTTP://127.0.0.1:8471/blocks/x"))
    assert found.authenticate(credential, NOW, own).name == "alice"
    # the raw token still works everywhere (curl users), the credential nowhere else
    assert found.authenticate(bearer(ALICE), NOW, own).name == "alice"
    assert found.authenticate(bearer(ALICE), NOW).name == "alice"


@pytest.mark.parametrize(
    "where",
    [
        "control plane",  # the IS and PC take tokens only
        "other holder",
        "same host, other port",
        "other scheme",
    ],
)
def test_a_credential_for_another_audience_is_refused(where: str) -> None:
    audiences = {
        "control plane": frozenset(),
        "other holder": frozenset({canonical_origin(OTHER_HOLDER)}),
        "same host, other port": frozenset({"http://127.0.0.1:8470"}),
        "other scheme": frozenset({"https://127.0.0.1:8471"}),
    }[where]
    credential = bearer(audience_credential(ALICE, HOLDER))
    with pytest.raises(Unauthorized, match="unknown token"):
        principals().authenticate(credential, NOW, audiences)


def test_a_credential_cannot_name_another_principal() -> None:
    """Alice's MAC under Bob's key id, or a MAC under a key no principal has, opens nothing."""
    own = frozenset({canonical_origin(HOLDER)})
    alice = audience_credential(ALICE, HOLDER)
    bob = audience_credential(BOB, HOLDER)
    _, alice_kid, alice_mac = alice.split(".")
    _, bob_kid, _ = bob.split(".")
    forged = f"kvsp-aud1.{bob_kid}.{alice_mac}"
    stranger = credential_for_key(hashlib.sha256(b"nobody").digest(), HOLDER)
    found = principals()
    assert found.authenticate(bearer(bob), NOW, own).name == "bob"
    for value in (forged, stranger):
        with pytest.raises(Unauthorized):
            found.authenticate(bearer(value), NOW, own)


@pytest.mark.parametrize(
    "garbled",
    [
        "kvsp-aud1.",
        "kvsp-aud1..",
        "kvsp-aud1.0011.abc",
        "kvsp-aud1.{kid}.",
        "kvsp-aud1.{kid}.{mac}.x",
        "kvsp-aud1.{kid}.{mac}=",
        "kvsp-aud1.{kid}.{short}",
        "kvsp-aud1.{kid}",
    ],
)
def test_a_garbled_credential_is_refused(garbled: str) -> None:
    own = frozenset({canonical_origin(HOLDER)})
    _, kid, mac = audience_credential(ALICE, HOLDER).split(".")
    value = garbled.format(kid=kid, mac=mac, short=mac[:-2])
    with pytest.raises(Unauthorized):
        principals().authenticate(bearer(value), NOW, own)


def test_an_expired_principal_has_no_credential_either() -> None:
    own = frozenset({canonical_origin(HOLDER)})
    credential = bearer(audience_credential(LATE, HOLDER))
    assert principals().authenticate(credential, NOW - 1, own).name == "late"
    with pytest.raises(Unauthorized, match="expired"):
        principals().authenticate(credential, NOW, own)


def test_bound_principals_take_their_audiences_when_they_are_known() -> None:
    known: list[str] = []
    bound = principals().with_audiences(lambda: frozenset(canonical_origin(u) for u in known))
    credential = bearer(audience_credential(ALICE, HOLDER))
    with pytest.raises(Unauthorized):
        bound.authenticate(credential, NOW)
    known.append(HOLDER)  # the service learns its URL once it listens
    assert bound.authenticate(credential, NOW).name == "alice"


# --- lease_base: the holder's origin only ------------------------------------------------------


def replica(holder: str, lease: str | None) -> dict[str, Any]:
    digests = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(2)]
    obj: dict[str, Any] = {
        "block_key": "ab" * 32,
        "compat_id": "cd" * 32,
        "scope_id": "ef" * 16,
        "holder": holder,
        "codec": 1,
        "size": 1024,
        "digest": "sha-256:"
        + hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest(),
        "layer_digests": digests,
        "ttl_ms": 60_000,
    }
    if holder.startswith("moqt://"):
        fields = (b"kvsp", b"1", b"cd" * 32, b"ef" * 16, b"ab" * 32)
        obj["moqt_namespace"] = encode_moqt_namespace(fields)
    if lease is not None:
        obj["lease_base"] = lease
    return obj


@pytest.mark.parametrize(
    ("holder", "lease", "allowed"),
    [
        (HOLDER, HOLDER, True),
        (HOLDER, "http://127.0.0.1:8471/leases-here/", True),
        (HOLDER, "HTTP://127.0.0.1:8471/", True),
        (HOLDER, "http://127.0.0.1:9999/", False),  # another port: another server
        (HOLDER, "https://127.0.0.1:8471/", False),
        (HOLDER, "http://capture.example/", False),
        ("moqt://relay.example:4443/", "http://relay.example:8080/", True),  # a relay's face
        ("moqt://relay.example:4443/", "http://capture.example:8080/", False),
    ],
)
def test_lease_base_stays_on_the_holder_origin(holder: str, lease: str, allowed: bool) -> None:
    assert lease_base_allowed(holder, lease) is allowed
    if allowed:
        assert ReplicaRecord.from_json(replica(holder, lease)).lease_base == lease
        return
    with pytest.raises(RecordError) as caught:
        ReplicaRecord.from_json(replica(holder, lease))
    assert caught.value.path == "$.lease_base"


def test_a_client_refuses_a_record_that_slipped_past_the_index() -> None:
    """A record built without :meth:`ReplicaRecord.from_json` (a store, a peer) is checked
    again where credentials would be sent."""
    good = ReplicaRecord.from_json(replica(HOLDER, None))
    forced = good.__class__(
        **{**{f: getattr(good, f) for f in good.__slots__}, "lease_base": "http://capture.example/"}
    )
    assert lease_base(good) == HOLDER
    with pytest.raises(UnvouchedOrigin) as caught:
        lease_base(forced)
    assert caught.value.path == "$.lease_base"
