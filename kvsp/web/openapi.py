"""``GET /openapi.json``: an OpenAPI 3.1 description of each service's HTTP resources (spec
§4.4 records, §6.1-6.9 resources, §11.1 media types; DESIGN.md §3 resource table, problem
types, authentication).

The document of an app is built from the app's own routes: every ``(method, path template)`` it
serves is looked up in :data:`OPERATIONS`, so a service describes exactly what it serves. A
route with no entry is left out of the document and named by :func:`undocumented_routes`; the
test suite fails on any (``tests/web/test_openapi.py``), so a resource added without its
description does not go unnoticed.

Record schemas are JSON Schema 2020-12 written from the record classes (:mod:`kvsp.records`,
:mod:`kvsp.compat`): required and optional members, hex forms, ranges; unknown members are
allowed everywhere (§4.4 "Unknown members MUST be ignored"). Identifier strings also name a
``format`` (``kvsp-hex32``, ``kvsp-hex16``, ``kvsp-digest``, ``kvsp-uri``,
``kvsp-http-uri``): an annotation beside the ``pattern``, which lets test generators draw such
strings cheaply. Checks a schema cannot state (chained key order, non-overlapping residency
ranges, ``output_offset`` equal to the generated count, …) are the record classes' to make;
they answer 400 ``kvsp-bad-request``. Every error is ``application/problem+json`` (RFC 9457).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvsp.records_common import LABEL_PATTERN
from kvsp.registries import DirectiveState, InstanceState, Tier
from kvsp.sessions import SessionState
from kvsp.web.problems import KVSP_JSON, PROBLEM_JSON, dumps_json

OPENAPI_PATH = "/openapi.json"
BLOCK_MEDIA_TYPE = "application/kvsp-block"  # §11.1
NDJSON = "application/x-ndjson"
PROMETHEUS_TEXT = "text/plain"
UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
Schema = dict[str, Any]

# --- schemas ----------------------------------------------------------------------------------


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    return {
        "type": "object",
        "required": list(required),
        "properties": {**required, **(optional or {})},
    }


def _array(items: Schema, *, min_items: int = 0, max_items: int | None = None) -> Schema:
    out: Schema = {"type": "array", "items": items}
    if min_items:
        out["minItems"] = min_items
    if max_items is not None:
        out["maxItems"] = max_items
    return out


def _uint(maximum: int = UINT64_MAX, minimum: int = 0) -> Schema:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


_NUMBER: Schema = {"type": "number", "minimum": 0}
_RATE: Schema = {"type": "number", "exclusiveMinimum": 0}
_LABEL: Schema = {
    "type": "string",
    "pattern": LABEL_PATTERN,
    "description": "extension: a site or zone label",
}
_NULLABLE_LABEL: Schema = {**_LABEL, "type": ["string", "null"]}
_OPAQUE: Schema = {"type": ["string", "null"], "maxLength": 1024}
_UUID: Schema = {"type": "string", "format": "uuid"}
_NAME: Schema = {"type": "string", "pattern": "^[A-Za-z0-9._~-]{1,128}$"}
# An absolute URI with a host (RFC 3986); what lies past the authority is not constrained here.
_URI_CHARS = r"[^\x00-\x20\x7f\"<>\\^`{|}/?#]+"
_KEYS = _array(_ref("Hex32"), max_items=1_000_000)
_RANGE = {**_array(_uint(UINT32_MAX), min_items=2, max_items=2)}
_STATE = {"type": "string", "enum": [str(s) for s in InstanceState]}
_SESSION = {"type": "string", "enum": [str(s) for s in SessionState]}

SCHEMAS: dict[str, Schema] = {
    "Hex32": {"type": "string", "format": "kvsp-hex32", "pattern": "^[0-9a-f]{64}$"},
    "Hex16": {"type": "string", "format": "kvsp-hex16", "pattern": "^[0-9a-f]{32}$"},
    "Digest": {"type": "string", "format": "kvsp-digest", "pattern": "^sha-256:[0-9a-f]{64}$"},
    "Uri": {
        "type": "string",
        "format": "kvsp-uri",
        "description": "at most 2048 characters",
        "pattern": f"^(https?|moqt)://{_URI_CHARS}",
    },
    "HttpUri": {
        "type": "string",
        "format": "kvsp-http-uri",
        "description": "at most 2048 characters",
        "pattern": f"^https?://{_URI_CHARS}",
    },
    "Problem": {
        **_object(
            {"type": {"type": "string"}, "title": {"type": "string"}, "status": _uint(599, 100)},
            {
                "detail": {"type": "string"},
                "path": {"type": "string"},
                "instance": {"type": "string"},
            },
        ),
        "description": "RFC 9457 problem details; type urn:ietf:params:kvsp:problem:<name>.",
    },
    "Health": _object({"status": {"const": "ok"}}),
    "Ready": _object({"status": {"const": "ready"}}),
    "Residency": _object(
        {"tier": {"type": "string", "enum": [str(t) for t in Tier]}, "layers": _RANGE},
        {"read_mbit_per_s": _RATE},
    ),
    "ReplicaRecord": _object(
        {
            "block_key": _ref("Hex32"),
            "compat_id": _ref("Hex32"),
            "scope_id": _ref("Hex16"),
            "holder": _ref("Uri"),
            "codec": _uint(UINT16_MAX),
            "size": _uint(),
            "digest": _ref("Digest"),
            "ttl_ms": _uint(),
        },
        {
            "layer_digests": _array(_ref("Hex32"), min_items=1, max_items=1_000_000),
            "residency": _array(_ref("Residency"), min_items=1),
            "moqt_namespace": {"type": "string", "pattern": "^[A-Za-z0-9_-]*$"},
            "lease_base": _ref("HttpUri"),
            "site": _LABEL,
            "zone": _LABEL,
        },
    ),
    "TtlAnswer": _object({"ttl_ms": _uint()}),
    "BatchPublish": _object({"records": _array(_ref("ReplicaRecord"))}),
    "BatchResults": _object(
        {
            "results": _array(
                {
                    "oneOf": [
                        _object({"ok": {"const": True}, "ttl_ms": _uint()}),
                        _object({"ok": {"const": False}, "problem": _ref("Problem")}),
                    ]
                }
            )
        }
    ),
    "LookupRequest": _object(
        {"scope_id": _ref("Hex16"), "compat_id": _ref("Hex32"), "block_keys": _KEYS},
        {
            "targets": {**_array(_ref("HttpUri"), max_items=1024), "uniqueItems": True},
            "compact": {"type": "boolean", "description": "extension: matched and estimates only"},
        },
    ),
    "LookupResponse": _object(
        {"matched": _uint(UINT32_MAX)},
        {
            "replicas": _array(_array(_ref("ReplicaRecord"), min_items=1)),
            "estimates": {
                "type": "object",
                "additionalProperties": _object({"fetch_us": _NUMBER, "recompute_us": _NUMBER}),
            },
            "hint": {"type": "string"},
        },
    ),
    "Link": _object({"holder": _ref("Uri"), "mbit_per_s": _RATE, "rtt_us": _NUMBER}),
    "InstanceStatusRecord": _object(
        {
            "instance": _ref("HttpUri"),
            "epoch": _uint(),
            "state": _STATE,
            "running": _uint(),
            "queued": _uint(),
            "batch_size": _uint(),
            "kv_utilization": {"type": "number", "minimum": 0, "maximum": 1},
            "prefill_tokens_per_s": _NUMBER,
            "decode_tokens_per_s": _NUMBER,
            "links": _array(_ref("Link")),
            "ttl_ms": _uint(),
        },
        {
            "requested_state": {"enum": [None, str(InstanceState.SLEEPING)]},
            "site": _LABEL,
            "zone": _LABEL,
            "relay": {
                "type": "string",
                "pattern": f"^moqt(\\+(tls|tcp|unix))?://{_URI_CHARS}",
                "description": "extension: the instance's edge relay",
            },
        },
    ),
    "StateAnswer": _object({"state": _STATE}),
    "InstanceView": _object(
        {
            "instance": _ref("HttpUri"),
            "instance_id": _ref("Hex16"),
            "state": _STATE,
            "epoch": _uint(),
            "reported_state": _STATE,
            "requested_state": {"enum": [None, str(InstanceState.SLEEPING)]},
            "load": _uint(),
            "running": _uint(),
            "queued": _uint(),
            "batch_size": _uint(),
            "kv_utilization": _NUMBER,
            "age_ms": {"type": "integer"},
            "ttl_ms": _uint(),
            "mean_service_us": {"type": ["number", "null"]},
        },
        {"site": _NULLABLE_LABEL, "zone": _NULLABLE_LABEL},
    ),
    "InstanceList": _object({"instances": _array(_ref("InstanceView"))}),
    "WithdrawnAnswer": _object({"withdrawn": _uint()}),
    "PlaceRequest": _object(
        {
            "scope_id": _ref("Hex16"),
            "compat_id": _ref("Hex32"),
            "block_keys": _KEYS,
            "prompt_tokens": _uint(),
        },
        {
            "session": _UUID,
            "request_ref": _OPAQUE,
            "deadline_ms": {**_uint(3_600_000), "description": "extension: directive deadline"},
            "lease_ms": {**_uint(3_600_000, 1), "description": "extension: directive lease"},
        },
    ),
    "PlaceResponse": _object(
        {"instance": _ref("HttpUri"), "matched": _uint(UINT32_MAX), "cost": _NUMBER},
        {"directive": _UUID},
    ),
    "DirectiveBlock": _object(
        {
            "block_key": _ref("Hex32"),
            "sources": {**_array(_ref("Uri"), min_items=1), "uniqueItems": True},
        }
    ),
    "PrefetchDirective": _object(
        {
            "directive": _UUID,
            "scope_id": _ref("Hex16"),
            "compat_id": _ref("Hex32"),
            "blocks": _array(_ref("DirectiveBlock"), min_items=1, max_items=1_000_000),
            "layer_order": {"const": "ascending"},
            "deadline_ms": _uint(),
            "lease_ms": _uint(minimum=1),
        },
        {"request_ref": _OPAQUE},
    ),
    "DirectiveStatus": _object(
        {
            "directive": _UUID,
            "state": {"type": "string", "enum": [str(s) for s in DirectiveState]},
            "loaded": _KEYS,
        },
        {"detail": {"type": "string"}},
    ),
    "LeaseRequest": _object(
        {
            "compat_id": _ref("Hex32"),
            "scope_id": _ref("Hex16"),
            "block_keys": _array(_ref("Hex32"), min_items=1, max_items=1_000_000),
            "ttl_ms": _uint(minimum=1),
        }
    ),
    "LeaseRenewal": _object({"ttl_ms": _uint(minimum=1)}),
    "LeaseGrant": _object({"lease": _NAME, "ttl_ms": _uint()}, {"block_keys": _KEYS}),
    "CompatibilityDescriptor": _object(
        {
            "model": {"type": "string", "minLength": 1},
            "model_digest": _ref("Digest"),
            "tokenizer_digest": _ref("Digest"),
            "layers": _uint(UINT32_MAX, 1),
            "kv_heads": _uint(UINT32_MAX, 1),
            "head_dim": _uint(UINT32_MAX, 1),
            "kv_dtype": {"type": "string", "description": "§11.2.3 element type"},
            "positional": {"type": "string", "description": "§11.2 positional encoding"},
            "block_tokens": _uint(UINT32_MAX, 1),
            "layout": {"const": "kvsp-layout-1"},
        },
        {"adapters": _array(_ref("Digest"), min_items=1)},
    ),
    "CompatIdAnswer": _object({"compat_id": _ref("Hex32")}),
    "BlockStored": {
        "oneOf": [_ref("ReplicaRecord"), _object({"size": _uint()})],
        "description": "the new Replica Record, or the size when the holder has no public URL",
    },
    "GenerateRequest": _object(
        {"prompt": _array(_uint(UINT32_MAX), min_items=1), "max_tokens": _uint(UINT32_MAX)},
        {
            "scope_key": {"type": "string", "pattern": "^([0-9a-f]{2}){32,1024}$"},
            "scope_id": _ref("Hex16"),
            "session": {"type": ["string", "null"], "format": "uuid"},
            "sampler": {
                "type": "object",
                "description": "method, params, seed, deterministic (as in a checkpoint)",
            },
        },
    ),
    "TokenLine": {
        "oneOf": [
            _object({"index": _uint(), "epoch": _uint(), "token": _uint(UINT32_MAX)}),
            _object({"error": _ref("Problem")}),
        ]
    },
    "Sampler": _object(
        {
            "method": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]{0,63}$"},
            "step": _uint(),
            "deterministic": {"type": "boolean"},
        },
        {"params": {"type": "object"}, "seed": {"type": ["integer", "null"], "minimum": 0}},
    ),
    "SessionCheckpoint": _object(
        {
            "session": _UUID,
            "epoch": _uint(),
            "compat_id": _ref("Hex32"),
            "scope_id": _ref("Hex16"),
            "prompt_blocks": _KEYS,
            "prompt_tail": _array(_uint(UINT32_MAX)),
            "generated": _array(_uint(UINT32_MAX)),
            "output_offset": _uint(),
            "sampler": _ref("Sampler"),
        },
        {
            "instance": {**_ref("HttpUri"), "description": "extension: who took it"},
            "max_tokens": {**_uint(), "description": "extension: output tokens asked for"},
        },
    ),
    "CheckpointAnswer": _object(
        {"session": _UUID, "epoch": _uint(), "output_offset": _uint(), "state": _SESSION},
    ),
    "SessionView": {
        "anyOf": [
            _object(
                {
                    "session": _UUID,
                    "scope_id": _ref("Hex16"),
                    "compat_id": _ref("Hex32"),
                    "instance": _ref("HttpUri"),
                    "epoch": _uint(),
                    "state": _SESSION,
                    "output_offset": _uint(),
                },
                {"max_tokens": _uint(), "detail": {"type": "string"}},
            ),
            _object(
                {
                    "session": _UUID,
                    "epoch": _uint(),
                    "state": {"type": "string"},
                    "generated": _uint(),
                    "released": _uint(),
                    "acknowledged": _uint(),
                    "checkpoints": _uint(),
                    "max_tokens": {"type": ["integer", "null"], "minimum": 0},
                    "deterministic": {"type": "boolean"},
                }
            ),
        ],
        "description": "at the PC: where the session lives; at an instance: its progress",
    },
    "ResumeAnswer": _object(
        {
            "session": _UUID,
            "epoch": _uint(),
            "output_offset": _uint(),
            "loaded_prompt_blocks": _uint(),
            "loaded_generated_blocks": _uint(),
            "recomputed_tokens": _uint(),
        }
    ),
    "HolderCensus": _object(
        {
            "holders": _array(
                _object({"holder": _ref("Uri"), "replicas": _uint(), "octets": _uint()})
            )
        }
    ),
    "ResumeRequest": _object({"epoch": _uint(), "checkpoint": _ref("SessionCheckpoint")}),
    "ShardMap": _object(
        {
            "map": _NAME,
            "version": _uint(),
            "shards": _array(_object({"tokens": _RANGE, "instance": _ref("HttpUri")}), min_items=1),
        }
    ),
    "ReshardPlan": _object(
        {
            "map": _NAME,
            "from": _uint(UINT64_MAX - 1),
            "to": _uint(minimum=1),
            "deadline_ms": _uint(),
            "retain": _array(_RANGE),
            "fetch": _array(_object({"tokens": _RANGE, "from": _ref("HttpUri")})),
            "release": _array(_RANGE),
        }
    ),
    "ReshardCommit": _object({"map": _NAME, "commit": _uint(minimum=1)}),
    "ReshardAbort": _object({"map": _NAME, "abort": _uint(minimum=1)}),
}
"""Components shared by every service's document (records of §4.4 and message bodies)."""

