"""Step 2 of ``kvsp demo``: prefetch directives move the shared prefix into other instances,
over MOQT through the relay and over HTTP from the instance that computed it, side by side
(spec §6.5 directives, §6.6 leases, §6.7 verified retrieval; DESIGN.md §4 KV blocks over MOQT).

Instances started with ``--relay`` push every block they publish to the relay as a stored
track; the relay caches it and, being a holder, publishes its own Replica Record with its
``moqt://`` URI. One directive names only the relay as source, so the target loads every block
over MOQT (FETCH of the stored track, every layer checked against the record's digests); the
other names only the computing instance's HTTP holder face. Each target then serves a request
with the loaded prefix.
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
    cluster, console = scenario.cluster, scenario.console
    endpoints = cluster.running()
    source = scenario.holder_of_prefix
    keys = scenario.system_keys
    targets = [url for url in endpoints.instances.values() if url != source]
    console.heading(
        f"2. Prefetch: directives load the {len(keys)}-block prefix into other instances over "
        "MOQT through the relay and over HTTP (§6.5, DESIGN §4)"
    )
    plans: list[tuple[str, str, str]] = []  # (target, source, transport)
    relay = endpoints.relay_moqt
    if cluster.relay_link and relay and targets:
        scenario.await_published(relay, keys)
        console.line(
            f"the relay cached the blocks {scenario.name(source)} pushed to it and published "
            f"{len(keys)} replicas of its own at the IS ({relay})"
        )
        plans.append((targets.pop(0), relay, "MOQT"))
    else:
        scenario.figures.missing.append(
            "prefetch over MOQT: `kvsp serve instance` has no --relay option in this build, "
            "so no instance publishes blocks to the relay or loads moqt:// replicas"
        )
    if targets:
        plans.append((targets[0], source, "HTTP"))
    rows = [_load(scenario, target, origin, transport, keys) for target, origin, transport in plans]
    console.table(["target", "source", "transport", "loaded", "KiB", "seconds", "MB/s"], rows)
    served = [scenario.serve_at(f"R: prompt A at {scenario.name(t)}", t) for t, _, _ in plans]
    if served:
        scenario.placement_table(served)
        for placement in served:
            scenario.file_ttft(placement)


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
