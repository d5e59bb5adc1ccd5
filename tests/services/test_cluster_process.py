"""Acceptance of the Placement Controller and the instance agent among real processes on
127.0.0.1: ``kvsp serve control`` (IS + PC), three ``kvsp serve instance --engine toy`` (a, b,
c; a runs one session at a time) and one standalone ``kvsp serve holder``.

Each test starts from all instances active (the ``cluster`` fixture heals what an earlier test
drained, killed or froze) and uses prompts of its own, so the tests do not depend on their
order. Placements are checked against :func:`kvsp.placement.choose_instance` computed from the
inputs the PC had (``tests.support.cluster.Cluster.place_as_formula``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import cluster as cluster_kit
from tests.support.cluster import PROBLEM, B, hexes, keys_of, prompt_of, reference
from tests.support.polling import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def running_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Control, holder and instances a, b, c, shared by the module and stopped at its end."""
    folder = tmp_path_factory.mktemp("cluster")
    cluster = cluster_kit.start_cluster(
        folder,
        {"a": ["--batch-size", "1"], "b": [], "c": []},
        [
            *("--status-sweep-ms", "100"),
            *("--service-prior-us", str(int(cluster_kit.SERVICE_PRIOR_US))),
        ],
    )
    try:
        yield cluster
    finally:
        cluster.stop()
        cluster.http.close()


@pytest.fixture
def cluster(running_cluster: Any) -> Iterator[Any]:
    """The module's cluster with every instance alive, active and freshly reported."""
    running_cluster.heal()
    try:
        yield running_cluster
    finally:
        running_cluster.thaw("holder")


def drain(cluster: Any, *names: str) -> None:
    """Drain ``names`` through the PC and wait until they reported sleeping (they are idle)."""
    for name in names:
        answer = cluster.set_state(name, "draining")
        assert answer.status_code == 200, answer.text
        # an idle instance reports sleeping at once, often before the PC has its answer
        assert answer.json()["state"] in ("draining", "sleeping"), answer.text
    for name in names:
        eventually(
            lambda name=name: cluster.row(name)["reported_state"] == "sleeping" or None,
            what=f"{name} to sleep",
        )


def problem_type(answer: Any) -> str:
    assert answer.headers["content-type"].startswith("application/problem+json"), answer.text
    kind: str = answer.json()["type"]
    return kind


# --- 1. requests sharing a long prefix land where the cache is --------------------------------


def test_a_shared_prefix_is_placed_where_it_is_cached_until_a_queue_there_outweighs_it(
    cluster: Any,
) -> None:
    a = cluster.url("a")
    cached = prompt_of(16, seed=1, tail=5)
    made = cluster.generate("a", cached, 4)
    assert made.status == 200 and (made.loaded_blocks, made.computed_blocks) == (0, 16)
    cluster.published(keys_of(cached), a)
    cluster.settle()

    # Another request with the same 16-block prefix and its own continuation.
    sharing = cached[: 16 * B] + prompt_of(2, seed=2, tail=7)
    first, decision = cluster.place_as_formula(sharing)
    assert first["matched"] == 16
    if first["instance"] == a:
        assert decision.estimate.resident_blocks == 16  # cost: the 2 blocks and 7 tokens after
        assert "directive" not in first  # nothing to load: it is all resident at a
    else:  # loading a's prefix over the PC's assumed link cost no more (measured rates vary)
        assert decision.estimate.plan == "fetch"
        assert set(decision.estimate.sources or ()) <= {a}
        # Quiet again before the next placement: the load ends and its replicas are known.
        chosen = cluster.name_of(first["instance"])
        outcome = cluster.directive_outcome(chosen, first["directive"])
        assert outcome["state"] == "complete", outcome
        cluster.published(keys_of(cached), first["instance"])
        cluster.settle()

    # a runs one session at a time: one long generation and three more waiting for it put
    # a queue at a, which §6.4 charges as queued * mean service time (10 s, the PC's prior).
    held = [cluster.hold_generation("a", [7, 7, 7, n]) for n in range(4)]
    try:
        eventually(lambda: cluster.row("a")["queued"] >= 1 or None, what="a queue at a")
        busy, decision = cluster.place_as_formula(sharing)
        assert busy["instance"] != a
        assert busy["cost"] < cluster_kit.SERVICE_PRIOR_US  # below a's wait alone
    finally:
        for sock in held:
            sock.close()

    if "directive" in busy:  # an instance with a link to a loaded the prefix from it
        outcome = cluster.directive_outcome(cluster.name_of(busy["instance"]), busy["directive"])
        assert outcome["state"] == "complete", outcome
        cluster.published(keys_of(cached), busy["instance"])
    eventually(lambda: cluster.row("a")["running"] + cluster.row("a")["queued"] == 0 or None)
    cluster.settle()
    back, decision = cluster.place_as_formula(sharing)
    # back where the prefix is cached, or loading it from there as cheaply as the formula says
    assert decision.estimate.resident_blocks == 16 or decision.estimate.plan == "fetch"
    if "directive" not in busy and decision.estimate.plan != "fetch":
        assert back["instance"] == a  # no other instance holds the prefix