# --- operations -------------------------------------------------------------------------------

_ERRORS = {
    400: "The request is malformed; `path` names the bad member, segment or parameter",
    401: "No valid bearer token (`WWW-Authenticate: Bearer`)",
    403: "The principal lacks the role or the scope",
    404: "No such resource",
    405: "The resource does not take this method",
    406: "A codec the holder cannot produce",
    409: "Conflicts with the resource's state (kvsp-conflict, kvsp-stale-epoch)",
    412: "The holder already has this block (If-None-Match: *)",
    413: "The body is over the service's limit",
    415: "The body is not in a media type the resource takes",
    422: "Digest mismatch or incompatible geometry",
    428: "A block PUT without If-None-Match: *",
    429: "Over the client's lease quota (kvsp-lease-quota)",
    500: "An internal error (no details)",
    502: "An upstream service failed",
    503: "No active instance, the instance is not active (kvsp-not-active), or the service "
    "is not ready (kvsp-not-ready)",
    507: "No room: a holder's tiers without evicting leased blocks, or the IS's record quota of "
    "a holder",
}
_ALWAYS = (400, 401, 403, 404, 405, 500)
_WITH_BODY = (*_ALWAYS, 413, 415)


def _json(schema: Schema, media_type: str = KVSP_JSON) -> Schema:
    return {"content": {media_type: {"schema": schema}}}


