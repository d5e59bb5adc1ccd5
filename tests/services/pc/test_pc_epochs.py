"""Status epochs bounded by the PC's clock (kvsp.lifecycle, spec §6.3), over HTTP to an
in-process control plane (PC and IS): an epoch far ahead is refused with a problem naming the
bound and changes nothing, so it cannot lock the real instance out; a poisoned epoch (kept while
the PC's clock ran far ahead) yields to the instance's next status without an operator; an
epoch just within the bound holds the instance off for at most the bound; and the bound is an
option of ``kvsp serve pc`` and ``kvsp serve control``."""

from __future__ import annotations

from typing import Any

import pytest

from kvsp.cli import build_parser
from kvsp.ids import uri_id
from kvsp.lifecycle import DEFAULT_MAX_EPOCH_SKEW_MS
from kvsp.services.pc.app import pc_config
from kvsp.services.pc.service import PCConfig
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

NOW = 1_000_000  # App's clock


@pytest.fixture
def app() -> App:
    """The control plane with key 0..3 at H1, so that a placement can match them."""
    plane = App()
    for i in range(4):
        path = f"replicas/{COMPAT.hex()}/{SCOPE.hex()}/{key(i).hex()}/{uri_id(H1)}"
        assert plane.http.put(path, json=replica_json(i), headers=auth("h1")).status_code == 200
    return plane


def at_epoch(epoch: int) -> dict[str, Any]:
    return status_json(A, epoch=epoch)


def placed_at(app: App) -> Any:
    answer = app.place(place_json())
    assert answer.status_code == 200, answer.text
    return answer.json()["instance"]


def test_an_epoch_far_ahead_is_refused_and_the_instance_keeps_serving(app: App) -> None:
    assert app.put_status(at_epoch(3)).status_code == 200
    forged = app.put_status(at_epoch(NOW + 10**9))
    problem(forged, 400, "kvsp-bad-request", "$.epoch")
    assert str(DEFAULT_MAX_EPOCH_SKEW_MS) in forged.json()["detail"]
    for _ in range(3):  # the real instance goes on reporting, past its record's TTL
        app.clock.advance(1_000)
        answer = app.put_status(at_epoch(3))
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"state": "active"}
    [entry] = app.listing()
    assert (entry["epoch"], entry["state"]) == (3, "active")
    assert placed_at(app) == A


def test_a_poisoned_epoch_yields_to_the_instance_without_an_operator(app: App) -> None:
    app.clock.set(NOW + 10**9)  # the PC's clock ran far ahead and took an epoch from then
    assert app.put_status(at_epoch(NOW + 10**9)).status_code == 200
    app.clock.set(NOW)  # ... and was stepped back: that epoch is beyond the bound now
    answer = app.put_status(at_epoch(3))
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"state": "active"}
    [entry] = app.listing()
    assert (entry["epoch"], entry["state"]) == (3, "active")
    assert placed_at(app) == A
    problem(app.put_status(at_epoch(2)), 409, "kvsp-stale-epoch")  # §6.3 holds from here on


def test_a_poisoned_epoch_yields_to_whatever_state_the_instance_reports(app: App) -> None:
    app.clock.set(NOW + 10**9)
    assert app.put_status(at_epoch(NOW + 10**9)).status_code == 200
    app.clock.set(NOW)
    answer = app.put_status({**at_epoch(3), "state": "draining"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"state": "draining"}


def test_an_epoch_within_the_bound_holds_the_instance_off_for_at_most_the_bound(
    app: App,
) -> None:
    assert app.put_status(at_epoch(NOW)).status_code == 200
    assert app.put_status(at_epoch(NOW + DEFAULT_MAX_EPOCH_SKEW_MS)).status_code == 200
    problem(app.put_status(at_epoch(NOW + 1)), 409, "kvsp-stale-epoch")
    # On each kvsp-stale-epoch the instance re-registers with its start time (its clock):
    # once that passes the forged epoch it is in again.
    app.clock.advance(DEFAULT_MAX_EPOCH_SKEW_MS + 1)
    answer = app.put_status(at_epoch(app.clock.now_ms()))
    assert answer.status_code == 200, answer.text
    assert placed_at(app) == A


@pytest.mark.parametrize("command", ["pc", "control"])
def test_the_bound_is_an_option_with_a_stated_default(command: str) -> None:
    assert PCConfig().max_epoch_skew_ms == DEFAULT_MAX_EPOCH_SKEW_MS == 60_000
    extra = ["--index", "http://127.0.0.1:1/", "--index-token-file", "t"] if command == "pc" else []
    parser = build_parser()
    args = parser.parse_args(["serve", command, *extra, "--max-epoch-skew-ms", "5000"])
    assert pc_config(args).max_epoch_skew_ms == 5000
    defaults = parser.parse_args(["serve", command, *extra])
    assert pc_config(defaults).max_epoch_skew_ms == DEFAULT_MAX_EPOCH_SKEW_MS
