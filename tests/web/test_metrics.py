"""Prometheus metrics of every service (kvsp.web.metrics): request counts by route template,
the scrape-only role, and the domain metrics at the points that count them. In-process apps,
one real process (an instance that runs a directive), and a real MOQT relay for its octets."""

from __future__ import annotations

import platform
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import kvsp
from kvsp.compat import compat_id
from kvsp.container import encode_container
from kvsp.index import holder_id_of
from kvsp.keys import block_keys
from kvsp.records import InstanceStatusRecord, ReplicaRecord
from kvsp.registries import InstanceState
from kvsp.web.metrics import ARRIVED, arrival
from kvsp.web.testing import InProcessClient, start_process
from moqt.certs import make_self_signed
from tests.support import SUPPORT
from tests.support import operations as ops
from tests.support import relay_kit as kit
from tests.support.polling import eventually, until

HELPERS = SUPPORT / "operations.py"
COMPAT = compat_id(ops.DESCRIPTOR)
SCOPE_HEX = ops.SCOPE.hex()
KEYS = block_keys(ops.SCOPE_KEY, COMPAT, list(range(16)), 4)
STARTED = time.time()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, by name and label set."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [
        v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= set(ls)
    ]
    assert len(found) <= 1, f"{name}{labels}: {len(found)} samples"
    return found[0] if found else None


def scrape(client: InProcessClient) -> str:
    response = client.get("/metrics", headers=ops.METRICS)
    assert response.status_code == 200, response.text
    return response.text


def record(key: bytes, holder: str = "http://h1.test/") -> ReplicaRecord:
    digest = bytes(32)
    return ReplicaRecord(
        block_key=key,
        compat_id=COMPAT,
        scope_id=ops.SCOPE,
        holder=holder,
        codec=1,
        size=1024,
        digest=digest,
        layer_digests=None,
        residency=None,
        ttl_ms=60_000,
    )


def put_replica(client: InProcessClient, key: bytes, holder: str = "http://h1.test/") -> None:
    path = f"/replicas/{COMPAT.hex()}/{SCOPE_HEX}/{key.hex()}/{holder_id_of(holder).hex()}"
    response = client.put(path, json=record(key, holder).to_json(), headers=ops.ADMIN)
    assert response.status_code == 200, response.text


# --- access -----------------------------------------------------------------------------------


@pytest.mark.parametrize("service", ops.SERVICES)
def test_metrics_need_the_metrics_role(service: str, tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app(service, tmp_path))
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=ops.CLIENT).status_code == 403
    assert client.get("/metrics", headers=ops.ADMIN).status_code == 200
    response = client.get("/metrics", headers=ops.METRICS)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert value(response.text, "kvsp_http_requests_total", route="/metrics", status="401") == 1


def test_the_metrics_role_opens_nothing_else(tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app("index", tmp_path))
    put_replica(client, KEYS[0])
    body = {"scope_id": SCOPE_HEX, "compat_id": COMPAT.hex(), "block_keys": [KEYS[0].hex()]}
    assert client.post("/lookup", json=body, headers=ops.ADMIN).json()["matched"] == 1
    # The role reads /metrics only (kvsp.web.roles): no lookup, no publishing.
    assert client.post("/lookup", json=body, headers=ops.METRICS).status_code == 403
    path = f"/replicas/{COMPAT.hex()}/{SCOPE_HEX}/{KEYS[1].hex()}/{holder_id_of('http://h1.test/').hex()}"
    refused = client.put(path, json=record(KEYS[1]).to_json(), headers=ops.METRICS)
    assert refused.status_code == 403


# --- requests ---------------------------------------------------------------------------------


def test_requests_are_counted_by_route_template_not_path(tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app("index", tmp_path))
    for key in KEYS[:3]:
        put_replica(client, key)
    assert client.get("/no/such/resource", headers=ops.ADMIN).status_code == 404
    bad = f"/replicas/{COMPAT.hex()}/{SCOPE_HEX}/NOT-HEX/{'0' * 32}"
    assert client.put(bad, json={}, headers=ops.ADMIN).status_code == 400
    text = scrape(client)
    template = "/replicas/{compat}/{scope}/{key}/{holder_id}"
    put = {"service": "index", "route": template, "method": "PUT"}
    assert value(text, "kvsp_http_requests_total", status="200", **put) == 3
    assert value(text, "kvsp_http_requests_total", status="400", **put) == 1
    assert value(text, "kvsp_http_requests_total", route="<unmatched>", status="404") == 1
    assert value(text, "kvsp_http_request_duration_seconds_count", **put) == 4
    # Aggregates only: no scope id, block key or holder in any label or value.
    for secret in (SCOPE_HEX, KEYS[0].hex(), "h1.test", "NOT-HEX"):
        assert secret not in text