def _request(name: str) -> Schema:
    return {"required": True, **_json(_ref(name))}


def _param(name: str, schema: Schema, where: str = "path", *, required: bool = True) -> Schema:
    return {"name": name, "in": where, "required": required, "schema": schema}


_COMPAT = _param("compat", _ref("Hex32"))
_SCOPE = _param("scope", _ref("Hex16"))
_KEY = _param("key", _ref("Hex32"))
_BLOCK_PARAMS = [_COMPAT, _SCOPE, _KEY]
_LAYERS_RE = "^(0|[1-9][0-9]{0,9})-(0|[1-9][0-9]{0,9})$"


def _op(
    summary: str,
    ok: dict[int, Schema | None],
    errors: Iterable[int] = _ALWAYS,
    *,
    body: str | Schema | None = None,
    params: list[Schema] | None = None,
    public: bool = False,
) -> Schema:
    """One operation object: ``ok`` maps success statuses to their content (None: no body)."""
    responses: dict[str, Schema] = {}
    for status, content in ok.items():
        responses[str(status)] = {"description": "OK", **(content or {})}
    for status in sorted(set(errors)):
        responses[str(status)] = {
            "description": _ERRORS[status],
            **_json(_ref("Problem"), PROBLEM_JSON),
        }
    op: Schema = {"summary": summary, "responses": responses}
    if params:
        op["parameters"] = params
    if isinstance(body, str):
        op["requestBody"] = _request(body)
    elif body is not None:
        op["requestBody"] = body
    if public:
        op["security"] = []
    return op


