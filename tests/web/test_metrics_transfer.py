"""The fetching and the serving ends of a block transfer count the same octets under the same
transport (kvsp.web.metrics, kvsp.web.meters; spec §6.5, §6.7; DESIGN.md §4), between real
processes on 127.0.0.1.

``kvsp serve control``, ``kvsp serve relay --index`` and two toy-engine instances: A computes
a prompt's two blocks and publishes them, at the IS (its holder face) and into the relay (MOQT).
A directive makes B load the first block from A's holder face over HTTP and the second from
the relay's cache over MOQT; then B generates on that prefix. Scraped from each process: B's
``kvsp_block_fetched_bytes_total{transport,source}`` equals, per transport, the
``kvsp_block_served_bytes_total{transport}`` of A and the relay; B's fetch histograms count
one fetch per source; its prefix cache counters count the directive's and the prompt's tokens.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsp.compat import compat_id
from kvsp.engine.toy import toy_descriptor
from kvsp.ids import ScopeId
from kvsp.keys import block_keys, scope_id
from kvsp.web.auth import principal_entry, write_principals
from tests.support.polling import eventually
from tests.support.services import Services

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
ADMIN = "metrics-admin-token-0123456789abcdef01"
AUTH = {"authorization": f"Bearer {ADMIN}"}
SCOPE_KEY = bytes(range(60, 92))
SCOPE = ScopeId(scope_id(SCOPE_KEY))
DESCRIPTOR = toy_descriptor(layers=4, block_tokens=16)
COMPAT = compat_id(DESCRIPTOR)
B = DESCRIPTOR.block_tokens
PROMPT = [(37 * i + 11) % 40_000 for i in range(2 * B + 5)]  # two complete blocks
KEYS = block_keys(SCOPE_KEY, COMPAT, PROMPT, B)

Samples = list[tuple[str, dict[str, str], float]]


def scrape(http: httpx.Client, base: str) -> Samples:
    """Every sample of ``base``'s /metrics, parsed by prometheus_client's own parser."""
    answer = http.get(f"{base}metrics")
    assert answer.status_code == 200, answer.text
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())


def sources(samples: Samples, name: str, transport: str) -> set[str]:
    return {ls["source"] for n, ls, _ in samples if n == name and ls["transport"] == transport}


def holders(http: httpx.Client, control: str) -> list[set[str]] | None:
    """The holders the IS lists for each key (None until every key has two)."""
    body = {
        "scope_id": SCOPE.hex(),
        "compat_id": COMPAT.hex(),
        "block_keys": [k.hex() for k in KEYS],
    }
    answer = http.post(f"{control}lookup", json=body).json()
    found = [{r["holder"] for r in records} for records in answer.get("replicas") or []]
    return found if len(found) == len(KEYS) and all(len(h) >= 2 for h in found) else None


def test_fetched_and_served_octets_agree_per_transport(tmp_path: Path) -> None:
    principals = tmp_path / "principals.toml"
    write_principals(principals, [principal_entry("admin", ADMIN, ["admin"], None)])
    token = tmp_path / "admin.token"
    token.write_text(ADMIN)
    scope_key = tmp_path / "scope.key"
    scope_key.write_text(SCOPE_KEY.hex())
    descriptor = tmp_path / "descriptor.json"
    descriptor.write_text(json.dumps(DESCRIPTOR.to_json()))
    services = Services(tmp_path, principals)
    try:
        control = services.start("control", "control")
        relay = services.start(
            "relay", "relay", "--index", control.base_url, "--token-file", str(token)
        )
        faces = json.loads(relay.base_url)
        cert = tmp_path / "relay" / "state" / "relay-tls" / "cert.pem"
        common = [
            *("instance", "--pc", control.base_url, "--token-file", str(token)),
            *("--descriptor", str(descriptor), "--scope-key-file", str(scope_key)),
            *("--cafile", str(cert)),
        ]
        a = services.start("a", *common, "--relay", faces["moqt"])
        b = services.start("b", *common)
        with httpx.Client(timeout=30, headers=AUTH) as http:
            run(http, control.base_url, a.base_url, b.base_url, faces)
    finally:
        services.stop_all()


def run(http: httpx.Client, control: str, a: str, b: str, faces: dict[str, str]) -> None:
    computed = http.post(f"{a}generate", json={"prompt": PROMPT, "max_tokens": 2})
    assert computed.status_code == 200, computed.text
    assert computed.headers["kvsp-computed-blocks"] == "2"
    relay_moqt = faces["moqt"] if faces["moqt"].endswith("/") else faces["moqt"] + "/"
    found = eventually(lambda: holders(http, control), 30, "A's and the relay's records")
    assert all({a, relay_moqt} <= held for held in found), found

    # B loads block 0 from A over HTTP, block 1 from the relay over MOQT
    directive: dict[str, Any] = {
        "directive": str(uuid.uuid4()),
        "scope_id": SCOPE.hex(),
        "compat_id": COMPAT.hex(),
        "blocks": [
            {"block_key": KEYS[0].hex(), "sources": [a]},
            {"block_key": KEYS[1].hex(), "sources": [relay_moqt]},
        ],
        "layer_order": "ascending",
        "deadline_ms": 30_000,
        "lease_ms": 10_000,
    }
    answer = http.post(f"{b}prefetch", json=directive)
    assert answer.status_code == 202, answer.text
    where = answer.headers["location"]

    def finished() -> dict[str, Any] | None:
        status: dict[str, Any] = http.get(where).json()
        return status if status["state"] != "pending" else None

    status = eventually(finished, 60, "the directive to finish")
    assert status["state"] == "complete", status
    reused = http.post(f"{b}generate", json={"prompt": PROMPT, "max_tokens": 2})
    assert reused.status_code == 200, reused.text
    assert reused.headers["kvsp-loaded-blocks"] == "2"

    at_a, at_b = scrape(http, a), scrape(http, b)
    at_relay = scrape(http, faces["http"])
    fetched, served = "kvsp_block_fetched_bytes_total", "kvsp_block_served_bytes_total"
    for transport in ("http", "moqt"):
        got = total(at_b, fetched, transport=transport)
        sent = total(at_a, served, transport=transport) + total(
            at_relay, served, transport=transport
        )
        assert got > 0 and got == sent, (transport, got, sent)
        # the generic octet counter of each end agrees with the named ones
        assert (
            total(at_b, "kvsp_block_bytes_total", transport=transport, direction="received") == got
        )
    # HTTP from A's holder face (a container: header and layers), MOQT from the relay (layers)
    assert total(at_a, served, transport="http") > total(at_relay, served, transport="moqt") > 0
    assert total(at_relay, served, transport="http") == 0
    assert total(at_a, served, transport="moqt") == 0

    duration = "kvsp_block_fetch_duration_seconds"
    assert sources(at_b, fetched, "http") == sources(at_b, f"{duration}_count", "http") == {a}
    assert sources(at_b, fetched, "moqt") == {relay_moqt}
    for transport, source in (("http", a), ("moqt", relay_moqt)):
        where_ = {"transport": transport, "source": source}
        assert total(at_b, f"{duration}_count", **where_) == 1
        assert total(at_b, f"{duration}_bucket", le="+Inf", **where_) == 1
        assert total(at_b, f"{duration}_sum", **where_) > 0

    # prefix cache, in tokens: the directive asked for two blocks and loaded both; the prompt
    # found both held
    assert total(at_b, "kvsp_prefix_cache_queries_total", path="prefetch") == 2 * B
    assert total(at_b, "kvsp_prefix_cache_hits_total", path="prefetch") == 2 * B
    assert total(at_b, "kvsp_prefix_cache_queries_total", path="generate") == len(PROMPT)
    assert total(at_b, "kvsp_prefix_cache_hits_total", path="generate") == 2 * B
    assert total(at_a, "kvsp_prefix_cache_hits_total", path="generate") == 0
    for samples in (at_a, at_b):
        assert total(samples, "kvsp_time_to_first_token_seconds_count") == 1