def test_a_server_error_is_counted_as_500(tmp_path: Path) -> None:
    app = ops.build_app("holder", tmp_path)

    async def boom(request: Request) -> None:
        raise RuntimeError("broken on purpose")

    # in place of a route that has a role rule (a route without one is refused before it runs)
    app.router.routes.insert(0, Route("/healthz", boom, methods=["GET"]))
    client = InProcessClient(app)
    assert client.get("/healthz").status_code == 500
    assert value(scrape(client), "kvsp_http_requests_total", route="/healthz", status="500") == 1


def test_the_middleware_notes_when_a_request_arrived(tmp_path: Path) -> None:
    app = ops.build_app("holder", tmp_path)
    seen: list[tuple[float, object, float]] = []

    async def probe(request: Request) -> Response:
        seen.append((arrival(request), request.scope.get(ARRIVED), time.perf_counter()))
        return Response(b"")

    app.router.routes.insert(0, Route("/healthz", probe, methods=["GET"]))
    assert InProcessClient(app).get("/healthz").status_code == 200
    [(arrived, noted, handled)] = seen
    assert isinstance(noted, float) and arrived == noted <= handled  # before the handler ran


def test_every_app_has_its_own_registry(tmp_path: Path) -> None:
    first = InProcessClient(ops.build_app("index", tmp_path / "a"))
    second = InProcessClient(ops.build_app("index", tmp_path / "b"))
    put_replica(first, KEYS[0])
    assert value(scrape(first), "kvsp_replicas") == 1
    assert value(scrape(second), "kvsp_replicas") == 0
    template = "/replicas/{compat}/{scope}/{key}/{holder_id}"
    assert value(scrape(second), "kvsp_http_requests_total", route=template) is None


# --- domain metrics ---------------------------------------------------------------------------


def test_index_counts_replicas_lookups_and_the_hit_ratio(tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app("index", tmp_path))
    put_replica(client, KEYS[0])
    put_replica(client, KEYS[1])
    put_replica(client, KEYS[1], holder="http://h2.test/")
    body = {"scope_id": SCOPE_HEX, "compat_id": COMPAT.hex(), "block_keys": [k.hex() for k in KEYS]}
    answer = client.post("/lookup", json=body, headers=ops.ADMIN)
    assert answer.json()["matched"] == 2
    text = scrape(client)
    assert value(text, "kvsp_replicas") == 3
    assert value(text, "kvsp_lookups_total", via="lookup") == 1
    assert value(text, "kvsp_lookup_keys_total", via="lookup", result="asked") == len(KEYS)
    assert value(text, "kvsp_lookup_keys_total", via="lookup", result="matched") == 2
    assert value(text, "kvsp_cache_hit_ratio", via="lookup") == pytest.approx(2 / len(KEYS))


def _status(instance: str, state: InstanceState = InstanceState.ACTIVE) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance,
        epoch=1,
        state=state,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.0,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
        links=(),
        requested_state=None,
        ttl_ms=60_000,
    )


def test_pc_counts_instance_states_placements_and_directive_outcomes(tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app("control", tmp_path))
    instance = "http://127.0.0.1:9/"
    path = f"/instances/{holder_id_of(instance).hex()}/status"
    assert client.put(path, json=_status(instance).to_json(), headers=ops.ADMIN).status_code == 200
    # A cached prefix makes the PC send a directive, which the (unreachable) instance refuses.
    assert client.put(
        f"/descriptors/{COMPAT.hex()}", json=ops.DESCRIPTOR.to_json(), headers=ops.ADMIN
    ).status_code in (200, 201)
    put_replica(client, KEYS[0])
    place = {
        "scope_id": SCOPE_HEX,
        "compat_id": COMPAT.hex(),
        "block_keys": [k.hex() for k in KEYS],
        "prompt_tokens": 64,
    }
    answer = client.post("/place", json=place, headers=ops.ADMIN)
    text = scrape(client)
    assert value(text, "kvsp_instances", state="active") == 1
    assert value(text, "kvsp_instances", state="failed") == 0
    assert value(text, "kvsp_lookups_total", via="place") == (
        1 if answer.status_code == 200 else None
    )
    sent = value(text, "kvsp_directive_outcomes_total", outcome="sent")
    failed = value(text, "kvsp_directive_outcomes_total", outcome="failed")
    assert (sent, failed) == (0, 1), answer.text


