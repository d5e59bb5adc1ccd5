"""The holder's HTTP face in-process: every route, with bad input (§6.6, §6.7, RFC 9530)."""

from __future__ import annotations

import argparse
import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Geometry, decode_container, encode_container
from kvsp.errors import BadRequest
from kvsp.leases import LeaseQuota
from kvsp.registries import Tier
from kvsp.services.holder.app import configure_parser, create_holder_app, holder_config
from kvsp.services.holder.service import Holder, HolderConfig
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.cliargs import add_common_arguments, parse_size
from kvsp.web.clock import ManualClock
from kvsp.web.testing import InProcessClient

DESCRIPTOR = CompatibilityDescriptor(
    model="tiny",
    model_digest=b"\x01" * 32,
    tokenizer_digest=b"\x02" * 32,
    layers=4,
    kv_heads=1,
    head_dim=4,
    kv_dtype="fp16",
    positional="rope",
    block_tokens=2,
)
GEOMETRY = Geometry.from_descriptor(DESCRIPTOR)
COMPAT = compat_id(DESCRIPTOR).hex()
SCOPE = "0a" * 16
OTHER = "0b" * 16
TOKEN = "alice-token-0123456789abcdefghijklmnop"
MALLORY_TOKEN = "mallory-token-0123456789abcdefghijklm"
ALICE = {"authorization": f"Bearer {TOKEN}"}
MALLORY = {"authorization": f"Bearer {MALLORY_TOKEN}"}
PUT_HEADERS = ALICE | {"if-none-match": "*", "content-type": "application/kvsp-block"}
BODY_LIMIT = 4096


def key(n: int) -> str:
    return f"{n:02x}" * 32


def url(n: int, compat: str = COMPAT, scope: str = SCOPE) -> str:
    return f"/blocks/{compat}/{scope}/{key(n)}"


