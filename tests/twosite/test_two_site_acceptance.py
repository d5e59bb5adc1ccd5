"""Acceptance of the issue "two sites, several control planes" with every part a real process
(tests/support/twosite.py): a central site (Redis, two control planes, a holder with a disk
tier, an instance) and an edge site (relay and instance) in a network namespace reachable only
through a veth pair (spec §6.3, §6.4, §6.5, §6.8; DESIGN.md §1, §4).

* A prefix computed centrally reaches the edge instance through the edge relay over MOQT
  without any hand-posted directive: ``kvsp generate`` through the PCs is placed at the edge
  instance, whose generation loads the matched blocks (transport ``moqt``) instead of
  recomputing them.
* One PC is killed mid-generation: the session completes through the other, every token once.
* A graceful SIGTERM of an instance withdraws its replicas at once, and no PC lists it failed.

The tests share one topology (started once for the module) and run in this order; each checks
what it needs of the state the earlier ones left (the second PC serves the later tests once the
first is killed).
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.netns import network_namespace, unavailable
from tests.support.polling import eventually
from tests.support.twosite import (
    STATUS_TTL_MS,
    TwoSites,
    keys_of,
    prompt_of,
    reachable,
    reference_tokens,
    start_two_sites,
)

WHY = unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(WHY is not None, reason=WHY or ""),
]

SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$", re.MULTILINE)
FETCHED = "kvsp_block_fetched_bytes_total"
SERVED = "kvsp_block_served_bytes_total"
FAILED = "kvsp_block_fetch_failures_total"


@pytest.fixture(scope="module")
def sites(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoSites]:
    folder = tmp_path_factory.mktemp("twosite")
    store = f"{redis_server}{'&' if '?' in redis_server else '?'}prefix=ts-{secrets.token_hex(6)}"
    with network_namespace("kvsp2s") as ns:
        started = start_two_sites(folder, ns, store)
        try:
            yield started
        finally:
            started.stop()


def report_of(stderr: str) -> dict[str, str]:
    """The ``kvsp: NAME: VALUE`` lines of ``kvsp generate --verbose``."""
    found = re.findall(r"^kvsp: ([^:]+): (.*)$", stderr, re.MULTILINE)
    return dict(found)


def token_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def metric(sites: TwoSites, name: str, family: str, **labels: str) -> float:
    """The sum of the samples of ``family`` at ``name``'s /metrics whose labels include
    ``labels`` (0 when there is none)."""
    total = 0.0
    for found, sample, value in SAMPLE.findall(sites.metrics(name)):
        if found == family and all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


def test_the_sites_are_apart(sites: TwoSites) -> None:
    ns = sites.ns
    assert reachable(ns, sites.controls[0]) and reachable(ns, sites.controls[1])
    # the central holder and instance serve on the central loopback: out of the edge's reach
    assert not reachable(ns, sites.urls["holder"]) and not reachable(ns, sites.urls["central"])
    assert reachable(ns, sites.urls["relay-http"]) and reachable(ns, sites.urls["edge"])


def test_both_pcs_list_both_instances_with_their_site(sites: TwoSites) -> None:
    wanted = {sites.urls["central"], sites.urls["edge"]}
    for control in sites.controls:  # each instance reports to the first; both PCs list both

        def both(control: str = control) -> dict[str, dict[str, Any]] | None:
            rows = sites.instances(control)
            return rows if wanted <= set(rows) else None

        rows = eventually(both, 20, f"both instances at {control} (one registry in Redis)")
        assert rows[sites.urls["edge"]].get("site") == "edge", rows
        assert rows[sites.urls["central"]].get("site") == "central", rows


def test_a_central_prefix_reaches_the_edge_through_its_relay(sites: TwoSites) -> None:
    prefix = prompt_of(4, seed=1)
    made = sites.generate_at("central", prefix, 1)
    assert made.status_code == 200, made.text
    assert made.headers["kvsp-computed-blocks"] == "4"
    keys = keys_of(prefix)
    eventually(
        lambda: (
            len(found := sites.holders_of(sites.controls[0], keys)) == len(keys)
            and all(sites.relay_moqt in h and sites.urls["central"] in h for h in found)
        ),
        20,
        "the prefix at the IS from the central instance and from the edge relay",
    )
    # the central instance stops taking work, so the PC places the next request at the edge
    answer = sites.put_state(sites.controls[0], "central", "draining")
    assert answer.status_code == 200, answer.text
    eventually(
        lambda: sites.instances(sites.controls[0])[sites.urls["central"]]["state"] != "active",
        10,
        "the central instance draining",
    )
    relay = sites.relay_moqt
    fetched = metric(sites, "edge", FETCHED, transport="moqt", source=relay)
    served = metric(sites, "relay-http", SERVED, transport="moqt")
    prompt = [*prefix, *prompt_of(0, seed=2, tail=5)]
    run = sites.kvsp_generate(prompt, 4)
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 0, stderr + sites.logs()
    report = report_of(stderr)
    assert report["instance"] == sites.urls["edge"], stderr
    assert [t["token"] for t in token_lines(stdout)] == reference_tokens(prompt, 4)
    assert int(report["matched blocks"]) == 4, stderr
    hexes = [k.hex() for k in keys]
    # the PC's own directive (none was posted by hand) loaded the whole prefix at the edge
    answer = sites.http.get(
        f"{sites.urls['edge']}prefetch/{report['directive']}", headers=sites.headers()
    )
    assert answer.status_code == 200, stderr
    outcome = answer.json()
    assert (outcome["state"], sorted(outcome["loaded"])) == ("complete", sorted(hexes)), (
        outcome,
        sites.logs(),
    )
    assert report["blocks"] == "4 loaded, 0 computed", stderr + sites.logs()
    # over MOQT, from the relay, which served them; no fetch tried the central site
    assert metric(sites, "edge", FETCHED, transport="moqt", source=relay) > fetched
    assert metric(sites, "relay-http", SERVED, transport="moqt") > served
    for unreachable in (sites.urls["holder"], sites.urls["central"]):
        assert metric(sites, "edge", FAILED, source=unreachable) == 0, sites.metrics("edge")


def test_replica_records_carry_their_publisher_site(sites: TwoSites) -> None:
    keys = keys_of(prompt_of(4, seed=1))  # the prefix of the test before
    site_of = {
        sites.relay_moqt: "edge",
        sites.urls["edge"]: "edge",
        sites.urls["central"]: "central",
    }

    def labels() -> dict[str, set[str | None]] | None:
        found: dict[str, set[str | None]] = {}
        for records in sites.lookup(sites.controls[0], keys):
            for record in records:
                found.setdefault(record["holder"], set()).add(record.get("site"))
        return found if {sites.relay_moqt, sites.urls["central"]} <= set(found) else None

    found = eventually(labels, 20, "the prefix's records of the relay and the central instance")
    assert found == {holder: {site_of[holder]} for holder in found}


def test_a_pc_killed_mid_generation_the_session_completes_through_the_other(
    sites: TwoSites,
) -> None:
    count = 60  # 40 ms a decode round at the instance: a few seconds of generation
    prompt = prompt_of(2, seed=3, tail=3)
    run = sites.kvsp_generate(prompt, count)
    assert run.stdout is not None
    lines = [run.stdout.readline() for _ in range(5)]  # the generation is under way
    assert all(lines), run.stderr.read() if run.stderr else ""
    sites.services["control-a"].proc.kill()  # the PC the client and the instances use first
    sites.services["control-a"].proc.wait(10)
    rest, stderr = run.communicate(timeout=90)
    assert run.returncode == 0, stderr + sites.logs()
    lines_read = token_lines("".join(lines) + rest)
    assert [t["index"] for t in lines_read] == list(range(count)), stderr  # each once
    assert [t["token"] for t in lines_read] == reference_tokens(prompt, count)
    session = uuid.UUID(report_of(stderr)["session"])
    # the checkpoints after the kill went through the surviving PC, to the last token
    answer = sites.http.get(f"{sites.controls[1]}sessions/{session}", headers=sites.headers())
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert (view["state"], view["output_offset"]) == ("done", count), view
    # and both instances report to it now
    since = time.monotonic()

    def fresh() -> bool:
        rows = sites.instances(sites.controls[1])
        return all(
            url in rows
            and rows[url]["state"] != "failed"
            and rows[url]["age_ms"] / 1000 < time.monotonic() - since
            for url in (sites.urls["central"], sites.urls["edge"])
        )

    eventually(fresh, 10, "fresh status records of both instances at the second PC")


def test_a_sigterm_withdraws_the_instance_replicas_at_once(sites: TwoSites) -> None:
    control = sites.controls[1]  # the first may have been killed by the test before
    edge = sites.urls["edge"]
    prompt = prompt_of(3, seed=4)
    made = sites.generate_at("edge", prompt, 1)
    assert made.status_code == 200, made.text
    keys = keys_of(prompt)
    eventually(
        lambda: any(edge in holders for holders in sites.holders_of(control, keys)),
        20,
        "the edge instance's records at the IS",
    )
    service = sites.services["edge"]
    service.proc.send_signal(signal.SIGTERM)
    eventually(
        lambda: all(edge not in holders for holders in sites.holders_of(control, keys)) or None,
        2.5,
        "no record of the stopped instance at the IS",
    )
    assert service.proc.wait(timeout=30) == 0, service.output()[-3000:]
    # the PC ends its epoch: never listed failed, through several status TTLs, then gone
    deadline = time.monotonic() + 3 * STATUS_TTL_MS / 1000
    while time.monotonic() < deadline:
        row = sites.instances(control).get(edge)
        assert row is None or row["state"] != "failed", row
        time.sleep(0.1)
    assert edge not in sites.instances(control)
