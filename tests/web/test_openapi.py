"""The OpenAPI documents stay true (kvsp.web.openapi): every route of every service is
described, and the record schemas agree with the record classes (what they write validates; a
member the schema requires is one the class requires). schemathesis then drives each service
from its document (test_schemathesis.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from starlette.responses import Response
from starlette.routing import Route

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import RecordError
from kvsp.keys import block_keys
from kvsp.records import (
    DirectiveStatus,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PlaceRequest,
    PlaceResponse,
    PrefetchDirective,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    ResumeRequest,
    SessionCheckpoint,
    ShardMap,
    StateAnswer,
)
from kvsp.services.instance.requests import GenerateRequest
from kvsp.web.openapi import OPERATIONS, SCHEMAS, openapi_document, undocumented_routes
from kvsp.web.testing import InProcessClient
from tests.support import operations as ops

COMPAT = compat_id(ops.DESCRIPTOR)
KEYS = block_keys(ops.SCOPE_KEY, COMPAT, list(range(16)), 4)
H = [k.hex() for k in KEYS]
S = ops.SCOPE.hex()
C = COMPAT.hex()
D = "sha-256:" + "ab" * 32
U = "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"


def validator(name: str) -> Any:
    return jsonschema_rs.validator_for(
        {"components": {"schemas": SCHEMAS}, "$ref": f"#/components/schemas/{name}"}
    )


# --- (a) every route is described -----------------------------------------------------------


@pytest.mark.parametrize("service", ops.SERVICES)
def test_every_route_of_every_service_is_in_its_document(service: str, tmp_path: Path) -> None:
    app = ops.build_app(service, tmp_path)
    assert undocumented_routes(app) == []
    document = openapi_document(app, service)
    described = {(m.upper(), p) for p, item in document["paths"].items() for m in item}
    served = {
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert described == served


def test_a_route_without_a_description_is_caught(tmp_path: Path) -> None:
    app = ops.build_app("control", tmp_path)

    async def undescribed(request: Any) -> Response:
        return Response(status_code=204)

    app.router.routes.append(Route("/not-described/{thing}", undescribed, methods=["PUT"]))
    assert undocumented_routes(app) == [("PUT", "/not-described/{thing}")]
    assert "/not-described/{thing}" not in openapi_document(app, "x")["paths"]


@pytest.mark.parametrize("service", ops.SERVICES)
def test_the_document_is_served_without_a_token(service: str, tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app(service, tmp_path))
    response = client.get("/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    document = response.json()
    assert document["openapi"] == "3.1.0"
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert {"/healthz", "/readyz", "/metrics", "/openapi.json"} <= set(document["paths"])


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_operations_are_well_formed() -> None:
    for ref in _refs(OPERATIONS) | _refs(SCHEMAS):
        assert ref.removeprefix("#/components/schemas/") in SCHEMAS, ref
    for (method, path), operation in OPERATIONS.items():
        for status, response in operation["responses"].items():
            if int(status) >= 400:  # RFC 9457 everywhere
                assert list(response["content"]) == ["application/problem+json"], (path, status)
            else:
                assert int(status) < 300
        params = {p["name"] for p in operation.get("parameters", ()) if p["in"] == "path"}
        assert params == set(Route(path, lambda r: None).param_convertors), (method, path)
        public = operation.get("security") == []
        assert public == (path in {"/healthz", "/readyz", "/openapi.json"}), path


def test_media_types_follow_the_spec() -> None:
    block = OPERATIONS[("GET", "/blocks/{compat}/{scope}/{key}")]["responses"]["200"]
    assert list(block["content"]) == ["application/kvsp-block"]  # §11.1
    put = OPERATIONS[("PUT", "/blocks/{compat}/{scope}/{key}")]["requestBody"]
    assert list(put["content"]) == ["application/kvsp-block"]
    generate = OPERATIONS[("POST", "/generate")]["responses"]["200"]
    assert list(generate["content"]) == ["application/x-ndjson"]
    lookup = OPERATIONS[("POST", "/lookup")]
    assert list(lookup["requestBody"]["content"]) == ["application/kvsp+json"]
    assert list(lookup["responses"]["200"]["content"]) == ["application/kvsp+json"]


# --- (b) the record schemas agree with the record classes -----------------------------------

RECORD = {
    "block_key": H[0],
    "compat_id": C,
    "scope_id": S,
    "holder": "https://h1.example/kvsp/",
    "codec": 1,
    "size": 2097152,
    "digest": D,
    "layer_digests": [H[1], H[2]],
    "residency": [
        {"tier": "device", "layers": [0, 0]},
        {"tier": "host", "layers": [1, 1], "read_mbit_per_s": 400000},
    ],
    "ttl_ms": 600000,
    "lease_base": "https://h1.example/kvsp/",
}
STATUS = {
    "instance": "https://ii7.example/kvsp/",
    "epoch": 12,
    "state": "active",
    "running": 18,
    "queued": 3,
    "batch_size": 32,
    "kv_utilization": 0.71,
    "prefill_tokens_per_s": 42000,
    "decode_tokens_per_s": 3100,
    "links": [{"holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12}],
    "requested_state": None,
    "ttl_ms": 3000,
}
CHECKPOINT = {
    "session": U,
    "epoch": 1,
    "compat_id": C,
    "scope_id": S,
    "prompt_blocks": H[:2],
    "prompt_tail": [374, 264],
    "generated": [1296, 315, 279],
    "output_offset": 3,
    "sampler": {"method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": 3,
                "deterministic": False},
}  # fmt: skip
EXAMPLES: dict[str, tuple[dict[str, Any], Callable[[Any], Any]]] = {
    "ReplicaRecord": (RECORD, ReplicaRecord.from_json),
    "LookupRequest": (
        {"scope_id": S, "compat_id": C, "block_keys": H[:3],
         "targets": ["https://ii7.example/kvsp/"], "compact": True},
        LookupRequest.from_json,
    ),
    "LookupResponse": (
        {"matched": 1, "replicas": [[{**RECORD, "block_key": H[0]}]],
         "estimates": {"https://ii7.example/kvsp/": {"fetch_us": 10, "recompute_us": 20}},
         "hint": "why"},
        LookupResponse.from_json,
    ),
    "InstanceStatusRecord": (STATUS, InstanceStatusRecord.from_json),
    "StateAnswer": ({"state": "draining"}, StateAnswer.from_json),
    "PlaceRequest": (
        {"scope_id": S, "compat_id": C, "block_keys": H[:2], "prompt_tokens": 9,
         "session": U, "request_ref": "r"},
        PlaceRequest.from_json,
    ),
    "PlaceResponse": (
        {"instance": "https://ii7.example/kvsp/", "matched": 2, "cost": 12.5, "directive": U},
        PlaceResponse.from_json,
    ),
    "PrefetchDirective": (
        {"directive": U, "request_ref": "opaque", "scope_id": S, "compat_id": C,
         "blocks": [{"block_key": H[0], "sources": ["https://h1.example/kvsp/"]}],
         "layer_order": "ascending", "deadline_ms": 50, "lease_ms": 2000},
        PrefetchDirective.from_json,
    ),
    "DirectiveStatus": (
        {"directive": U, "state": "partial", "loaded": H[:1], "detail": "deadline"},
        DirectiveStatus.from_json,
    ),
    "LeaseRequest": (
        {"compat_id": C, "scope_id": S, "block_keys": H[:2], "ttl_ms": 2000},
        LeaseRequest.from_json,
    ),
    "LeaseRenewal": ({"ttl_ms": 2000}, LeaseRenewal.from_json),
    "LeaseGrant": ({"lease": "l-1", "ttl_ms": 2000, "block_keys": H[:1]}, LeaseGrant.from_json),
    "CompatibilityDescriptor": (
        {**ops.DESCRIPTOR.to_json(), "adapters": [D]},
        CompatibilityDescriptor.from_json,
    ),
    "GenerateRequest": (
        {"prompt": [1, 2, 3], "max_tokens": 4, "scope_key": "ab" * 32, "scope_id": None,
         "session": U},
        GenerateRequest.from_json,
    ),
    "SessionCheckpoint": (CHECKPOINT, SessionCheckpoint.from_json),
    "ResumeRequest": ({"epoch": 2, "checkpoint": CHECKPOINT}, ResumeRequest.from_json),
    "ShardMap": (
        {"map": "c3f8", "version": 4, "shards": [
            {"tokens": [0, 32768], "instance": "https://ii1.example/kvsp/"},
            {"tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/"}]},
        ShardMap.from_json,
    ),
    "ReshardPlan": (
        {"map": "c3f8", "from": 4, "to": 5, "deadline_ms": 200, "retain": [[0, 32768]],
         "fetch": [{"tokens": [32768, 49152], "from": "https://ii2.example/kvsp/"}],
         "release": []},
        ReshardPlan.from_json,
    ),
    "ReshardCommit": ({"map": "c3f8", "commit": 5}, ReshardCommit.from_json),
    "ReshardAbort": ({"map": "c3f8", "abort": 5}, ReshardAbort.from_json),
}  # fmt: skip


def _fix_generate(name: str, body: dict[str, Any]) -> dict[str, Any]:
    # scope_id null is not a hex16; the request names its scope by scope_key here
    return {k: v for k, v in body.items() if not (name == "GenerateRequest" and v is None)}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_what_a_record_reads_its_schema_accepts(name: str) -> None:
    body, read = EXAMPLES[name]
    body = _fix_generate(name, body)
    read(copy.deepcopy(body))  # a valid record, so the example is a fair one
    check = validator(name)
    assert check.is_valid(body), list(check.iter_errors(body))[:3]
    to_json = getattr(read(copy.deepcopy(body)), "to_json", None)
    if to_json is not None:  # and what the class writes back validates as well
        assert check.is_valid(to_json())


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_required_members_agree(name: str) -> None:
    body, read = EXAMPLES[name]
    body = _fix_generate(name, body)
    schema = SCHEMAS[name]
    check = validator(name)
    for member in schema["properties"]:
        if member not in body:
            continue
        without = {k: v for k, v in body.items() if k != member}
        if member in schema["required"]:
            assert not check.is_valid(without), member
            with pytest.raises(RecordError):
                read(without)
        else:
            assert check.is_valid(without), member
            read(without)


def test_problem_schema_matches_rendered_problems(tmp_path: Path) -> None:
    client = InProcessClient(ops.build_app("index", tmp_path))
    check = validator("Problem")
    for response in (
        client.post("/lookup", json={}, headers=ops.ADMIN),
        client.post("/lookup", json={}),
        client.get("/descriptors/" + "0" * 64, headers=ops.ADMIN),
        client.get("/no-such-thing"),
    ):
        assert response.headers["content-type"] == "application/problem+json"
        assert check.is_valid(response.json()), response.text