# --- 2. a draining instance receives nothing new ------------------------------------------------


def test_a_draining_instance_gets_no_requests_and_no_directives(cluster: Any) -> None:
    a = cluster.url("a")
    cached = prompt_of(12, seed=3, tail=3)
    made = cluster.generate("a", cached, 2)
    assert made.status == 200
    cluster.published(keys_of(cached), a)
    for name in ("b", "c"):
        cluster.teach_link(name, "a")  # so that b and c could load a's blocks
    cluster.settle()
    before, _ = cluster.place_as_formula(cached)
    assert before["instance"] == a

    drain(cluster, "a")  # a has nothing in flight, so it goes on to sleeping (§6.3)
    assert cluster.row("a")["state"] == "sleeping"
    directives = []
    for _ in range(3):
        body, decision = cluster.place_as_formula(cached)
        assert body["instance"] != a
        if "directive" in body:  # loading a's blocks from its holder face beats recomputing
            # a's holder face, or an instance that loaded the blocks from it (an assumed link)
            peers = {a, cluster.url("b"), cluster.url("c")} - {body["instance"]}
            assert set(decision.estimate.sources or ()) <= {None} | peers
            name = cluster.name_of(body["instance"])
            outcome = cluster.directive_outcome(name, body["directive"])
            assert outcome["state"] == "complete", outcome
            assert outcome["loaded"] == hexes(keys_of(cached)[decision.estimate.resident_blocks :])
            directives.append(body["directive"])
            cluster.published(keys_of(cached), body["instance"])
        cluster.settle(["b", "c"])  # quiet again before the next placement
    assert directives, "the first placement away from a loads a's blocks elsewhere"
    for directive in directives:
        assert cluster.directive("a", directive).status_code == 404  # a never got one

    refused = cluster.generate("a", cached, 1)  # and a takes no new session itself
    assert refused.status == 503 and json.loads(refused.body)["type"] == PROBLEM + "kvsp-not-active"
    status = cluster.status("a")
    assert (status["state"], status["running"], status["queued"]) == ("sleeping", 0, 0)


# --- 3. an instance that stops reporting fails after its TTL ------------------------------------


def test_a_killed_instance_fails_after_its_ttl_and_gets_nothing(cluster: Any) -> None:
    c = cluster.url("c")
    # whole blocks: c's cost is its wait alone, so c is the choice whatever prefill rates the
    # instances measured (under load, a slow rate measured at c made recomputing a tail there
    # dearer than fetching c's blocks elsewhere)
    cached = prompt_of(10, seed=4)
    made = cluster.generate("c", cached, 2)
    assert made.status == 200
    cluster.published(keys_of(cached), c)
    cluster.settle()
    before, _ = cluster.place_as_formula(cached)
    assert before["instance"] == c
    epoch = cluster.row("c")["epoch"]

    cluster.kill("c")
    row = eventually(
        lambda: (r := cluster.row("c"))["state"] == "failed" and r or None, 10, "c failed"
    )
    assert row["ttl_ms"] == cluster_kit.STATUS_TTL_MS and row["age_ms"] >= row["ttl_ms"]
    # Nobody withdrew c's replicas (the index is advisory, §6.1), yet nothing goes to c.
    assert all(c in holders for holders in cluster.holders_of(keys_of(cached)))
    for _ in range(3):
        body, _ = cluster.place_as_formula(cached)
        assert body["instance"] != c

    cluster.restart_instance("c")  # the same URI comes back with a higher epoch (§6.3)
    row = eventually(
        lambda: (r := cluster.row("c"))["state"] == "active" and r or None, 30, "c back"
    )
    assert row["epoch"] > epoch


# --- 4. a delayed record with a lower epoch is ignored ------------------------------------------


def test_a_delayed_record_with_a_lower_epoch_than_seen_is_refused(cluster: Any) -> None:
    delayed = cluster.status("b")  # what b's old incarnation says, arriving late
    old_epoch = delayed["epoch"]
    cluster.restart_instance("b")
    row = eventually(  # b's row is gone between its old incarnation leaving and the new one
        lambda: (
            (r := cluster.row_if_any("b"))
            and r["epoch"] > old_epoch
            and r["state"] == "active"
            and r
            or None
        ),
        30,
        "b registered with a new epoch",
    )
    new_epoch = row["epoch"]
    delayed |= {"running": 5, "queued": 7}
    clock_went_back = delayed | {"epoch": new_epoch - 1}
    for record in (delayed, clock_went_back):
        answer = cluster.put_status(record)
        assert answer.status_code == 409, answer.text
        assert problem_type(answer) == PROBLEM + "kvsp-stale-epoch"

    after = cluster.row("b")
    assert (after["epoch"], after["state"], after["reported_state"]) == (
        new_epoch,
        "active",
        "active",
    )
    assert (after["running"], after["queued"]) == (0, 0)
    cluster.settle(["b"])  # b itself goes on reporting under its new epoch
    assert cluster.row("b")["epoch"] == new_epoch


