"""Step 2 of ``kvsp demo``: prefetch directives move the shared prefix into other instances,
over MOQT through the relay and over HTTP from the instance that computed it, side by side
(spec §6.5 directives, §6.6 leases, §6.7 verified retrieval; DESIGN.md §4 KV blocks over MOQT).

Instances started with ``--relay`` push every block they publish to the relay as a stored
track; the relay caches it and, being a holder, publishes its own Replica Record with its
``moqt://`` URI. One directive names only the relay as source of system prompt A, so the target
loads every block over MOQT (FETCH of the stored track, every layer checked against the
record's digests); the other names only the HTTP holder face of the instance that computed
system prompt B. Each target is an instance that holds none of the prefix it is sent (step 1's
placements may already have moved A somewhere), so that the table's octets and MB/s are what
crossed the transport; each then serves a request with the loaded prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsp.ids import BlockKey

if TYPE_CHECKING:
    from kvsp.demo.scenario import Scenario


def run_moqt_prefetch(scenario: Scenario) -> None:
    """Step 2: one directive over MOQT through the relay, one over HTTP."""
    cluster, console, client = scenario.cluster, scenario.console, scenario.client
    endpoints = cluster.running()
    instances = list(endpoints.instances.values())
    a_keys, b_keys = scenario.system_keys, client.keys(scenario.other_system)
    console.heading(
        f"2. Prefetch: directives load a {len(a_keys)}-block prefix into other instances over "
        "MOQT through the relay and over HTTP (§6.5, DESIGN §4)"
    )
    # (target, source, transport, keys, system prompt)
    plans: list[tuple[str, str, str, list[BlockKey], list[int] | None]] = []
    relay = endpoints.relay_moqt
    if not (cluster.relay_link and relay):
        scenario.figures.missing.append(
            "prefetch over MOQT: `kvsp serve instance` has no --relay option in this build, "
            "so no instance publishes blocks to the relay or loads moqt:// replicas"
        )
    elif target := _without(scenario, instances, a_keys):
        scenario.await_published(relay, a_keys)
        console.line(
            f"the relay cached the blocks {scenario.name(scenario.holder_of_prefix)} pushed to "
            f"it and published {len(a_keys)} replicas of its own at the IS ({relay})"
        )
        plans.append((target, relay, "MOQT", a_keys, None))
    source = scenario.holder_of_other
    others = [i for i in instances if i != source and i not in [plan[0] for plan in plans]]
    if source and (target := _without(scenario, others, b_keys)):
        scenario.await_published(source, b_keys)
        plans.append((target, source, "HTTP", b_keys, scenario.other_system))
    if len(plans) < 1 + bool(cluster.relay_link and relay):
        scenario.figures.missing.append(
            "a prefetch directive: no instance was left that holds none of its prefix"
        )
    rows = [_load(scenario, t, origin, transport, keys) for t, origin, transport, keys, _ in plans]
    console.table(["target", "source", "transport", "loaded", "KiB", "seconds", "MB/s"], rows)
    served = [
        scenario.serve_at(
            f"R: prompt {'A' if system is None else 'B'} at {scenario.name(t)}", t, system
        )
        for t, _, _, _, system in plans
    ]
    if served:
        scenario.placement_table(served)
        for placement in served:
            scenario.file_ttft(placement)


def _without(scenario: Scenario, candidates: Sequence[str], keys: Sequence[BlockKey]) -> str | None:
    """The first of ``candidates`` that the IS names as holder of none of ``keys``."""
    held = set().union(*scenario.client.holders(keys))
    return next((url for url in candidates if url not in held), None)


def _load(
    scenario: Scenario, target: str, source: str, transport: str, keys: Sequence[BlockKey]
) -> list[object]:
    """Send one directive naming ``source`` for every key and wait for its outcome."""
    client = scenario.client
    began = time.perf_counter()
    directive = client.prefetch(target, keys, [source])
    outcome = client.directive_outcome(target, directive)
    seconds = time.perf_counter() - began
    loaded = [BlockKey(bytes.fromhex(k)) for k in outcome.get("loaded") or []]
    octets = sum(
        int(record["size"])
        for records in client.lookup(loaded)
        for record in records
        if record["holder"] == source
    )
    scenario.figures.moved(transport, len(loaded), octets)
    if outcome["state"] != "complete":
        scenario.console.line(
            f"directive at {scenario.name(target)} ended {outcome['state']}: "
            f"{outcome.get('detail', '')}"
        )
    return [
        scenario.name(target),
        scenario.name(source),
        transport,
        f"{len(loaded)}/{len(keys)}",
        round(octets / 1024),
        round(seconds, 2),
        round(octets / seconds / 1e6, 1) if seconds > 0 else None,
    ]
