"""Locality in §6.4 placement and §6.5 directives: site and zone labels, assumed links only
within a site, measured links anywhere, and the instance's edge relay for blocks it can reach
nowhere else (kvsp.placement, kvsp.placement_plan).

Units as in test_placement: 1 Mbit/s = 1 bit/µs, so a 10^6-octet block at r Mbit/s takes
8·10^6/r µs.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest

from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.placement import (
    OTHER_SITE,
    SAME_SITE,
    SAME_ZONE,
    AssumedLink,
    ServiceTimeEstimator,
    SourceView,
    choose_instance,
    estimate_instance,
    locality,
    prepare_fetch,
)
from kvsp.placement_plan import build_directive
from kvsp.records import InstanceStatusRecord, Link, PlaceRequest, ReplicaRecord
from kvsp.registries import InstanceState

CENTRAL_HOLDER = "http://central-holder.example/kvsp/"
CENTRAL_II = "http://central-ii.example/kvsp/"
EDGE_HOLDER = "http://edge-holder.example/kvsp/"
EDGE_II = "http://edge-ii.example/kvsp/"
EDGE_RELAY = "moqt://edge-relay.example:4443/"
ZONE_A_HOLDER = "http://edge-a.example/kvsp/"
ZONE_B_HOLDER = "http://edge-b.example/kvsp/"
MB = 1_000_000
ASSUMED = AssumedLink(mbit_per_s=10_000, rtt_us=200)
COMPAT = CompatId(bytes(range(32)))
SCOPE = ScopeId(bytes(range(16)))


def replica(holder: str, n: int, site: str | None = None, zone: str | None = None) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=BlockKey(bytes([n]) * 32),
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=0,
        size=MB,
        digest=bytes(32),
        layer_digests=None,
        residency=None,
        ttl_ms=60_000,
        moqt_namespace=None,
        site=site,
        zone=zone,
    )


def status(
    instance: str,
    *,
    site: str | None = None,
    zone: str | None = None,
    relay: str | None = None,
    links: tuple[Link, ...] = (),
    queued: int = 0,
) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance,
        epoch=1,
        state=InstanceState.ACTIVE,
        running=0,
        queued=queued,
        batch_size=8,
        kv_utilization=0.0,
        prefill_tokens_per_s=1_000.0,  # slow prefill: loading is always worth it
        decode_tokens_per_s=100.0,
        links=links,
        requested_state=None,
        ttl_ms=3000,
        site=site,
        zone=zone,
        relay=relay,
    )


def blocks(*holders: tuple[str, str | None], count: int = 3) -> list[list[ReplicaRecord]]:
    """``count`` blocks, each held by every (holder, site) given."""
    return [[replica(h, n, site) for h, site in holders] for n in range(count)]


def estimate(
    who: InstanceStatusRecord, found: Sequence[Sequence[ReplicaRecord]], assumed: bool = True
) -> tuple[tuple[str | None, ...], float, int]:
    est = estimate_instance(
        prepare_fetch(found),
        who,
        block_tokens=16,
        prompt_tokens=16 * len(found),
        service_times=ServiceTimeEstimator(prior_us=0.0),
        with_sources=True,
        assumed=ASSUMED if assumed else None,
    )
    assert est.sources is not None
    return est.sources, est.fetch_us, est.usable_blocks


def test_locality_ranks_zone_site_and_other() -> None:
    edge_a = status(EDGE_II, site="edge", zone="a")
    assert locality(edge_a, "edge", "a") == SAME_ZONE
    assert locality(edge_a, "edge", "b") == SAME_SITE
    assert locality(edge_a, "edge", None) == SAME_SITE
    assert locality(edge_a, "central", "a") == OTHER_SITE
    assert locality(edge_a, None, None) == OTHER_SITE  # a labelled instance, an unlabelled holder
    bare = status(EDGE_II)
    assert locality(bare, None, None) == SAME_SITE  # nobody labelled: one site, as before
    assert locality(bare, "edge", None) == OTHER_SITE


def test_a_same_site_holder_is_preferred_over_another_site() -> None:
    edge = status(
        EDGE_II, site="edge", links=(Link(holder=CENTRAL_HOLDER, mbit_per_s=1e6, rtt_us=5),)
    )
    found = blocks((CENTRAL_HOLDER, "central"), (EDGE_HOLDER, "edge"))
    sources, fetch_us, usable = estimate(edge, found)
    # the central holder is measured and faster, but the edge holder is in the instance's site
    assert sources == (EDGE_HOLDER,) * 3 and usable == 3
    assert fetch_us == pytest.approx(200 + 3 * 8 * MB / 10_000)  # assumed link, three blocks


def test_a_same_zone_holder_is_preferred_over_the_rest_of_the_site() -> None:
    edge_a = status(EDGE_II, site="edge", zone="a")
    found = [
        [replica(ZONE_B_HOLDER, n, "edge", "b"), replica(ZONE_A_HOLDER, n, "edge", "a")]
        for n in range(2)
    ]
    sources, _, _ = estimate(edge_a, found)
    assert sources == (ZONE_A_HOLDER, ZONE_A_HOLDER)


def test_an_unreachable_source_is_never_named() -> None:
    edge = status(EDGE_II, site="edge")  # no relay, no measured link
    found = blocks((CENTRAL_HOLDER, "central"), (CENTRAL_II, "central"))
    sources, fetch_us, usable = estimate(edge, found)
    assert usable == 0 and sources == () and fetch_us == 0.0
    # the PC's choice: the edge instance recomputes; it never gets a directive naming them
    decision = choose_instance(
        [edge],
        found,
        block_tokens=16,
        prompt_tokens=48,
        service_times=ServiceTimeEstimator(prior_us=0.0),
        assumed=ASSUMED,
    )
    assert decision is not None and decision.estimate.plan == "recompute"
    # an unlabelled instance assumes no link to a labelled holder either
    assert estimate(status(EDGE_II), found)[2] == 0


def test_the_edge_relay_is_named_for_blocks_held_only_elsewhere() -> None:
    edge = status(EDGE_II, site="edge", relay=EDGE_RELAY)
    found = blocks((CENTRAL_HOLDER, "central"), (CENTRAL_II, "central"))
    sources, fetch_us, usable = estimate(edge, found)
    assert sources == (EDGE_RELAY,) * 3 and usable == 3
    assert fetch_us == pytest.approx(200 + 3 * 8 * MB / 10_000)  # the assumed same-site rate
    # once the instance has measured its relay, that rate is used
    measured = status(
        EDGE_II,
        site="edge",
        relay=EDGE_RELAY,
        links=(Link(holder=EDGE_RELAY, mbit_per_s=1_000, rtt_us=50),),
    )
    assert estimate(measured, found)[1] == pytest.approx(50 + 3 * 8 * MB / 1_000)
    # without an assumption and without a measurement the relay is no source either
    assert estimate(edge, found, assumed=False)[2] == 0
    # blocks the instance can get in its site still come from there; only the rest via the relay
    mixed = [[replica(EDGE_HOLDER, 0, "edge")], [replica(CENTRAL_HOLDER, 1, "central")]]
    assert estimate(edge, mixed)[0] == (EDGE_HOLDER, EDGE_RELAY)


def test_a_measured_link_to_another_site_is_used_before_the_relay() -> None:
    edge = status(
        EDGE_II,
        site="edge",
        relay=EDGE_RELAY,
        links=(Link(holder=CENTRAL_HOLDER, mbit_per_s=4_000, rtt_us=1_000),),
    )
    sources, fetch_us, _ = estimate(edge, blocks((CENTRAL_HOLDER, "central")))
    assert sources == (CENTRAL_HOLDER,) * 3
    assert fetch_us == pytest.approx(1_000 + 3 * 8 * MB / 4_000)


def test_a_measured_rate_replaces_the_assumed_one() -> None:
    slow = Link(holder=EDGE_HOLDER, mbit_per_s=800, rtt_us=10)
    edge = status(EDGE_II, site="edge", links=(slow,))
    view = SourceView(edge, ASSUMED)
    measured = view.link(EDGE_HOLDER, "edge", None)
    assumed = view.link(CENTRAL_II, "edge", None)
    assert measured is not None and measured.measured and measured.mbit_per_s == 800
    assert assumed is not None and not assumed.measured and assumed.mbit_per_s == 10_000
    # both in the site: blocks go where they finish first, at the measured rate for EDGE_HOLDER
    found = blocks((EDGE_HOLDER, "edge"), (CENTRAL_II, "edge"), count=2)
    sources, fetch_us, _ = estimate(edge, found)
    # CENTRAL_II: 200 + 800 = 1000, then 1800; EDGE_HOLDER: 10 + 10000 → both to CENTRAL_II
    assert sources == (CENTRAL_II, CENTRAL_II)
    assert fetch_us == pytest.approx(200 + 2 * 800)


def test_the_cheaper_instance_is_the_one_that_can_use_a_nearby_copy() -> None:
    central = status(CENTRAL_II, site="central", queued=1)
    edge = status(EDGE_II, site="edge", relay=EDGE_RELAY)
    found = blocks((CENTRAL_HOLDER, "central"))
    service = ServiceTimeEstimator(prior_us=1e9)  # a queued request at central costs a lot
    decision = choose_instance(
        [central, edge],
        found,
        block_tokens=16,
        prompt_tokens=48,
        service_times=service,
        assumed=ASSUMED,
    )
    assert decision is not None and decision.instance == EDGE_II
    assert decision.estimate.sources == (EDGE_RELAY,) * 3


def directive_sources(
    who: InstanceStatusRecord, found: Sequence[Sequence[ReplicaRecord]], chosen: Sequence[str]
) -> list[tuple[str, ...]]:
    request = PlaceRequest(
        scope_id=SCOPE,
        compat_id=COMPAT,
        block_keys=tuple(rs[0].block_key for rs in found),
        prompt_tokens=16 * len(found),
    )
    directive = build_directive(
        directive_id=uuid.uuid4(),
        request=request,
        replicas=found,
        sources=chosen,
        status=who,
        deadline_ms=1000,
        lease_ms=5000,
        assumed=ASSUMED,
    )
    assert directive is not None
    return [block.sources for block in directive.blocks]


def test_directive_fallbacks_nearest_first_then_the_relay_never_the_unusable() -> None:
    far_measured = Link(holder=CENTRAL_II, mbit_per_s=50_000, rtt_us=900)
    edge = status(EDGE_II, site="edge", zone="a", relay=EDGE_RELAY, links=(far_measured,))
    row = [
        replica(CENTRAL_HOLDER, 0, "central"),  # another site, not measured: never named
        replica(CENTRAL_II, 0, "central"),  # another site, measured: a late fallback
        replica(ZONE_B_HOLDER, 0, "edge", "b"),  # the site, another zone
        replica(ZONE_A_HOLDER, 0, "edge", "a"),  # the zone
        replica(EDGE_HOLDER, 0, "edge", "a"),
    ]
    (sources,) = directive_sources(edge, [row], [EDGE_HOLDER])
    assert sources == (
        EDGE_HOLDER,
        ZONE_A_HOLDER,
        ZONE_B_HOLDER,
        CENTRAL_II,
        EDGE_RELAY,
    )
    # the relay chosen: named once, with nothing usable after it
    only_far = [[replica(CENTRAL_HOLDER, 0, "central")]]
    assert directive_sources(edge, only_far, [EDGE_RELAY]) == [(EDGE_RELAY,)]
    # no relay: no relay fallback
    plain = status(EDGE_II, site="edge")
    assert directive_sources(plain, [[replica(EDGE_HOLDER, 0, "edge")]], [EDGE_HOLDER]) == [
        (EDGE_HOLDER,)
    ]


def test_a_relay_that_is_not_a_moqt_uri_is_no_directive_source() -> None:
    # a QMux carrier URI (moqt+tls) cannot be named in a directive (§6.5 sources)
    edge = status(EDGE_II, site="edge", relay="moqt+tls://edge-relay.example:4444/")
    assert estimate(edge, blocks((CENTRAL_HOLDER, "central")))[2] == 0