# --- cold start: no measured link yet, a directive over the PC's assumed link --------------


def test_place_directs_a_prefetch_to_an_instance_that_never_fetched_from_the_holder(
    cluster: Any,
) -> None:
    if any(link["holder"] == cluster.holder for link in cluster.status("c")["links"]):
        cluster.restart_instance("c")  # forget the link an earlier test measured
        cluster.settle(["c"])
    prompt = prompt_of(8, seed=7, tail=4)
    keys = cluster.store_at_holder(prompt)
    drain(cluster, "a", "b")
    cluster.settle(["c"])
    body, decision = cluster.place_as_formula(prompt)
    assert body["instance"] == cluster.url("c") and body["matched"] == len(keys)
    assert "directive" in body, (body, decision.estimate)


# --- 5. a deadline shorter than the load: partial, then recompute the rest ---------------------


def test_a_deadline_shorter_than_the_load_gives_a_partial_prefix_and_the_rest_is_recomputed(
    cluster: Any,
) -> None:
    a, holder = cluster.url("a"), cluster.holder
    blocks, first = 10, 3
    prompt = prompt_of(blocks, seed=5, tail=9)
    expected, _ = reference(prompt, 6)
    keys = keys_of(prompt)
    # Blocks 0-2 are cached at a, blocks 3-9 only at the holder (a key names its whole prefix,
    # so the holder can keep the later blocks alone).
    assert cluster.generate("a", prompt[: first * B], 1).status == 200
    cluster.published(keys[:first], a)
    cluster.store_at_holder(prompt, first=first)
    assert cluster.holders_of(keys) == [{a}] * first + [{holder}] * (blocks - first)
    cluster.teach_link("b", "a")
    cluster.teach_link("b", "holder")
    drain(cluster, "a", "c")  # b is the one candidate; a still serves its blocks
    cluster.settle(["b"])

    # The holder stops answering: the load of block 3 outlasts any deadline.
    cluster.freeze("holder")
    try:
        body, decision = cluster.place_as_formula(prompt, deadline_ms=2_000)
        assert body["instance"] == cluster.url("b") and body["matched"] == blocks
        assert decision.estimate.plan == "fetch" and "directive" in body, (body, decision)
        # The directive lists every block: 0-2 from a, 3-9 from the holder.
        assert decision.estimate.sources == (a,) * first + (holder,) * (blocks - first)
        started = time.monotonic()
        outcome = cluster.directive_outcome("b", body["directive"], timeout=30)
        waited = time.monotonic() - started
    finally:
        cluster.thaw("holder")
    assert outcome["state"] == "partial", outcome
    assert outcome["loaded"] == hexes(keys[:first])  # exactly the prefix that loaded
    assert "deadline" in outcome.get("detail", ""), outcome
    assert waited < 10  # stopped by the deadline, not by a transfer timing out

    generated = cluster.generate("b", prompt, 6)
    assert generated.status == 200, generated.body
    assert (generated.loaded_blocks, generated.computed_blocks) == (first, blocks - first)
    assert generated.lines == [{"index": i, "epoch": 1, "token": t} for i, t in enumerate(expected)]


# --- 6. prefetch via the PC from the standalone holder ----------------------------------------


def test_place_prefetches_holder_blocks_into_the_chosen_instance(cluster: Any) -> None:
    holder = cluster.holder
    prompt = prompt_of(8, seed=6, tail=4)
    expected, _ = reference(prompt, 5)
    keys = cluster.store_at_holder(prompt)
    assert cluster.holders_of(keys) == [{holder}] * len(keys)  # only at the holder
    for name in cluster.instance_names:
        cluster.teach_link(name, "holder")
    cluster.settle()

    body, decision = cluster.place_as_formula(prompt)
    chosen = cluster.name_of(body["instance"])
    assert body["matched"] == len(keys) and decision.estimate.plan == "fetch"
    assert decision.estimate.sources == (holder,) * len(keys)
    outcome = cluster.directive_outcome(chosen, body["directive"])
    assert outcome == {"directive": body["directive"], "state": "complete", "loaded": hexes(keys)}
    for other in cluster.instance_names:
        if other != chosen:
            assert cluster.directive(other, body["directive"]).status_code == 404

    cluster.published(keys, body["instance"])  # its own replicas, under its own URI
    assert cluster.holders_of(keys) == [{holder, body["instance"]}] * len(keys)
    generated = cluster.generate(chosen, prompt, 5)
    assert (generated.loaded_blocks, generated.computed_blocks) == (len(keys), 0)
    assert generated.tokens == expected