_REPLICA = "/replicas/{compat}/{scope}/{key}/{holder_id}"
_BLOCK = "/blocks/{compat}/{scope}/{key}"
_BLOCK_BODY: Schema = {
    "required": True,
    "content": {BLOCK_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
}

OPERATIONS: dict[tuple[str, str], Schema] = {
    ("GET", "/healthz"): _op(
        "Liveness (no token)", {200: _json(_ref("Health"))}, (405, 500), public=True
    ),
    ("GET", "/readyz"): _op(
        "Readiness (no token): 200 when ready to serve, else 503 kvsp-not-ready",
        {200: _json(_ref("Ready"))},
        (405, 500, 503),
        public=True,
    ),
    ("GET", "/openapi.json"): _op(
        "This document (no token)",
        {200: _json({"type": "object"}, "application/json")},
        (405, 500),
        public=True,
    ),
    ("GET", "/metrics"): _op(
        "Prometheus metrics (role metrics or admin)",
        {200: _json({"type": "string"}, PROMETHEUS_TEXT)},
        (401, 403, 405, 500),
    ),
    # §6.1, §6.2 Index Service
    ("PUT", _REPLICA): _op(
        "Publish or refresh a Replica Record (§6.1); the granted TTL",
        {200: _json(_ref("TtlAnswer"))},
        (*_WITH_BODY, 409, 422, 507),
        body="ReplicaRecord",
        params=[*_BLOCK_PARAMS, _param("holder_id", _ref("Hex16"))],
    ),
    ("DELETE", _REPLICA): _op(
        "Withdraw a Replica Record (§6.1)",
        {204: None},
        params=[*_BLOCK_PARAMS, _param("holder_id", _ref("Hex16"))],
    ),
    ("POST", "/replicas"): _op(
        "Publish a batch of Replica Records; a result per record",
        {200: _json(_ref("BatchResults"))},
        _WITH_BODY,
        body="BatchPublish",
    ),
    ("GET", "/replicas"): _op(
        "Live Replica Records and their octets per holder (admin)",
        {200: _json(_ref("HolderCensus"))},
    ),
    ("DELETE", "/holders/{holder_id}/replicas"): _op(
        "Withdraw every Replica Record of a holder (§6.1; for one failed or ended, §6.3)",
        {200: _json(_ref("WithdrawnAnswer"))},
        params=[
            _param("holder_id", _ref("Hex16")),
            _param(
                "before",
                {"type": "string", "pattern": "^(0|[1-9][0-9]{0,19})$"},
                "query",
                required=False,
            ),
        ],
    ),
    ("POST", "/lookup"): _op(
        "Prefix lookup (§6.2), stopping at the first key without a replica",
        {200: _json(_ref("LookupResponse"))},
        (*_WITH_BODY, 422),
        body="LookupRequest",
    ),
    ("PUT", "/instances/{instance_id}/status"): _op(
        "Instance Status Record (§6.3); the state the service holds for it",
        {200: _json(_ref("StateAnswer"))},
        (*_WITH_BODY, 409, 502),
        body="InstanceStatusRecord",
        params=[_param("instance_id", _ref("Hex16"))],
    ),
    ("PUT", "/descriptors/{compat}"): _op(
        "Register a Compatibility Descriptor (§4.1); the server computes its compat_id",
        {200: _json(_ref("CompatIdAnswer")), 201: _json(_ref("CompatIdAnswer"))},
        _WITH_BODY,
        body="CompatibilityDescriptor",
        params=[_COMPAT],
    ),
    ("GET", "/descriptors/{compat}"): _op(
        "A known Compatibility Descriptor",
        {200: _json(_ref("CompatibilityDescriptor"))},
        params=[_COMPAT],
    ),
    # §6.3-6.5 Placement Controller
    ("GET", "/instances"): _op(
        "Instances and their states (§6.3)", {200: _json(_ref("InstanceList"))}
    ),
    ("PUT", "/instances/{instance_id}/state"): _op(
        "Change an instance's state (§6.3), forwarded to the instance first",
        {200: _json(_ref("StateAnswer"))},
        (*_WITH_BODY, 409, 502),
        body="StateAnswer",
        params=[_param("instance_id", _ref("Hex16"))],
    ),
    ("DELETE", "/instances/{instance_id}"): _op(
        "End an instance's epoch gracefully (§6.3): it leaves the registry, its replicas are "
        "withdrawn and its sessions move (§6.8)",
        {204: None},
        (*_ALWAYS, 409),
        params=[
            _param("instance_id", _ref("Hex16")),
            _param("epoch", {"type": "string", "pattern": "^(0|[1-9][0-9]{0,19})$"}, "query"),
        ],
    ),
    ("POST", "/place"): _op(
        "Choose an instance (§6.4) and send it a prefetch directive (§6.5)",
        {200: _json(_ref("PlaceResponse"))},
        (*_WITH_BODY, 409, 422, 502, 503),
        body="PlaceRequest",
    ),
    # §6.6, §6.7 holders
    ("GET", _BLOCK): _op(
        "A block as a KVB1 container (§6.7), with Repr-Digest",
        {200: {"content": {BLOCK_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
        (*_ALWAYS, 406),
        params=[
            *_BLOCK_PARAMS,
            _param("layers", {"type": "string", "pattern": _LAYERS_RE}, "query", required=False),
            _param("codec", _uint(UINT16_MAX), "query", required=False),
        ],
    ),
    ("PUT", _BLOCK): _op(
        "Store a block (§6.7) with If-None-Match: *",
        {201: _json(_ref("BlockStored"))},
        (*_WITH_BODY, 409, 412, 422, 428, 507),
        body=_BLOCK_BODY,
        params=[
            *_BLOCK_PARAMS,
            _param("If-None-Match", {"const": "*"}, "header"),
            _param("Repr-Digest", {"type": "string"}, "header", required=False),
        ],
    ),
    ("POST", "/leases"): _op(
        "Lease blocks against eviction (§6.6)",
        {201: _json(_ref("LeaseGrant"))},
        (*_WITH_BODY, 429),
        body="LeaseRequest",
    ),
    ("PUT", "/leases/{lease}"): _op(
        "Renew a lease (§6.6)",
        {200: _json(_ref("LeaseGrant"))},
        (*_WITH_BODY, 429),
        body="LeaseRenewal",
        params=[_param("lease", _NAME)],
    ),
    ("DELETE", "/leases/{lease}"): _op(
        "Release a lease (§6.6)", {204: None}, params=[_param("lease", _NAME)]
    ),
    # §6.3, §6.5 instances
    ("POST", "/prefetch"): _op(
        "Accept a prefetch directive (§6.5); Location names its status",
        {202: _json(_ref("DirectiveStatus"))},
        (*_WITH_BODY, 409, 422),
        body="PrefetchDirective",
    ),
    ("GET", "/prefetch/{directive}"): _op(
        "A directive's state and loaded keys (§6.5)",
        {200: _json(_ref("DirectiveStatus"))},
        params=[_param("directive", _UUID)],
    ),
    ("PUT", "/state"): _op(
        "State change from the PC (§6.3)",
        {200: _json(_ref("StateAnswer"))},
        (*_WITH_BODY, 409),
        body="StateAnswer",
    ),
    ("POST", "/generate"): _op(
        "Generate tokens (outside KVSP): NDJSON lines of index, epoch, token",
        {
            200: {
                "content": {
                    NDJSON: {
                        "schema": {
                            "type": "string",
                            "description": "lines of #/components/schemas/TokenLine",
                        }
                    }
                }
            }
        },
        (*_WITH_BODY, 409, 422, 503),
        body="GenerateRequest",
    ),
    # §6.8 sessions, at the PC and at instances
    ("PUT", "/sessions/{session}/checkpoint"): _op(
        "Session Checkpoint (§6.8); the offset the PC keeps",
        {200: _json(_ref("CheckpointAnswer"))},
        (*_WITH_BODY, 409),
        body="SessionCheckpoint",
        params=[_param("session", _UUID)],
    ),
    ("GET", "/sessions"): _op(
        "The most recently changed sessions (admin; §6.8), at most `limit` (1-1000, 100)",
        {200: _json(_object({"sessions": _array(_ref("SessionView"))}))},
        params=[_param("limit", _uint(1000, 1), "query", required=False)],
    ),
    ("GET", "/sessions/{session}"): _op(
        "A session's state (§6.8)",
        {200: _json(_ref("SessionView"))},
        params=[_param("session", _UUID)],
    ),
    ("POST", "/sessions/{session}/resume"): _op(
        "Resume a session from its checkpoint at a new epoch (§6.8)",
        {200: _json(_ref("ResumeAnswer"))},
        (*_WITH_BODY, 409, 422, 503),
        body="ResumeRequest",
        params=[_param("session", _UUID)],
    ),
    ("GET", "/sessions/{session}/tokens"): _op(
        "A session's tokens from index `from` on (§6.8 reattaching), NDJSON as generate",
        {200: {"content": {NDJSON: {"schema": {"type": "string"}}}}},
        (*_ALWAYS, 409),
        params=[
            _param("session", _UUID),
            _param("from", _uint(UINT32_MAX), "query", required=False),
        ],
    ),
    ("GET", "/status"): _op(
        "The Instance Status Record it would send now (§6.3)",
        {200: _json(_ref("InstanceStatusRecord"))},
    ),
}
"""Every operation a KVSP service may serve, by (method, path template)."""


def _route_operations(routes: Iterable[BaseRoute]) -> Iterable[tuple[str, str]]:
    for route in routes:
        if not isinstance(route, Route):
            continue
        for method in sorted(route.methods or ()):
            if method != "HEAD":  # Starlette adds HEAD to every GET route
                yield method, route.path


def undocumented_routes(app: Starlette) -> list[tuple[str, str]]:
    """The ``(method, path)`` pairs ``app`` serves that :data:`OPERATIONS` does not describe."""
    return [key for key in _route_operations(app.routes) if key not in OPERATIONS]


def openapi_document(app: Starlette, title: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the operations ``app`` serves."""
    paths: dict[str, dict[str, Schema]] = {}
    for method, path in _route_operations(app.routes):
        operation = OPERATIONS.get((method, path))
        if operation is not None:
            paths.setdefault(path, {})[method.lower()] = copy.deepcopy(operation)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": "1",
            "description": "KV Cache Storage Protocol (KVSP) reference implementation. Errors "
            "are RFC 9457 problems (application/problem+json).",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


async def openapi_endpoint(request: Request) -> Response:
    """``GET /openapi.json`` (no token: it describes the API, not its contents)."""
    state = request.app.state
    document = getattr(state, "openapi", None)
    if document is None:  # built on first use: every route is in place by then
        document = state.openapi = dumps_json(openapi_document(request.app, state.openapi_title))
    return Response(document, media_type="application/json")


def install_openapi(app: Starlette, title: str) -> None:
    """Serve ``GET /openapi.json`` describing ``app``."""
    app.state.openapi_title = title
    app.state.openapi = None
    app.router.routes.append(Route(OPENAPI_PATH, openapi_endpoint, methods=["GET"]))