def container(seed: int, first: int = 0, count: int = 4) -> bytes:
    section = GEOMETRY.section_length(2)
    layers = [
        (bytes([seed, i]) * (section // 2), bytes([i, seed]) * (section // 2))
        for i in range(first, first + count)
    ]
    return encode_container(layers, first_layer=first, token_count=2, geometry=GEOMETRY)


SIZE = len(container(0))


def digest_field(data: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


class App:
    """The holder app in-process, with the holder and clock at hand."""

    def __init__(self) -> None:
        self.clock = ManualClock(1_000_000)
        registry = DescriptorRegistry()
        registry.add(DESCRIPTOR)
        self.registry = registry
        self.config = HolderConfig(
            public_url="http://testserver/",
            tiers={Tier.HOST: 3 * SIZE},
            record_ttl_ms=60_000,
            lease_quota=LeaseQuota(
                max_octets_per_client=3 * SIZE, max_ttl_ms=10_000, max_leases_per_client=4
            ),
            body_limit=BODY_LIMIT,
        )
        self.holder = Holder(self.config, index=None, descriptors=registry, clock=self.clock)
        principals = Principals.from_entries(
            [
                principal_entry("alice", TOKEN, ["holder"], [bytes.fromhex(SCOPE)]),
                principal_entry("mallory", MALLORY_TOKEN, ["client"], [bytes.fromhex(OTHER)]),
            ]
        )
        app = create_holder_app(self.holder, principals, self.clock, self.config)
        self.client = InProcessClient(app)

    def state(self) -> Any:
        """Everything a bad request must leave alone."""
        blocks = {b.meta.ref: (b.tier, bytes(self.holder.store.read(b))) for b in self.holder.store}
        return blocks, len(self.holder.leases), len(self.registry)

    def put(self, n: int, data: bytes | None = None, **headers: str) -> Any:
        body = container(n) if data is None else data
        return self.client.put(url(n), content=body, headers=PUT_HEADERS | headers)


@pytest.fixture
def app() -> Iterator[App]:
    yield App()


def assert_problem(response: Any, status: int, problem: str, path: str | None = None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["type"] == f"urn:ietf:params:kvsp:problem:{problem}"
    if path is not None:
        assert body.get("path") == path, body


# -- blocks ------------------------------------------------------------------------------------


def test_healthz_needs_no_token(app: App) -> None:
    response = app.client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_put_then_get(app: App) -> None:
    put = app.put(1, **{"repr-digest": digest_field(container(1))})
    assert put.status_code == 201, put.text
    assert put.headers["location"] == f"http://testserver{url(1)}"
    assert put.headers["repr-digest"] == digest_field(container(1))
    assert put.json()["size"] == SIZE and put.json()["holder"] == "http://testserver/"
    got = app.client.get(url(1), headers=ALICE)
    assert got.status_code == 200
    assert got.content == container(1)
    assert got.headers["content-type"] == "application/kvsp-block"
    assert got.headers["content-length"] == str(SIZE)
    assert got.headers["repr-digest"] == digest_field(container(1))
    assert got.headers["cache-control"] == "private, immutable, max-age=60"


def test_get_a_layer_range(app: App) -> None:
    app.put(1)
    got = app.client.get(url(1) + "?layers=1-2&codec=1", headers=ALICE)
    expected = decode_container(container(1)).select(1, 2).encode()
    assert got.status_code == 200 and got.content == expected
    assert got.headers["repr-digest"] == digest_field(expected)
    assert got.headers["content-length"] == str(len(expected))


@pytest.mark.parametrize(
    ("query", "status", "problem", "path"),
    [
        ("layers=3-1", 400, "kvsp-bad-request", "layers"),
        ("layers=a-b", 400, "kvsp-bad-request", "layers"),
        ("layers=-1-2", 400, "kvsp-bad-request", "layers"),
        ("layers=0-99999999999", 400, "kvsp-bad-request", "layers"),
        ("layers=1", 400, "kvsp-bad-request", "layers"),
        ("layers=1-2&layers=1-2", 400, "kvsp-bad-request", "layers"),
        ("layers=3-4", 404, "kvsp-layers-unavailable", None),
        ("codec=2", 406, "kvsp-incompatible", None),
        ("codec=abc", 400, "kvsp-bad-request", "codec"),
        ("codec=65536", 400, "kvsp-bad-request", "codec"),
    ],
)
def test_bad_query_parameters(app: App, query: str, status: int, problem: str, path: str) -> None:
    app.put(1)
    before = app.state()
    assert_problem(app.client.get(f"{url(1)}?{query}", headers=ALICE), status, problem, path)
    assert app.state() == before


def test_a_block_not_held(app: App) -> None:
    assert_problem(app.client.get(url(5), headers=ALICE), 404, "kvsp-not-found")


@pytest.mark.parametrize(
    ("path", "name"),
    [
        (f"/blocks/{COMPAT.upper()}/{SCOPE}/{key(1)}", "compat"),
        (f"/blocks/{COMPAT[:-2]}/{SCOPE}/{key(1)}", "compat"),
        (f"/blocks/{COMPAT}/{SCOPE[:-1]}/{key(1)}", "scope"),
        (f"/blocks/{COMPAT}/{SCOPE.upper()}/{key(1)}", "scope"),
        (f"/blocks/{COMPAT}/{SCOPE}/{key(1)}00", "key"),
        (f"/blocks/{COMPAT}/{SCOPE}/{'g' * 64}", "key"),
    ],
)
def test_bad_path_parameters(app: App, path: str, name: str) -> None:
    app.put(1)
    before = app.state()
    assert_problem(app.client.get(path, headers=ALICE), 400, "kvsp-bad-request", name)
    response = app.client.put(path, content=container(1), headers=PUT_HEADERS)
    assert_problem(response, 400, "kvsp-bad-request", name)
    assert app.state() == before


def test_put_needs_if_none_match_star(app: App) -> None:
    headers = ALICE | {"content-type": "application/kvsp-block"}
    response = app.client.put(url(1), content=container(1), headers=headers)
    assert_problem(response, 428, "kvsp-bad-request", "If-None-Match")
    response = app.client.put(
        url(1), content=container(1), headers=headers | {"if-none-match": '"x"'}
    )
    assert response.status_code == 428
    assert app.state()[0] == {}


def test_a_second_put_is_412_and_keeps_the_first_bytes(app: App) -> None:
    app.put(1)
    before = app.state()
    assert_problem(app.put(1, container(9)), 412, "kvsp-conflict")
    assert app.client.get(url(1), headers=ALICE).content == container(1)
    assert app.state() == before


def test_an_oversized_body_is_413(app: App) -> None:
    app.put(1)
    before = app.state()
    assert_problem(app.put(2, b"KVB1" + bytes(BODY_LIMIT)), 413, "kvsp-bad-request")
    assert app.state() == before


def test_bad_bodies(app: App) -> None:
    app.put(1)
    before = app.state()
    assert_problem(app.put(2, b"not a container"), 400, "kvsp-bad-request")
    assert_problem(app.put(2, container(2)[:-3]), 400, "kvsp-bad-request")
    bad_digest = app.put(2, **{"repr-digest": digest_field(b"other")})
    assert_problem(bad_digest, 422, "kvsp-digest-mismatch", "Repr-Digest")
    bad_content_digest = app.put(2, **{"content-digest": digest_field(b"other")})
    assert_problem(bad_content_digest, 422, "kvsp-digest-mismatch")
    assert_problem(app.put(2, **{"repr-digest": "sha-256=abc"}), 400, "kvsp-bad-request")
    assert app.put(2, **{"content-type": "text/plain"}).status_code == 415
    assert app.put(2, **{"content-encoding": "gzip"}).status_code == 415
    assert app.state() == before


def test_unknown_compat_is_422(app: App) -> None:
    response = app.client.put(url(1, compat="00" * 32), content=container(1), headers=PUT_HEADERS)
    assert_problem(response, 422, "kvsp-incompatible")
    assert "PUT its descriptor first" in response.json()["detail"]


def test_descriptor_routes_then_a_block_of_that_compat(app: App) -> None:
    other = CompatibilityDescriptor.from_json(DESCRIPTOR.to_json() | {"model": "other"})
    cid = compat_id(other).hex()
    response = app.client.put(f"/descriptors/{cid}", json=other.to_json(), headers=ALICE)
    assert response.status_code == 201, response.text
    assert app.client.get(f"/descriptors/{cid}", headers=ALICE).json()["model"] == "other"
    put = app.client.put(url(1, compat=cid), content=container(1), headers=PUT_HEADERS)
    assert put.status_code == 201


def test_an_unauthorized_scope_is_403_before_anything_else(app: App) -> None:
    app.put(1)
    before = app.state()
    assert_problem(app.client.get(url(1), headers=MALLORY), 403, "kvsp-forbidden")
    # Oversized, and already held: the scope is refused first, before reading the body.
    headers = MALLORY | {"if-none-match": "*"}
    response = app.client.put(url(1), content=bytes(2 * BODY_LIMIT), headers=headers)
    assert_problem(response, 403, "kvsp-forbidden")
    body = {"compat_id": COMPAT, "scope_id": SCOPE, "block_keys": [key(1)], "ttl_ms": 1000}
    assert_problem(app.client.post("/leases", json=body, headers=MALLORY), 403, "kvsp-forbidden")
    assert app.state() == before


def test_no_token_is_401(app: App) -> None:
    response = app.client.get(url(1))
    assert_problem(response, 401, "kvsp-unauthorized")
    assert response.headers["www-authenticate"].startswith("Bearer")


# -- leases ------------------------------------------------------------------------------------


def lease_body(*ns: int, ttl: int = 5_000) -> dict[str, Any]:
    return {
        "compat_id": COMPAT,
        "scope_id": SCOPE,
        "block_keys": [key(n) for n in ns],
        "ttl_ms": ttl,
    }


def test_lease_lifecycle(app: App) -> None:
    app.put(1)
    created = app.client.post("/leases", json=lease_body(1), headers=ALICE)
    assert created.status_code == 201, created.text
    lease = created.json()["lease"]
    assert created.headers["location"] == f"http://testserver/leases/{lease}"
    assert created.json() == {"lease": lease, "ttl_ms": 5_000, "block_keys": [key(1)]}
    renewed = app.client.put(f"/leases/{lease}", json={"ttl_ms": 8_000}, headers=ALICE)
    assert renewed.status_code == 200 and renewed.json()["ttl_ms"] == 8_000
    assert app.client.delete(f"/leases/{lease}", headers=ALICE).status_code == 204
    assert_problem(app.client.delete(f"/leases/{lease}", headers=ALICE), 404, "kvsp-not-found")


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (b"{not json", "$"),
        (b"[]", "$"),
        (b'{"compat_id": 1, "scope_id": "x", "block_keys": [], "ttl_ms": 1}', "$.compat_id"),
        (
            f'{{"compat_id": "{COMPAT}", "scope_id": "{SCOPE}", "block_keys": [], '
            f'"ttl_ms": 5}}'.encode(),
            "$.block_keys",
        ),
        (
            f'{{"compat_id": "{COMPAT}", "scope_id": "{SCOPE}", "block_keys": ["{key(1)}"], '
            f'"ttl_ms": "5"}}'.encode(),
            "$.ttl_ms",
        ),
        (
            f'{{"compat_id": "{COMPAT}", "scope_id": "{SCOPE}", "block_keys": ["{key(1)}"], '
            f'"ttl_ms": 0}}'.encode(),
            "$.ttl_ms",
        ),
    ],
)
def test_bad_lease_requests(app: App, body: bytes, path: str) -> None:
    app.put(1)
    before = app.state()
    headers = ALICE | {"content-type": "application/kvsp+json"}
    response = app.client.post("/leases", content=body, headers=headers)
    assert_problem(response, 400, "kvsp-bad-request", path)
    assert app.state() == before


def test_lease_quota_is_429(app: App) -> None:
    for n in (1, 2, 3):
        app.put(n)
    assert app.client.post("/leases", json=lease_body(1), headers=ALICE).status_code == 201
    before = app.state()
    over = app.client.post("/leases", json=lease_body(2), headers=ALICE)
    assert_problem(over, 429, "kvsp-lease-quota")
    too_long = app.client.post("/leases", json=lease_body(3, ttl=10_001), headers=ALICE)
    assert_problem(too_long, 429, "kvsp-lease-quota", "$.ttl_ms")
    assert app.state() == before


def test_leasing_what_is_not_held_is_404(app: App) -> None:
    app.put(1)
    response = app.client.post("/leases", json=lease_body(1, 7), headers=ALICE)
    assert_problem(response, 404, "kvsp-not-found", "$.block_keys[1]")
    assert len(app.holder.leases) == 0


def test_renewing_bad_or_unknown_leases(app: App) -> None:
    app.put(1)
    lease = app.client.post("/leases", json=lease_body(1), headers=ALICE).json()["lease"]
    before = app.state()
    unknown = app.client.put(f"/leases/{'0' * 32}", json={"ttl_ms": 1000}, headers=ALICE)
    assert_problem(unknown, 404, "kvsp-not-found")
    assert_problem(
        app.client.put("/leases/bad%20id", json={"ttl_ms": 1}, headers=ALICE), 404, "kvsp-not-found"
    )
    not_hers = app.client.put(f"/leases/{lease}", json={"ttl_ms": 1000}, headers=MALLORY)
    assert_problem(not_hers, 404, "kvsp-not-found")
    bad = app.client.put(f"/leases/{lease}", json={"ttl_ms": -1}, headers=ALICE)
    assert_problem(bad, 400, "kvsp-bad-request", "$.ttl_ms")
    assert_problem(
        app.client.put(f"/leases/{lease}", json={"ttl_ms": 99_999}, headers=ALICE),
        429,
        "kvsp-lease-quota",
    )
    assert app.state() == before
    app.clock.advance(5_000)  # the lease has ended
    assert_problem(
        app.client.put(f"/leases/{lease}", json={"ttl_ms": 1000}, headers=ALICE),
        404,
        "kvsp-not-found",
    )


def test_leases_stop_at_half_the_capacity_so_a_put_finds_room(app: App) -> None:
    for n in (1, 2, 3):
        app.put(n)
    assert app.client.post("/leases", json=lease_body(1), headers=ALICE).status_code == 201
    refused = app.client.post("/leases", json=lease_body(2), headers=ALICE)
    assert_problem(refused, 429, "kvsp-lease-quota")
    assert app.put(4).status_code == 201  # evicts 2, the least recently used unleased block
    assert {b.meta.ref.key[0] for b in app.holder.store} == {1, 3, 4}


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MB") == 512_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("2 parsecs")


def parse_options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_common_arguments(parser, 8471)
    configure_parser(parser)
    return parser.parse_args(list(argv))


def test_options_make_the_config(tmp_path: Path) -> None:
    args = parse_options(
        "--state", str(tmp_path), "--tier", "host=2MiB", "--tier", "disk=1GB",
        "--read-mbit-per-s", "disk=8000", "--record-ttl-ms", "9000",
        "--lease-max-octets", "1MiB", "--lease-max-ttl-ms", "500", "--lease-max-count", "3",
        "--body-limit", "1KiB", "--public-url", "http://h.example/kvsp/",
    )  # fmt: skip
    config = holder_config(args)
    assert config.tiers == {Tier.HOST: 2 << 20, Tier.DISK: 10**9}
    assert config.read_mbit_per_s == {Tier.HOST: 400_000.0, Tier.DISK: 8_000.0}
    assert config.store_config().disk_root == tmp_path / "blocks"
    assert (config.record_ttl_ms, config.body_limit) == (9000, 1024)
    assert config.lease_quota == LeaseQuota(
        max_octets_per_client=1 << 20, max_ttl_ms=500, max_leases_per_client=3
    )
    assert config.public_url == "http://h.example/kvsp/"
    assert holder_config(parse_options()).tiers == {Tier.HOST: 1 << 30}


@pytest.mark.parametrize(
    "argv",
    [
        ("--tier", "cache=1GiB"),
        ("--tier", "host"),
        ("--tier", "host=lots"),
        ("--read-mbit-per-s", "disk=-1"),
        ("--record-ttl-ms", "0"),
        ("--body-limit", "0"),
    ],
)
def test_bad_options(argv: tuple[str, ...]) -> None:
    with pytest.raises(argparse.ArgumentError):
        parse_options(*argv)


def test_inconsistent_options() -> None:
    with pytest.raises(BadRequest, match="twice"):
        holder_config(parse_options("--tier", "host=1MiB", "--tier", "host=2MiB"))
    with pytest.raises(BadRequest, match="end in '/'"):
        holder_config(parse_options("--public-url", "http://h.example"))