def _block(key: bytes) -> bytes:
    d = ops.DESCRIPTOR
    section = d.block_tokens * d.kv_heads * d.head_dim * 2  # fp16
    layers = [(bytes([i + 1]) * section, bytes([i + 2]) * section) for i in range(d.layers)]
    return encode_container(layers, first_layer=0, token_count=d.block_tokens)


def test_holder_counts_leases_and_block_octets(tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app("holder", tmp_path))
    path = f"/blocks/{COMPAT.hex()}/{SCOPE_HEX}/{KEYS[0].hex()}"
    data = _block(KEYS[0])
    headers = {**ops.ADMIN, "if-none-match": "*", "content-type": "application/kvsp-block"}
    assert client.put(path, content=data, headers=headers).status_code == 201, path
    got = client.get(path, headers=ops.ADMIN)
    part = client.get(path, params={"layers": "1-1"}, headers=ops.ADMIN)
    assert got.content == data
    lease = {
        "compat_id": COMPAT.hex(),
        "scope_id": SCOPE_HEX,
        "block_keys": [KEYS[0].hex()],
        "ttl_ms": 30_000,
    }
    assert client.post("/leases", json=lease, headers=ops.ADMIN).status_code == 201
    text = scrape(client)
    assert value(text, "kvsp_block_bytes_total", transport="http", direction="received") == len(
        data
    )
    sent = len(got.content) + len(part.content)
    assert value(text, "kvsp_block_bytes_total", transport="http", direction="sent") == sent
    # the serving side's count, named like the fetching side's kvsp_block_fetched_bytes
    assert value(text, "kvsp_block_served_bytes_total", transport="http") == sent
    assert value(text, "kvsp_block_served_bytes_total", transport="moqt") == 0
    assert value(text, "kvsp_leases_active") == 1
    assert value(text, "kvsp_leased_blocks") == 1


def test_relay_face_counts_leases(tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app("relay", tmp_path))
    text = scrape(client)
    assert value(text, "kvsp_leases_active") == 0


def test_instance_process_counts_its_directives_and_state(tmp_path: Path) -> None:
    with start_process([sys.executable, str(HELPERS), "instance"], workdir=tmp_path) as service:
        directive = {
            "directive": str(uuid.uuid4()),
            "scope_id": SCOPE_HEX,
            "compat_id": COMPAT.hex(),
            "blocks": [{"block_key": KEYS[0].hex(), "sources": ["http://127.0.0.1:9/"]}],
            "layer_order": "ascending",
            "deadline_ms": 5_000,
            "lease_ms": 1_000,
        }
        with httpx.Client(base_url=service.base_url, headers=ops.ADMIN, timeout=10) as http:
            assert http.post("prefetch", json=directive).status_code == 202
            where = f"prefetch/{directive['directive']}"
            eventually(  # the IS knows no replica: it fails at once
                lambda: http.get(where).json()["state"] != "pending",
                timeout=5,
                what="the directive to end",
            )
            text = http.get("metrics").text
    assert value(text, "kvsp_directive_outcomes_total", outcome="failed") == 1
    assert value(text, "kvsp_directive_outcomes_total", outcome="complete") == 0
    assert value(text, "kvsp_instance_state", state="active") == 1
    assert value(text, "kvsp_instance_state", state="sleeping") == 0


def test_relay_counts_moqt_payload_octets(tmp_path: Path) -> None:
    certs = make_self_signed("localhost", tmp_path / "certs")
    block = kit.make_block(7, layers=3, size=4096)
    payload = sum(len(layer) for layer in block.layers)
    face = ops.build_app("relay", tmp_path)

    async def scenario() -> str:
        async with kit.running_relay(kit.relay_config(certs)) as relay:
            face.state.relay = relay
            tracks = kit.block_track(block)
            async with (
                kit.publishing(relay.url, certs, tracks, [block.namespace[:4]]),
                kit.client(relay.url, certs) as consumer,
            ):
                objects = await kit.fetch_all(consumer, block.track, len(block.layers))
                assert [bytes(o.payload) for o in objects] == list(block.layers)
            await until(lambda: not relay._peers)
            transport = httpx.ASGITransport(app=face)
            async with httpx.AsyncClient(transport=transport, base_url="http://face/") as http:
                return (await http.get("/metrics", headers=ops.METRICS)).text

    text = kit.run(scenario())
    # Received from the publisher, sent to the consumer; sessions that ended still count.
    assert value(text, "kvsp_block_bytes_total", transport="moqt", direction="received") == payload
    assert value(text, "kvsp_block_bytes_total", transport="moqt", direction="sent") == payload
    assert value(text, "kvsp_block_served_bytes_total", transport="moqt") == payload


