"""schemathesis against every service, on a real uvicorn server on 127.0.0.1, driven by the
service's own ``GET /openapi.json``.

Each operation gets ``MAX_EXAMPLES`` generated requests (valid and invalid by the schema),
sent with an admin token, and every answer is checked:

* no 500, and no other 5xx but the designed ones (503 ``kvsp-not-active`` when no instance
  can take a request, 503 ``kvsp-not-ready`` from ``/readyz`` of a service not ready yet, 502
  ``kvsp-upstream-error``);
* every 4xx/5xx is ``application/problem+json`` with ``type``, ``title`` and the ``status``;
* statuses, media types, headers and bodies conform to the document, and operations that
  declare the bearer scheme refuse requests without it or with a bad one (schemathesis'
  own checks).

Random keys seldom name anything a service holds, so the success answers are reached by
explicit cases too: the test first stores a descriptor, a block, a Replica Record or an
instance status over HTTP, then sends requests that name them (:func:`seeded_cases`), under the
same checks.

schemathesis' "schema-valid request accepted" check is left out: JSON Schema cannot state the
rules that tie members together (``uri_id(holder)`` equal to the path's ``holder_id``, chained
key order, ``output_offset`` equal to the generated count, scopes a principal may use), and a
request breaking one of them gets a documented 400/403 problem, which is right.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance

from kvsp.compat import compat_id
from kvsp.container import encode_container
from kvsp.index import holder_id_of
from kvsp.keys import block_keys
from kvsp.web.testing import start_process
from tests.support import SUPPORT
from tests.support import operations as ops

pytestmark = pytest.mark.slow  # a process per service, each exercised operation by operation
HELPERS = SUPPORT / "operations.py"
MAX_EXAMPLES = 20
FEWER_EXAMPLES = {"POST /replicas": 8}
"""Batches of whole Replica Records take long to generate; each record is also exercised alone
by ``PUT replicas/…`` with the full count."""
DESIGNED_5XX = {
    503: {
        "urn:ietf:params:kvsp:problem:kvsp-not-active",
        "urn:ietf:params:kvsp:problem:kvsp-not-ready",
    },
    502: {"urn:ietf:params:kvsp:problem:kvsp-upstream-error"},
}

schemathesis.serializer.alias("application/kvsp-block", "application/octet-stream")
# The identifier formats the documents name beside their patterns: drawn directly, several times
# faster than from the regular expressions. URIs name loopback only, so that nothing a service
# is handed points it anywhere else.
_HOSTS = st.sampled_from(["127.0.0.1:9", "127.0.0.1:1", "localhost:9"])
schemathesis.openapi.format("kvsp-hex32", st.binary(min_size=32, max_size=32).map(bytes.hex))
schemathesis.openapi.format("kvsp-hex16", st.binary(min_size=16, max_size=16).map(bytes.hex))
schemathesis.openapi.format(
    "kvsp-digest", st.binary(min_size=32, max_size=32).map(lambda d: "sha-256:" + d.hex())
)
schemathesis.openapi.format(
    "kvsp-uri",
    st.builds("{}://{}/".format, st.sampled_from(["http", "https", "moqt"]), _HOSTS),
)
schemathesis.openapi.format(
    "kvsp-http-uri", st.builds("{}://{}/".format, st.sampled_from(["http", "https"]), _HOSTS)
)


def _media_type(response: schemathesis.Response) -> str:
    values = response.headers.get("content-type") or [""]
    return values[0].split(";", 1)[0].strip().lower()


def problem_documents(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """Every error answer is an RFC 9457 problem with type, title and the same status."""
    if response.status_code < 400:
        return None
    media = _media_type(response)
    assert media == "application/problem+json", f"{response.status_code} answered as {media!r}"
    body = json.loads(response.content)
    assert isinstance(body, dict), "a problem is a JSON object"
    assert isinstance(body.get("type"), str) and body["type"], "problem without type"
    assert isinstance(body.get("title"), str) and body["title"], "problem without title"
    assert body.get("status") == response.status_code, "problem status differs from the answer"
    return None


def no_server_errors(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """No 500 ever; a 502/503 only as the designed KVSP problem."""
    status = response.status_code
    if status < 500:
        return None
    expected = DESIGNED_5XX.get(status)
    body = json.loads(response.content) if _media_type(response).endswith("json") else {}
    assert expected is not None and body.get("type") in expected, (
        f"server error {status}: {response.content[:300]!r}"
    )
    return None


def _block(descriptor: Any) -> bytes:
    section = descriptor.block_tokens * descriptor.kv_heads * descriptor.head_dim * 2  # fp16
    layers = [
        (bytes([i + 1]) * section, bytes([i + 9]) * section) for i in range(descriptor.layers)
    ]
    return encode_container(layers, first_layer=0, token_count=descriptor.block_tokens)


def seeded_cases(service: str, url: str, labels: set[str]) -> dict[str, list[dict[str, Any]]]:
    """Store what the service serves (over HTTP, as admin), and the requests that name it, by
    operation label (``Case`` arguments)."""
    d = ops.DESCRIPTOR
    cid, scope = compat_id(d).hex(), ops.SCOPE.hex()
    keys = [k.hex() for k in block_keys(ops.SCOPE_KEY, compat_id(d), list(range(8)), 4)]
    block_path = {"compat": cid, "scope": scope, "key": keys[0]}
    instance = "http://127.0.0.1:9/"
    cases: dict[str, list[dict[str, Any]]] = {}
    with httpx.Client(base_url=url, headers=ops.ADMIN, timeout=10) as http:
        if "PUT /descriptors/{compat}" in labels:
            http.put(f"descriptors/{cid}", json=d.to_json()).raise_for_status()
            cases["PUT /descriptors/{compat}"] = [
                {"path_parameters": {"compat": cid}, "body": d.to_json()}
            ]
            cases["GET /descriptors/{compat}"] = [{"path_parameters": {"compat": cid}}]
        if service in ("holder", "instance"):
            block = _block(d)
            put = http.put(
                f"blocks/{cid}/{scope}/{keys[0]}",
                content=block,
                headers={"if-none-match": "*", "content-type": "application/kvsp-block"},
            )
            put.raise_for_status()
            lease = {"compat_id": cid, "scope_id": scope, "block_keys": keys[:1], "ttl_ms": 5000}
            cases["GET /blocks/{compat}/{scope}/{key}"] = [
                {"path_parameters": block_path},
                {"path_parameters": block_path, "query": {"layers": "1-1"}},
            ]
            cases["POST /leases"] = [{"body": lease}]
        if service in ("index", "control"):
            holder = "http://127.0.0.1:9/"
            record = {
                "block_key": keys[0], "compat_id": cid, "scope_id": scope, "holder": holder,
                "codec": 1, "size": 64, "digest": "sha-256:" + "00" * 32, "ttl_ms": 60_000,
            }  # fmt: skip
            path = {**block_path, "holder_id": holder_id_of(holder).hex()}
            http.put(
                f"replicas/{cid}/{scope}/{keys[0]}/{path['holder_id']}", json=record
            ).raise_for_status()
            cases["PUT /replicas/{compat}/{scope}/{key}/{holder_id}"] = [
                {"path_parameters": path, "body": record}
            ]
            cases["POST /replicas"] = [{"body": {"records": [record, {**record, "size": -1}]}}]
            cases["POST /lookup"] = [
                {"body": {"scope_id": scope, "compat_id": cid, "block_keys": keys[:2]}},
                {"body": {"scope_id": scope, "compat_id": cid, "block_keys": keys[:2],
                          "targets": [instance], "compact": True}},
            ]  # fmt: skip
        if service in ("pc", "control"):
            status = {
                "instance": instance, "epoch": 1, "state": "active", "running": 0,
                "queued": 0, "batch_size": 8, "kv_utilization": 0.1,
                "prefill_tokens_per_s": 1000, "decode_tokens_per_s": 100, "links": [],
                "requested_state": None, "ttl_ms": 60_000,
            }  # fmt: skip
            iid = holder_id_of(instance).hex()
            cases["PUT /instances/{instance_id}/status"] = [
                {"path_parameters": {"instance_id": iid}, "body": status}
            ]
            http.put(f"instances/{iid}/status", json=status).raise_for_status()
            cases["GET /instances"] = [{}]
            place = {"scope_id": scope, "compat_id": cid, "block_keys": keys[:2],
                     "prompt_tokens": 9, "session": str(uuid.uuid4())}  # fmt: skip
            cases["POST /place"] = [{"body": place}]
        if service == "instance":
            directive = {
                "directive": str(uuid.uuid4()), "scope_id": scope, "compat_id": cid,
                "blocks": [{"block_key": keys[1], "sources": ["http://127.0.0.1:9/"]}],
                "layer_order": "ascending", "deadline_ms": 1000, "lease_ms": 1000,
            }  # fmt: skip
            cases["POST /prefetch"] = [{"body": directive}]
            cases["POST /generate"] = [
                {"body": {"prompt": list(range(10)), "max_tokens": 3, "scope_id": scope}}
            ]
            cases["GET /status"] = [{}]
            cases["PUT /state"] = [{"body": {"state": "active"}}]
    return cases


def _call(case: schemathesis.Case) -> None:
    case.call_and_validate(
        excluded_checks=[positive_data_acceptance, not_a_server_error],
        additional_checks=[no_server_errors, problem_documents],
    )


def _run_operation(operation: schemathesis.APIOperation) -> None:
    @given(case=operation.as_strategy())
    @settings(
        max_examples=FEWER_EXAMPLES.get(operation.label, MAX_EXAMPLES),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def exercise(case: schemathesis.Case) -> None:
        _call(case)

    exercise()


@pytest.mark.parametrize("service", ops.SERVICES)
def test_service_conforms_to_its_openapi(service: str, tmp_path: Path) -> None:
    with start_process([sys.executable, str(HELPERS), service], workdir=tmp_path) as process:
        url = process.base_url
        document = httpx.get(url + "openapi.json").json()
        schema = schemathesis.openapi.from_dict(document)
        schema.config.update(
            base_url=url.rstrip("/"), headers={"Authorization": ops.ADMIN["authorization"]}
        )
        failures = []
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 6  # healthz, metrics, openapi.json and the service's own
        labels = {operation.label for operation in operations}
        seeded = seeded_cases(service, url, labels)
        assert set(seeded) <= labels
        for operation in operations:
            try:
                for arguments in seeded.get(operation.label, ()):
                    _call(operation.Case(**arguments))
                _run_operation(operation)
            except Exception as exc:  # noqa: BLE001 - every operation's failure is reported
                failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
