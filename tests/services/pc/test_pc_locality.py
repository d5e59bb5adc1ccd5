"""Site labels at the control plane, in-process (spec §4.4 extension members, §6.4, §6.5):
status records and Replica Records carry ``site``/``zone`` (and an instance its ``relay``),
bad labels are 400s naming the member, ``GET instances`` shows them, and placement sends an
edge instance to its relay for blocks held only at another site."""

from __future__ import annotations

from typing import Any

from kvsp.ids import uri_id
from tests.services.pc.test_pc_app import (
    COMPAT,
    H1,
    SCOPE,
    A,
    App,
    auth,
    key,
    place_json,
    problem,
    replica_json,
    status_json,
)

RELAY = "moqt://edge-relay.example:4443/"


def put_replica(app: App, i: int, **members: Any) -> Any:
    path = f"replicas/{COMPAT.hex()}/{SCOPE.hex()}/{key(i).hex()}/{uri_id(H1)}"
    return app.http.put(path, json={**replica_json(i), **members}, headers=auth("h1"))


def edge_status(**members: Any) -> dict[str, Any]:
    return {**status_json(links=()), "site": "edge", "relay": RELAY, **members}


def test_labels_are_carried_and_listed() -> None:
    app = App()
    answer = app.put_status(edge_status(zone="rack-1"))
    assert answer.status_code == 200, answer.text
    [row] = app.listing()
    assert (row["site"], row["zone"]) == ("edge", "rack-1")
    assert app.put_status({**status_json(epoch=4)}).status_code == 200
    [row] = app.listing()
    assert (row["site"], row["zone"]) == (None, None)  # unlabelled: null


def test_bad_labels_are_400s_naming_the_member() -> None:
    app = App()
    assert app.put_status(edge_status()).status_code == 200
    before = app.listing()
    for members, path in (
        ({"site": "Edge"}, "$.site"),  # uppercase
        ({"site": "-edge"}, "$.site"),
        ({"site": "e" * 64}, "$.site"),
        ({"site": None}, "$.site"),
        ({"site": 7}, "$.site"),
        ({"zone": "a_b"}, "$.zone"),
        ({"relay": "relay.example:4443"}, "$.relay"),
        ({"relay": ["moqt://r/"]}, "$.relay"),
    ):
        problem(app.put_status(edge_status(**members)), 400, "kvsp-bad-request", path)
    assert app.listing() == before
    problem(put_replica(app, 0, site="Central"), 400, "kvsp-bad-request", "$.site")
    problem(put_replica(app, 0, zone=""), 400, "kvsp-bad-request", "$.zone")
    assert put_replica(app, 0, site="central", zone="z1").status_code == 200


def test_an_edge_instance_is_sent_to_its_relay_for_blocks_held_at_another_site() -> None:
    app = App()
    for i in range(4):
        assert put_replica(app, i, site="central").status_code == 200
    assert app.put_status(edge_status()).status_code == 200
    placed = app.place(place_json())
    assert placed.status_code == 200, placed.text
    assert placed.json()["instance"] == A
    [(instance, directive)] = app.peers.directives
    assert instance == A
    assert [block.sources for block in directive.blocks] == [(RELAY,)] * 4


def test_a_same_site_holder_comes_first_and_the_relay_last() -> None:
    app = App()
    for i in range(4):
        assert put_replica(app, i, site="edge").status_code == 200
    assert app.put_status(edge_status()).status_code == 200
    assert app.place(place_json()).status_code == 200
    [(_, directive)] = app.peers.directives
    assert [block.sources for block in directive.blocks] == [(H1, RELAY)] * 4