# --- build info and process metrics -----------------------------------------------------------


@pytest.mark.parametrize("service", ops.SERVICES)
def test_every_service_has_build_info_and_process_metrics(service: str, tmp_path: Path) -> None:
    text = scrape(InProcessClient(ops.build_app(service, tmp_path)))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    info = families["kvsp_build_info"]
    assert info.type == "gauge"
    [sample] = info.samples
    assert sample.value == 1
    assert sample.labels["service"] == service
    assert sample.labels["version"] == kvsp.__version__
    assert sample.labels["python"] == platform.python_version()
    assert sample.labels["platform"] == sys.platform
    assert families["python_info"].samples[0].value == 1
    if Path("/proc/self/stat").exists():  # Linux: read from /proc/self
        assert families["process_resident_memory_bytes"].samples[0].value > 0
        assert families["process_open_fds"].samples[0].value > 0
        assert families["process_cpu_seconds"].type == "counter"
        started = families["process_start_time_seconds"].samples[0].value
        assert 0 < started <= time.time()
    else:  # absent where there is no /proc, never made up
        assert "process_resident_memory_bytes" not in families


def test_a_served_process_reports_its_own_process_metrics(tmp_path: Path) -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("no /proc: the process metrics are absent by design")
    with start_process([sys.executable, str(HELPERS), "index"], workdir=tmp_path) as service:
        text = httpx.get(f"{service.base_url}metrics", headers=ops.METRICS, timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # the served process's, not this test's: its start time is after this test began
    assert families["process_start_time_seconds"].samples[0].value >= STARTED - 1
    assert families["process_resident_memory_bytes"].samples[0].value > 0


# --- prefix cache and time to first token -------------------------------------------------------


def test_instance_process_counts_prefix_cache_tokens_and_time_to_first_token(
    tmp_path: Path,
) -> None:
    prompt = list(range(100, 110))  # two whole blocks of 4 tokens, and 2 more
    block_tokens = ops.DESCRIPTOR.block_tokens
    with (
        start_process([sys.executable, str(HELPERS), "instance"], workdir=tmp_path) as service,
        httpx.Client(base_url=service.base_url, headers=ops.ADMIN, timeout=30) as http,
    ):
        loaded = []
        for _ in range(2):  # the second finds the first's blocks held
            answer = http.post("generate", json={"prompt": prompt, "max_tokens": 3})
            assert answer.status_code == 200, answer.text
            assert len(answer.text.splitlines()) == 3
            loaded.append(int(answer.headers["kvsp-loaded-blocks"]))
        nothing = http.post("generate", json={"prompt": prompt, "max_tokens": 0})
        assert nothing.status_code == 200 and nothing.text == ""
        text = http.get("metrics", headers=ops.METRICS).text
    assert loaded == [0, len(prompt) // block_tokens]
    generate = {"path": "generate"}
    assert value(text, "kvsp_prefix_cache_queries_total", **generate) == 3 * len(prompt)
    hits = 2 * (len(prompt) // block_tokens) * block_tokens  # the second and third requests
    assert value(text, "kvsp_prefix_cache_hits_total", **generate) == hits
    assert value(text, "kvsp_prefix_cache_queries_total", path="prefetch") == 0
    # two generations produced a first token; the one of max_tokens 0 none
    assert value(text, "kvsp_time_to_first_token_seconds_count") == 2
    assert value(text, "kvsp_time_to_first_token_seconds_bucket", le="+Inf") == 2
    total = value(text, "kvsp_time_to_first_token_seconds_sum")
    assert total is not None and total > 0
    buckets = sorted(
        (float(dict(labels)["le"]), count)
        for (name, labels), count in samples(text).items()
        if name == "kvsp_time_to_first_token_seconds_bucket"
    )
    counts = [count for _, count in buckets]
    assert counts == sorted(counts) and len(counts) == 23  # cumulative, vLLM's bounds and +Inf
