"""Tests for kvsp.records: spec §4.4 records and the §6.2–6.9 message bodies.

Spec examples are copied from the draft as literal JSON, with ``<hex32>``/``<hex16>`` replaced
by real hex; every bad field must raise RecordError naming its exact JSON path; arbitrary JSON
either parses or raises a KVSPError; ``loads`` turns garbage into RecordError.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import re
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp import records
from kvsp.errors import KVSPError, RecordError
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import decode_moqt_namespace, encode_moqt_namespace, kv_namespace
from kvsp.records import (
    MAX_DEPTH,
    DirectiveBlock,
    DirectiveStatus,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    Link,
    LookupRequest,
    LookupResponse,
    PlaceRequest,
    PlaceResponse,
    PrefetchDirective,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardFetch,
    ReshardPlan,
    Residency,
    ResumeRequest,
    Sampler,
    SessionCheckpoint,
    Shard,
    ShardMap,
    StateAnswer,
    TargetEstimate,
    dumps,
    loads,
    parse_reshard_message,
)
from kvsp.registries import DirectiveState, InstanceState, Tier

# --- spec examples, verbatim from the draft ------------------------------------------------

SPEC_REPLICA = """
{
  "block_key": "<hex32>",
  "compat_id": "<hex32>",
  "scope_id": "<hex16>",
  "holder": "https://h1.example/kvsp/",
  "codec": 1,
  "size": 2097152,
  "digest": "sha-256:<hex32>",
  "layer_digests": ["<hex32>", "<hex32>", "..."],
  "residency": [
    { "tier": "device", "layers": [0, 15] },
    { "tier": "host",   "layers": [16, 31],
      "read_mbit_per_s": 400000 }
  ],
  "ttl_ms": 600000
}
"""

SPEC_STATUS = """
{
  "instance": "https://ii7.example/kvsp/",
  "epoch": 12,
  "state": "active",
  "running": 18, "queued": 3, "batch_size": 32,
  "kv_utilization": 0.71,
  "prefill_tokens_per_s": 42000,
  "decode_tokens_per_s": 3100,
  "links": [
    { "holder": "https://h1.example/kvsp/",
      "mbit_per_s": 200000, "rtt_us": 12 }
  ],
  "requested_state": null,
  "ttl_ms": 3000
}
"""

SPEC_CHECKPOINT = """
{
  "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
  "epoch": 1,
  "compat_id": "<hex32>",
  "scope_id": "<hex16>",
  "prompt_blocks": ["<hex32>", "<hex32>"],
  "prompt_tail": [374, 264],
  "generated": [1296, 315, 279],
  "output_offset": 3,
  "sampler": { "method": "top-p", "params": {"p": 0.9},
               "seed": 7, "step": 3, "deterministic": false }
}
"""

SPEC_LOOKUP = """
{
  "scope_id": "<hex16>",
  "compat_id": "<hex32>",
  "block_keys": ["<hex32>", "<hex32>", "<hex32>"],
  "targets": ["https://ii7.example/kvsp/",
              "https://ii9.example/kvsp/"]
}
"""

SPEC_PREFETCH = """
{
  "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10",
  "request_ref": "opaque-value-from-PC",
  "scope_id": "<hex16>",
  "compat_id": "<hex32>",
  "blocks": [
    { "block_key": "<hex32>",
      "sources": ["https://h1.example/kvsp/"] }
  ],
  "layer_order": "ascending",
  "deadline_ms": 50,
  "lease_ms": 2000
}
"""

SPEC_SHARD_MAP = """
{
  "map": "c3f8...e1", "version": 4,
  "shards": [
    { "tokens": [0, 32768],
      "instance": "https://ii1.example/kvsp/" },
    { "tokens": [32768, 65536],
      "instance": "https://ii2.example/kvsp/" },
    { "tokens": [65536, 98304],
      "instance": "https://ii3.example/kvsp/" }
  ]
}
"""

SPEC_RESHARD_PLAN = """
{
  "map": "c3f8...e1", "from": 4, "to": 5,
  "deadline_ms": 200,
  "retain":  [[0, 32768]],
  "fetch":   [{ "tokens": [32768, 49152],
                "from": "https://ii2.example/kvsp/" }],
  "release": []
}
"""

SPEC_COMMIT = '{"map": "c3f8...e1", "commit": 5}'
SPEC_ABORT = '{"map": "c3f8...e1", "abort": 5}'
SPEC_DRAINING = '{"state": "draining"}'
SPEC_ACTIVE = '{"state": "active"}'


def hex_of(n: int, octets: int) -> str:
    """A distinct, deterministic lowercase hex identifier."""
    return hashlib.sha256(n.to_bytes(4, "big")).digest()[:octets].hex()


def fill(text: str) -> Any:
    """Replace each ``<hex32>``/``<hex16>`` with distinct real hex and parse with ``loads``."""
    counter = itertools.count(1)
    text = re.sub(r"<hex(32|16)>", lambda m: hex_of(next(counter), int(m.group(1))), text)
    return loads(text.encode())


H32 = hex_of(1000, 32)
H16 = hex_of(1001, 16)
LAYERS = [hex_of(2000 + i, 32) for i in range(32)]
REPLICA_DIGEST = "sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in LAYERS)).hexdigest()


def spec_replica() -> dict[str, Any]:
    """The §4.4 example with its ``"..."`` spelled out as 32 layer digests and a real digest."""
    obj: dict[str, Any] = fill(SPEC_REPLICA)
    obj["layer_digests"] = list(LAYERS)
    obj["digest"] = REPLICA_DIGEST
    return obj


def spec_status() -> Any:
    return fill(SPEC_STATUS)


def spec_checkpoint() -> Any:
    return fill(SPEC_CHECKPOINT)


def spec_lookup() -> Any:
    return fill(SPEC_LOOKUP)


def spec_prefetch() -> Any:
    return fill(SPEC_PREFETCH)


def lookup_answer() -> dict[str, Any]:
    return {
        "matched": 1,
        "replicas": [[spec_replica()]],
        "estimates": {"https://ii7.example/kvsp/": {"fetch_us": 120.5, "recompute_us": 9000}},
        "hint": "compat_id differs from the one this scope was published under",
    }


def directive_status() -> dict[str, Any]:
    return {
        "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10",
        "state": "partial",
        "loaded": [H32],
        "detail": "deadline expired",
    }


def lease_request() -> dict[str, Any]:
    return {"compat_id": H32, "scope_id": H16, "block_keys": [H32, LAYERS[0]], "ttl_ms": 2000}


def place_request() -> dict[str, Any]:
    return {
        "scope_id": H16,
        "compat_id": H32,
        "block_keys": [H32],
        "prompt_tokens": 40,
        "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
        "request_ref": "r-17",
    }


def place_response() -> dict[str, Any]:
    return {
        "instance": "https://ii7.example/kvsp/",
        "matched": 1,
        "cost": 1234.5,
        "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10",
    }


def resume_request() -> dict[str, Any]:
    return {"epoch": 2, "checkpoint": spec_checkpoint()}


# (record class, example factory)
EXAMPLES: list[tuple[Any, Callable[[], Any]]] = [
    (ReplicaRecord, spec_replica),
    (InstanceStatusRecord, spec_status),
    (SessionCheckpoint, spec_checkpoint),
    (ResumeRequest, resume_request),
    (LookupRequest, spec_lookup),
    (LookupResponse, lookup_answer),
    (PrefetchDirective, spec_prefetch),
    (DirectiveStatus, directive_status),
    (ShardMap, lambda: loads(SPEC_SHARD_MAP)),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN)),
    (ReshardCommit, lambda: loads(SPEC_COMMIT)),
    (ReshardAbort, lambda: loads(SPEC_ABORT)),
    (StateAnswer, lambda: loads(SPEC_DRAINING)),
    (LeaseRequest, lease_request),
    (LeaseRenewal, lambda: {"ttl_ms": 5000}),
    (LeaseGrant, lambda: {"lease": "l-7f3a", "ttl_ms": 2000, "block_keys": [H32]}),
    (PlaceRequest, place_request),
    (PlaceResponse, place_response),
]
RECORDS = [cls for cls, _ in EXAMPLES] + [Residency, Link, Sampler, DirectiveBlock, Shard]
RECORDS += [ReshardFetch]
EXAMPLE_IDS = [cls.__name__ for cls, _ in EXAMPLES]


# --- spec examples parse ---------------------------------------------------------------------


def test_spec_replica_record() -> None:
    r = ReplicaRecord.from_json(spec_replica())
    assert r.holder == "https://h1.example/kvsp/"
    assert (r.codec, r.size, r.ttl_ms) == (1, 2097152, 600000)
    assert r.layer_digests is not None and len(r.layer_digests) == 32
    assert r.residency == (
        Residency(tier=Tier.DEVICE, first=0, last=15),
        Residency(tier=Tier.HOST, first=16, last=31, read_mbit_per_s=400000.0),
    )
    assert r.verify_layer_digests()
    assert r.moqt_namespace is None and r.lease_base is None
    assert r.to_json() == spec_replica()  # integral rates are written back as integers


def test_spec_replica_record_verbatim_is_rejected_for_its_ellipsis() -> None:
    # The draft's example elides layer digests with "..."; taken literally it is not hex32.
    with pytest.raises(RecordError) as info:
        ReplicaRecord.from_json(fill(SPEC_REPLICA))
    assert info.value.path == "$.layer_digests[2]"


def test_spec_instance_status() -> None:
    s = InstanceStatusRecord.from_json(spec_status())
    assert s.state is InstanceState.ACTIVE and s.requested_state is None
    assert (s.epoch, s.running, s.queued, s.batch_size, s.ttl_ms) == (12, 18, 3, 32, 3000)
    assert s.kv_utilization == 0.71
    assert s.links == (Link(holder="https://h1.example/kvsp/", mbit_per_s=200000, rtt_us=12),)
    assert s.to_json() == spec_status()


def test_spec_checkpoint() -> None:
    c = SessionCheckpoint.from_json(spec_checkpoint())
    assert c.session == uuid.UUID("6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11")
    assert c.prompt_tail == (374, 264) and c.generated == (1296, 315, 279)
    assert c.output_offset == 3 and len(c.prompt_blocks) == 2
    assert c.sampler == Sampler(
        method="top-p", params={"p": 0.9}, seed=7, step=3, deterministic=False
    )
    assert c.to_json() == spec_checkpoint()


def test_spec_lookup_request() -> None:
    q = LookupRequest.from_json(spec_lookup())
    assert len(q.block_keys) == 3 and not q.compact
    assert q.targets == ("https://ii7.example/kvsp/", "https://ii9.example/kvsp/")
    assert q.to_json() == spec_lookup()


def test_spec_prefetch_directive() -> None:
    d = PrefetchDirective.from_json(spec_prefetch())
    assert d.directive == uuid.UUID("a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10")
    assert d.request_ref == "opaque-value-from-PC"
    assert d.blocks[0].sources == ("https://h1.example/kvsp/",)
    assert (d.layer_order, d.deadline_ms, d.lease_ms) == ("ascending", 50, 2000)
    assert d.to_json() == spec_prefetch()


def test_spec_shard_map() -> None:
    m = ShardMap.from_json(loads(SPEC_SHARD_MAP))
    assert m.map == "c3f8...e1" and m.version == 4
    assert [s.tokens for s in m.shards] == [(0, 32768), (32768, 65536), (65536, 98304)]
    assert m.to_json() == loads(SPEC_SHARD_MAP)


def test_spec_reshard_messages() -> None:
    plan = parse_reshard_message(loads(SPEC_RESHARD_PLAN))
    assert plan == ReshardPlan(
        map="c3f8...e1",
        from_version=4,
        to_version=5,
        deadline_ms=200,
        retain=((0, 32768),),
        fetch=(ReshardFetch(tokens=(32768, 49152), source="https://ii2.example/kvsp/"),),
        release=(),
    )
    assert plan.to_json() == loads(SPEC_RESHARD_PLAN)
    assert parse_reshard_message(loads(SPEC_COMMIT)) == ReshardCommit(map="c3f8...e1", commit=5)
    assert parse_reshard_message(loads(SPEC_ABORT)) == ReshardAbort(map="c3f8...e1", abort=5)


def test_spec_state_answers() -> None:
    assert StateAnswer.from_json(loads(SPEC_DRAINING)).state is InstanceState.DRAINING
    assert StateAnswer.from_json(loads(SPEC_ACTIVE)).to_json() == {"state": "active"}


@pytest.mark.parametrize(("cls", "example"), EXAMPLES, ids=EXAMPLE_IDS)
def test_examples_round_trip(cls: Any, example: Callable[[], Any]) -> None:
    record = cls.from_json(example())
    assert cls.from_json(record.to_json()) == record
    assert cls.from_json(loads(dumps(record))) == record
    assert loads(dumps(record)) == record.to_json()


def _add_unknown(value: Any, depth: int = 0) -> Any:
    """Add unknown members to every object, at every level."""
    if isinstance(value, dict):
        out = {k: _add_unknown(v, depth + 1) for k, v in value.items()}
        if any(isinstance(v, dict) and "fetch_us" in v for v in value.values()):
            return out  # the estimates object is keyed by target URI: every member is a target
        out[f"x_unknown_{depth}"] = {"nested": [1, None, "s"], "ttl_ms": "not checked"}
        return out
    if isinstance(value, list):
        return [_add_unknown(v, depth + 1) for v in value]
    return value


@pytest.mark.parametrize(("cls", "example"), EXAMPLES, ids=EXAMPLE_IDS)
def test_unknown_members_ignored(cls: Any, example: Callable[[], Any]) -> None:
    plain = example()
    if cls is SessionCheckpoint or cls is ResumeRequest:
        _checkpoint_keeps_unknown_params(cls, plain)
    else:
        assert cls.from_json(_add_unknown(plain)) == cls.from_json(plain)


def _checkpoint_keeps_unknown_params(cls: Any, plain: dict[str, Any]) -> None:
    # Sampler params are the sampler's own state: unknown members there are carried, not lost.
    noisy = _add_unknown(plain)
    parsed = cls.from_json(noisy)
    checkpoint = parsed if cls is SessionCheckpoint else parsed.checkpoint
    assert "x_unknown_3" in checkpoint.sampler.params or "x_unknown_2" in checkpoint.sampler.params
    assert checkpoint.session == uuid.UUID("6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11")


# --- each bad field names its path -----------------------------------------------------------

DELETE = object()


def mutate(obj: Any, path: str, value: Any) -> Any:
    """Set (or with DELETE remove) the member at a JSON path like ``$.a[1].b``."""
    out = copy.deepcopy(obj)
    steps = re.findall(r"\.([A-Za-z_0-9]+)|\[(\d+)\]", path[1:])
    target = out
    for name, index in steps[:-1]:
        target = target[name] if name else target[int(index)]
    name, index = steps[-1]
    key: Any = name if name else int(index)
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return out


UPPER = H32.upper()
NIL_UUID = "00000000-0000-0000-0000-000000000000"
MOQT = "moqt://relay.example:4443/kvsp"
NAMESPACE = encode_moqt_namespace([b"kvsp", b"1", H32.encode(), H16.encode(), H32.encode()])

# (class, example, path to change, new value, path the error must name)
BAD: list[tuple[Any, Callable[[], Any], str, Any, str]] = [
    # Replica Record
    (ReplicaRecord, spec_replica, "$.block_key", 5, "$.block_key"),
    (ReplicaRecord, spec_replica, "$.block_key", UPPER, "$.block_key"),
    (ReplicaRecord, spec_replica, "$.block_key", DELETE, "$.block_key"),
    (ReplicaRecord, spec_replica, "$.compat_id", H32[:62], "$.compat_id"),
    (ReplicaRecord, spec_replica, "$.compat_id", None, "$.compat_id"),
    (ReplicaRecord, spec_replica, "$.scope_id", H32, "$.scope_id"),
    (ReplicaRecord, spec_replica, "$.holder", DELETE, "$.holder"),
    (ReplicaRecord, spec_replica, "$.holder", "ftp://h1.example/", "$.holder"),
    (ReplicaRecord, spec_replica, "$.holder", "/kvsp/", "$.holder"),
    (ReplicaRecord, spec_replica, "$.holder", "https:///nohost", "$.holder"),
    (ReplicaRecord, spec_replica, "$.holder", "https://h1 .example/", "$.holder"),
    (ReplicaRecord, spec_replica, "$.codec", -1, "$.codec"),
    (ReplicaRecord, spec_replica, "$.codec", 0x10000, "$.codec"),
    (ReplicaRecord, spec_replica, "$.codec", True, "$.codec"),
    (ReplicaRecord, spec_replica, "$.size", None, "$.size"),
    (ReplicaRecord, spec_replica, "$.size", -5, "$.size"),
    (ReplicaRecord, spec_replica, "$.size", "2097152", "$.size"),
    (ReplicaRecord, spec_replica, "$.digest", H32, "$.digest"),
    (ReplicaRecord, spec_replica, "$.digest", "sha-256:" + UPPER, "$.digest"),
    (ReplicaRecord, spec_replica, "$.layer_digests", [], "$.layer_digests"),
    (ReplicaRecord, spec_replica, "$.layer_digests", None, "$.layer_digests"),
    (ReplicaRecord, spec_replica, "$.layer_digests", H32, "$.layer_digests"),
    (ReplicaRecord, spec_replica, "$.layer_digests[3]", UPPER, "$.layer_digests[3]"),
    (ReplicaRecord, spec_replica, "$.layer_digests[4]", H32 + "00", "$.layer_digests[4]"),
    (ReplicaRecord, spec_replica, "$.layer_digests[5]", "sha-256:" + H32, "$.layer_digests[5]"),
    (ReplicaRecord, spec_replica, "$.residency", [], "$.residency"),
    (ReplicaRecord, spec_replica, "$.residency", None, "$.residency"),
    (ReplicaRecord, spec_replica, "$.residency[1].layers", [15, 31], "$.residency[1].layers"),
    (ReplicaRecord, spec_replica, "$.residency[0].layers", [20, 25], "$.residency[0].layers"),
    (ReplicaRecord, spec_replica, "$.residency[0].layers", [5, 3], "$.residency[0].layers"),
    (ReplicaRecord, spec_replica, "$.residency[0].layers", [0], "$.residency[0].layers"),
    (ReplicaRecord, spec_replica, "$.residency[0].layers", [0, -1], "$.residency[0].layers[1]"),
    (ReplicaRecord, spec_replica, "$.residency[1].layers", [16, 32], "$.residency[1].layers"),
    (ReplicaRecord, spec_replica, "$.residency[0].tier", "gpu", "$.residency[0].tier"),
    (ReplicaRecord, spec_replica, "$.residency[0].tier", "DEVICE", "$.residency[0].tier"),
    (ReplicaRecord, spec_replica, "$.residency[1]", "host", "$.residency[1]"),
    (
        ReplicaRecord,
        spec_replica,
        "$.residency[1].read_mbit_per_s",
        0,
        "$.residency[1].read_mbit_per_s",
    ),
    (
        ReplicaRecord,
        spec_replica,
        "$.residency[1].read_mbit_per_s",
        None,
        "$.residency[1].read_mbit_per_s",
    ),
    (ReplicaRecord, spec_replica, "$.ttl_ms", 1.5, "$.ttl_ms"),
    (ReplicaRecord, spec_replica, "$.ttl_ms", 2**64, "$.ttl_ms"),
    (ReplicaRecord, spec_replica, "$.moqt_namespace", NAMESPACE + "=", "$.moqt_namespace"),
    (ReplicaRecord, spec_replica, "$.moqt_namespace", "+/" + NAMESPACE[2:], "$.moqt_namespace"),
    (ReplicaRecord, spec_replica, "$.moqt_namespace", NAMESPACE + "AA", "$.moqt_namespace"),
    (ReplicaRecord, spec_replica, "$.moqt_namespace", 7, "$.moqt_namespace"),
    (ReplicaRecord, spec_replica, "$.moqt_namespace", None, "$.moqt_namespace"),
    (ReplicaRecord, spec_replica, "$.holder", MOQT, "$.moqt_namespace"),
    (ReplicaRecord, spec_replica, "$.lease_base", MOQT, "$.lease_base"),
    (ReplicaRecord, spec_replica, "$.lease_base", None, "$.lease_base"),
    # Instance Status Record
    (InstanceStatusRecord, spec_status, "$.instance", MOQT, "$.instance"),
    (InstanceStatusRecord, spec_status, "$.epoch", -1, "$.epoch"),
    (InstanceStatusRecord, spec_status, "$.state", "sleepy", "$.state"),
    (InstanceStatusRecord, spec_status, "$.state", None, "$.state"),
    (InstanceStatusRecord, spec_status, "$.requested_state", "draining", "$.requested_state"),
    (InstanceStatusRecord, spec_status, "$.requested_state", "active", "$.requested_state"),
    (InstanceStatusRecord, spec_status, "$.requested_state", 0, "$.requested_state"),
    (InstanceStatusRecord, spec_status, "$.kv_utilization", 1.5, "$.kv_utilization"),
    (InstanceStatusRecord, spec_status, "$.kv_utilization", -0.1, "$.kv_utilization"),
    (InstanceStatusRecord, spec_status, "$.running", 2.5, "$.running"),
    (InstanceStatusRecord, spec_status, "$.queued", DELETE, "$.queued"),
    (InstanceStatusRecord, spec_status, "$.prefill_tokens_per_s", "fast", "$.prefill_tokens_per_s"),
    (InstanceStatusRecord, spec_status, "$.links", None, "$.links"),
    (InstanceStatusRecord, spec_status, "$.links", DELETE, "$.links"),
    (InstanceStatusRecord, spec_status, "$.links[0].mbit_per_s", 0, "$.links[0].mbit_per_s"),
    (InstanceStatusRecord, spec_status, "$.links[0].rtt_us", -1, "$.links[0].rtt_us"),
    (InstanceStatusRecord, spec_status, "$.links[0].holder", "h1", "$.links[0].holder"),
    (InstanceStatusRecord, spec_status, "$.ttl_ms", DELETE, "$.ttl_ms"),
    # Session Checkpoint and resume
    (SessionCheckpoint, spec_checkpoint, "$.session", "not-a-uuid", "$.session"),
    (SessionCheckpoint, spec_checkpoint, "$.session", NIL_UUID, "$.session"),
    (
        SessionCheckpoint,
        spec_checkpoint,
        "$.session",
        "{6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11}",
        "$.session",
    ),
    (
        SessionCheckpoint,
        spec_checkpoint,
        "$.session",
        "6f1d0a9e2c554d7e9a0e5b7f2f9f6a11",
        "$.session",
    ),
    (SessionCheckpoint, spec_checkpoint, "$.session", 42, "$.session"),
    (SessionCheckpoint, spec_checkpoint, "$.epoch", None, "$.epoch"),
    (SessionCheckpoint, spec_checkpoint, "$.prompt_blocks[1]", UPPER, "$.prompt_blocks[1]"),
    (SessionCheckpoint, spec_checkpoint, "$.prompt_tail[0]", -1, "$.prompt_tail[0]"),
    (SessionCheckpoint, spec_checkpoint, "$.generated[2]", 2**32, "$.generated[2]"),
    (SessionCheckpoint, spec_checkpoint, "$.generated", "1296", "$.generated"),
    (SessionCheckpoint, spec_checkpoint, "$.output_offset", 2, "$.output_offset"),
    (SessionCheckpoint, spec_checkpoint, "$.output_offset", 4, "$.output_offset"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler", None, "$.sampler"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler.method", "Top-P", "$.sampler.method"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler.params", [], "$.sampler.params"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler.params.p", 0, "$.sampler.params.p"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler.params.p", 1.5, "$.sampler.params.p"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler.params.p", DELETE, "$.sampler.params.p"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler.seed", -7, "$.sampler.seed"),
    (SessionCheckpoint, spec_checkpoint, "$.sampler.step", DELETE, "$.sampler.step"),
    (
        SessionCheckpoint,
        spec_checkpoint,
        "$.sampler.deterministic",
        "no",
        "$.sampler.deterministic",
    ),
    (ResumeRequest, resume_request, "$.epoch", 1, "$.epoch"),
    (ResumeRequest, resume_request, "$.epoch", DELETE, "$.epoch"),
    (ResumeRequest, resume_request, "$.checkpoint", DELETE, "$.checkpoint"),
    (ResumeRequest, resume_request, "$.checkpoint.session", "x", "$.checkpoint.session"),
    # Lookup
    (LookupRequest, spec_lookup, "$.scope_id", H16.upper(), "$.scope_id"),
    (LookupRequest, spec_lookup, "$.block_keys", None, "$.block_keys"),
    (LookupRequest, spec_lookup, "$.block_keys[2]", H16, "$.block_keys[2]"),
    (LookupRequest, spec_lookup, "$.targets", "https://ii7.example/kvsp/", "$.targets"),
    (LookupRequest, spec_lookup, "$.targets", None, "$.targets"),
    (LookupRequest, spec_lookup, "$.targets[1]", "https://ii7.example/kvsp/", "$.targets[1]"),
    (LookupRequest, spec_lookup, "$.targets[0]", MOQT, "$.targets[0]"),
    (LookupRequest, spec_lookup, "$.compact", "yes", "$.compact"),
    (LookupResponse, lookup_answer, "$.matched", 2, "$.replicas"),
    (LookupResponse, lookup_answer, "$.matched", -1, "$.matched"),
    (LookupResponse, lookup_answer, "$.replicas[0]", [], "$.replicas[0]"),
    (LookupResponse, lookup_answer, "$.replicas[0]", {}, "$.replicas[0]"),
    (LookupResponse, lookup_answer, "$.replicas[0][0].digest", H32, "$.replicas[0][0].digest"),
    (LookupResponse, lookup_answer, "$.estimates", [], "$.estimates"),
    (LookupResponse, lookup_answer, "$.hint", 3, "$.hint"),
    # Prefetch
    (PrefetchDirective, spec_prefetch, "$.directive", "a2b7c9e0", "$.directive"),
    (PrefetchDirective, spec_prefetch, "$.request_ref", 5, "$.request_ref"),
    (PrefetchDirective, spec_prefetch, "$.layer_order", "descending", "$.layer_order"),
    (PrefetchDirective, spec_prefetch, "$.layer_order", DELETE, "$.layer_order"),
    (PrefetchDirective, spec_prefetch, "$.blocks", [], "$.blocks"),
    (PrefetchDirective, spec_prefetch, "$.blocks[0].block_key", UPPER, "$.blocks[0].block_key"),
    (PrefetchDirective, spec_prefetch, "$.blocks[0].sources", [], "$.blocks[0].sources"),
    (PrefetchDirective, spec_prefetch, "$.blocks[0].sources[0]", "x", "$.blocks[0].sources[0]"),
    (PrefetchDirective, spec_prefetch, "$.deadline_ms", -50, "$.deadline_ms"),
    (PrefetchDirective, spec_prefetch, "$.lease_ms", 0, "$.lease_ms"),
    (DirectiveStatus, directive_status, "$.state", "done", "$.state"),
    (DirectiveStatus, directive_status, "$.loaded", DELETE, "$.loaded"),
    (DirectiveStatus, directive_status, "$.loaded[0]", UPPER, "$.loaded[0]"),
    (DirectiveStatus, directive_status, "$.detail", ["x"], "$.detail"),
    # Shard maps and resharding
    (
        ShardMap,
        lambda: loads(SPEC_SHARD_MAP),
        "$.shards[1].tokens",
        [32769, 65536],
        "$.shards[1].tokens",
    ),
    (
        ShardMap,
        lambda: loads(SPEC_SHARD_MAP),
        "$.shards[1].tokens",
        [30000, 65536],
        "$.shards[1].tokens",
    ),
    (
        ShardMap,
        lambda: loads(SPEC_SHARD_MAP),
        "$.shards[2].tokens",
        [0, 32768],
        "$.shards[2].tokens",
    ),
    (ShardMap, lambda: loads(SPEC_SHARD_MAP), "$.shards[0].tokens", [0, 0], "$.shards[0].tokens"),
    (
        ShardMap,
        lambda: loads(SPEC_SHARD_MAP),
        "$.shards[0].tokens",
        [0, 2**32],
        "$.shards[0].tokens[1]",
    ),
    (ShardMap, lambda: loads(SPEC_SHARD_MAP), "$.shards", [], "$.shards"),
    (ShardMap, lambda: loads(SPEC_SHARD_MAP), "$.shards[0].instance", "x", "$.shards[0].instance"),
    (ShardMap, lambda: loads(SPEC_SHARD_MAP), "$.map", "a/b", "$.map"),
    (ShardMap, lambda: loads(SPEC_SHARD_MAP), "$.map", "", "$.map"),
    (ShardMap, lambda: loads(SPEC_SHARD_MAP), "$.version", -4, "$.version"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.to", 6, "$.to"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.to", 4, "$.to"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.retain", [[0, 40000]], "$.fetch[0].tokens"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.release", [[100, 200]], "$.release[0]"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.release", None, "$.release"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.retain[0]", [5, 1], "$.retain[0]"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.fetch[0].from", DELETE, "$.fetch[0].from"),
    (ReshardPlan, lambda: loads(SPEC_RESHARD_PLAN), "$.deadline_ms", None, "$.deadline_ms"),
    (ReshardCommit, lambda: loads(SPEC_COMMIT), "$.commit", 0, "$.commit"),
    (ReshardAbort, lambda: loads(SPEC_ABORT), "$.map", 5, "$.map"),
    (StateAnswer, lambda: loads(SPEC_DRAINING), "$.state", "asleep", "$.state"),
    # Leases and placement
    (LeaseRequest, lease_request, "$.block_keys", [], "$.block_keys"),
    (LeaseRequest, lease_request, "$.block_keys[1]", 1, "$.block_keys[1]"),
    (LeaseRequest, lease_request, "$.ttl_ms", 0, "$.ttl_ms"),
    (LeaseRenewal, lambda: {"ttl_ms": 5000}, "$.ttl_ms", "5000", "$.ttl_ms"),
    (LeaseGrant, lambda: {"lease": "l-1", "ttl_ms": 1}, "$.lease", "a b", "$.lease"),
    (LeaseGrant, lambda: {"lease": "l-1", "ttl_ms": 1}, "$.block_keys", None, "$.block_keys"),
    (PlaceRequest, place_request, "$.prompt_tokens", 0, "$.prompt_tokens"),
    (PlaceRequest, place_request, "$.session", NIL_UUID, "$.session"),
    (PlaceRequest, place_request, "$.session", None, "$.session"),
    (PlaceResponse, place_response, "$.cost", DELETE, "$.cost"),
    (PlaceResponse, place_response, "$.cost", float("inf"), "$.cost"),
    (PlaceResponse, place_response, "$.directive", "x", "$.directive"),
]


@pytest.mark.parametrize(
    ("cls", "example", "where", "value", "expected"),
    BAD,
    ids=[f"{b[0].__name__}:{b[2]}={str(b[3])[:20]}" for b in BAD],
)
def test_bad_field_names_path(
    cls: Any, example: Callable[[], Any], where: str, value: Any, expected: str
) -> None:
    cls.from_json(example())  # the unmodified example is valid
    with pytest.raises(RecordError) as info:
        cls.from_json(mutate(example(), where, value))
    assert info.value.path == expected, str(info.value)
    assert str(info.value).startswith(expected + ": ")


def test_record_error_paths_are_relative_to_the_given_root() -> None:
    with pytest.raises(RecordError) as info:
        ReplicaRecord.from_json(mutate(spec_replica(), "$.size", -1), "$.records[4]")
    assert info.value.path == "$.records[4].size"


def test_residency_overlap_message() -> None:
    with pytest.raises(RecordError, match=r"overlaps \$\.residency\[0\]\.layers"):
        ReplicaRecord.from_json(mutate(spec_replica(), "$.residency[1].layers", [10, 31]))


def test_top_level_not_an_object() -> None:
    for cls in RECORDS:
        with pytest.raises(RecordError) as info:
            cls.from_json([])
        assert info.value.path == "$"
    with pytest.raises(RecordError) as info:
        TargetEstimate.from_json(None, "$.e", target="https://x.example/")
    assert info.value.path == "$.e"


def test_huge_integer_where_a_number_is_expected() -> None:
    obj = {"holder": "https://h1.example/", "mbit_per_s": 10**400, "rtt_us": 1}
    with pytest.raises(RecordError) as info:
        Link.from_json(obj)
    assert info.value.path == "$.mbit_per_s"


def test_lookup_request_caps_block_keys() -> None:
    obj = spec_lookup()
    obj["block_keys"] = [H32] * 1_000_001
    with pytest.raises(RecordError) as info:
        LookupRequest.from_json(obj)
    assert info.value.path == "$.block_keys"


def test_lookup_estimates_bad_target_key() -> None:
    obj = lookup_answer()
    obj["estimates"] = {"ftp://x/": {"fetch_us": 1, "recompute_us": 2}}
    with pytest.raises(RecordError) as info:
        LookupResponse.from_json(obj)
    assert info.value.path == "$.estimates['ftp://x/']"
    obj["estimates"] = {"https://ii7.example/kvsp/": {"fetch_us": -1, "recompute_us": 2}}
    with pytest.raises(RecordError) as info:
        LookupResponse.from_json(obj)
    assert info.value.path == "$.estimates['https://ii7.example/kvsp/'].fetch_us"


def test_reshard_message_needs_exactly_one_kind() -> None:
    for obj in (
        {"map": "m"},
        {"map": "m", "to": 5, "commit": 5},
        {"map": "m", "commit": 1, "abort": 1},
    ):
        with pytest.raises(RecordError) as info:
            parse_reshard_message(obj)
        assert info.value.path == "$"
    with pytest.raises(RecordError) as info:
        parse_reshard_message("commit")
    assert info.value.path == "$"


# --- absent, null and empty ------------------------------------------------------------------


def test_replica_optional_members_absent() -> None:
    obj = spec_replica()
    del obj["layer_digests"], obj["residency"]
    r = ReplicaRecord.from_json(obj)
    assert r.layer_digests is None and r.residency is None
    assert "layer_digests" not in r.to_json() and "residency" not in r.to_json()
    assert not r.verify_layer_digests()


def test_residency_without_layer_digests_is_not_bounded() -> None:
    obj = spec_replica()
    del obj["layer_digests"]
    obj["residency"] = [{"tier": "disk", "layers": [0, 79]}]
    assert ReplicaRecord.from_json(obj).residency == (Residency(tier=Tier.DISK, first=0, last=79),)


def test_verify_layer_digests_detects_a_wrong_digest() -> None:
    obj = spec_replica()
    obj["digest"] = "sha-256:" + H32
    assert not ReplicaRecord.from_json(obj).verify_layer_digests()


def test_lookup_targets_absent_vs_empty_and_compact() -> None:
    obj = spec_lookup()
    del obj["targets"]
    assert LookupRequest.from_json(obj).targets is None
    assert "targets" not in LookupRequest.from_json(obj).to_json()
    obj["targets"] = []
    assert LookupRequest.from_json(obj).targets == ()
    assert LookupRequest.from_json(obj).to_json()["targets"] == []
    obj["compact"] = True
    assert LookupRequest.from_json(obj).compact
    assert LookupRequest.from_json(obj).to_json()["compact"] is True
    obj["compact"] = False
    assert "compact" not in LookupRequest.from_json(obj).to_json()


def test_compact_lookup_answer_has_no_replicas() -> None:
    answer = LookupResponse.from_json({"matched": 5, "estimates": {}})
    assert answer.replicas is None and answer.estimates == () and answer.hint is None
    assert answer.to_json() == {"matched": 5, "estimates": {}}
    assert LookupResponse.from_json({"matched": 0, "replicas": []}).replicas == ()


def test_lookup_answer_estimates_keyed_by_target() -> None:
    answer = LookupResponse.from_json(lookup_answer())
    assert answer.estimates == (
        TargetEstimate(target="https://ii7.example/kvsp/", fetch_us=120.5, recompute_us=9000),
    )
    doubled = LookupResponse(matched=0, replicas=None, estimates=answer.estimates * 2)
    with pytest.raises(RecordError):
        doubled.to_json()


def test_lookup_answer_checked_against_request() -> None:
    record = ReplicaRecord.from_json(spec_replica())
    request = LookupRequest(
        scope_id=record.scope_id, compat_id=record.compat_id, block_keys=(record.block_key,)
    )
    LookupResponse(matched=1, replicas=((record,),)).check_answers(request)
    with pytest.raises(RecordError) as info:
        LookupResponse(matched=2, replicas=None).check_answers(request)
    assert info.value.path == "$.matched"
    other = LookupRequest(
        scope_id=record.scope_id, compat_id=record.compat_id, block_keys=(BlockKey(bytes(32)),)
    )
    with pytest.raises(RecordError) as info:
        LookupResponse(matched=1, replicas=((record,),)).check_answers(other)
    assert info.value.path == "$.replicas[0][0]"


def test_requested_state_null_absent_and_sleeping() -> None:
    obj = spec_status()
    del obj["requested_state"]
    assert InstanceStatusRecord.from_json(obj).requested_state is None
    obj["requested_state"] = "sleeping"
    status = InstanceStatusRecord.from_json(obj)
    assert status.requested_state is InstanceState.SLEEPING
    assert status.to_json()["requested_state"] == "sleeping"


def test_links_may_be_empty_but_not_repeat_a_holder() -> None:
    obj = spec_status()
    obj["links"] = []
    assert InstanceStatusRecord.from_json(obj).links == ()
    obj["links"] = [spec_status()["links"][0]] * 2
    with pytest.raises(RecordError) as info:
        InstanceStatusRecord.from_json(obj)
    assert info.value.path == "$.links[1]"


def test_sampler_absent_members_and_methods() -> None:
    greedy = Sampler.from_json({"method": "greedy", "step": 0, "deterministic": True})
    assert greedy.params == {} and greedy.seed is None
    assert greedy.to_json() == {
        "method": "greedy",
        "params": {},
        "seed": None,
        "step": 0,
        "deterministic": True,
    }
    base = {"step": 1, "deterministic": False, "seed": None}
    assert Sampler.from_json({**base, "method": "top-k", "params": {"k": 40}}).params == {"k": 40}
    assert Sampler.from_json({**base, "method": "temperature", "params": {"temperature": 0.7}})
    assert Sampler.from_json({**base, "method": "min-p", "params": {"min_p": "anything"}})
    bad = [
        ("top-k", {"k": 0}, "$.params.k"),
        ("top-k", {"k": 1.5}, "$.params.k"),
        ("top-k", {"k": 5, "temperature": 0}, "$.params.temperature"),
        ("temperature", {}, "$.params.temperature"),
        ("temperature", {"temperature": -1}, "$.params.temperature"),
        ("top-p", {"p": 0.5, "temperature": "hot"}, "$.params.temperature"),
    ]
    for method, params, path in bad:
        with pytest.raises(RecordError) as info:
            Sampler.from_json({**base, "method": method, "params": params})
        assert info.value.path == path


def test_checkpoint_uuid_case_and_output() -> None:
    obj = spec_checkpoint()
    obj["session"] = obj["session"].upper()
    checkpoint = SessionCheckpoint.from_json(obj)
    assert checkpoint.to_json()["session"] == "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"


def test_checkpoint_with_no_blocks_and_no_output() -> None:
    obj = spec_checkpoint()
    obj.update(prompt_blocks=[], generated=[], output_offset=0)
    checkpoint = SessionCheckpoint.from_json(obj)
    assert checkpoint.prompt_blocks == () and checkpoint.generated == ()


def test_resume_request_shape() -> None:
    resume = ResumeRequest.from_json(resume_request())
    assert resume.epoch == 2 and resume.checkpoint.epoch == 1
    assert resume.to_json() == {"epoch": 2, "checkpoint": spec_checkpoint()}


def test_lease_grant_block_keys_absent_vs_empty() -> None:
    assert LeaseGrant.from_json({"lease": "l-1", "ttl_ms": 9}).block_keys is None
    assert LeaseGrant.from_json({"lease": "l-1", "ttl_ms": 9, "block_keys": []}).block_keys == ()
    assert "block_keys" not in LeaseGrant(lease="l-1", ttl_ms=9).to_json()


def test_place_optional_members() -> None:
    obj = place_request()
    del obj["session"], obj["request_ref"]
    request = PlaceRequest.from_json(obj)
    assert request.session is None and request.request_ref is None
    assert request.to_json() == obj
    obj.update(block_keys=[], prompt_tokens=7)
    assert PlaceRequest.from_json(obj).block_keys == ()
    answer = place_response()
    del answer["directive"]
    assert PlaceResponse.from_json(answer).directive is None
    assert PlaceResponse.from_json(answer).cost_us == 1234.5


def test_prefetch_without_request_ref() -> None:
    obj = spec_prefetch()
    del obj["request_ref"]
    directive = PrefetchDirective.from_json(obj)
    assert directive.request_ref is None and "request_ref" not in directive.to_json()
    obj["request_ref"] = None
    assert PrefetchDirective.from_json(obj).request_ref is None


def test_directive_status_states() -> None:
    for state in DirectiveState:
        obj = {**directive_status(), "state": str(state)}
        assert DirectiveStatus.from_json(obj).state is state
    obj = directive_status()
    del obj["detail"]
    assert "detail" not in DirectiveStatus.from_json(obj).to_json()


def test_reshard_plan_disjoint_ranges() -> None:
    obj = loads(SPEC_RESHARD_PLAN)
    obj["release"] = [[49152, 65536]]
    assert ReshardPlan.from_json(obj).release == ((49152, 65536),)
    obj["release"] = [[40000, 50000]]
    with pytest.raises(RecordError) as info:
        ReshardPlan.from_json(obj)
    assert info.value.path == "$.release[0]"


# --- MOQT namespace --------------------------------------------------------------------------


def test_kv_namespace_and_round_trip() -> None:
    compat, scope, key = CompatId(bytes(range(32))), ScopeId(bytes(16)), BlockKey(b"\xff" * 32)
    fields = kv_namespace(compat, scope, key)
    assert fields == (
        b"kvsp",
        b"1",
        bytes(range(32)).hex().encode(),
        b"0" * 32,
        b"f" * 64,
    )
    text = encode_moqt_namespace(fields)
    assert "=" not in text and re.fullmatch(r"[A-Za-z0-9_-]+", text)
    assert decode_moqt_namespace(text) == fields
    obj = {
        **spec_replica(),
        "holder": MOQT,
        "moqt_namespace": text,
        "lease_base": "https://relay.example/",
    }
    record = ReplicaRecord.from_json(obj)
    assert record.namespace_fields == fields
    assert record.moqt_namespace == b"".join(bytes([len(f)]) + f for f in fields)
    assert record.to_json()["moqt_namespace"] == text
    assert record.lease_base == "https://relay.example/"


def test_moqt_carriers_are_read_and_written() -> None:
    carriers = ["moqt+tls://r.example:4444/", "moqt+unix://localhost/run/kvsp/relay.sock"]
    obj = {**spec_replica(), "holder": MOQT, "moqt_namespace": NAMESPACE}
    record = ReplicaRecord.from_json({**obj, "moqt_carriers": carriers})
    assert record.moqt_carriers == tuple(carriers)
    assert record.to_json()["moqt_carriers"] == carriers
    assert ReplicaRecord.from_json(obj).moqt_carriers is None
    assert "moqt_carriers" not in ReplicaRecord.from_json(obj).to_json()


@pytest.mark.parametrize(
    "carriers",
    [
        [],
        "moqt+tls://r.example:4444/",
        ["moqt://r.example:4443/"],
        ["https://r.example/"],
        ["moqt+tls://r.example:4444/", "moqt+tls://r.example:4444/"],
        [f"moqt+tcp://r.example:{p}/" for p in range(1, 10)],
        ["moqt+unix:///run/relay.sock"],
        [7],
    ],
)
def test_bad_moqt_carriers_are_refused_by_path(carriers: object) -> None:
    obj = {**spec_replica(), "holder": MOQT, "moqt_namespace": NAMESPACE}
    with pytest.raises(RecordError) as caught:
        ReplicaRecord.from_json({**obj, "moqt_carriers": carriers})
    assert caught.value.path is not None and caught.value.path.startswith("$.moqt_carriers")


def test_only_a_moqt_holder_offers_carriers() -> None:
    obj = {**spec_replica(), "moqt_carriers": ["moqt+tls://r.example:4444/"]}
    with pytest.raises(RecordError, match="only a moqt holder"):
        ReplicaRecord.from_json(obj)


def _b64(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "text",
    [
        _b64(b"\x04kvsp\x011\x01a\x01b") + "",  # four fields
        _b64(b"\x04kvsp\x011\x01a\x01b\x01c\x01d"),  # six fields
        _b64(b"\x04kvsp\x011\x01a\x01b\x01c\x00"),  # trailing zero-length field
        _b64(b"\x04kvsp\x011\x00\x01b\x01c"),  # empty field
        _b64(b"\x04kvsp\x011\x01a\x01b\x05c"),  # truncated field
        _b64(b"\x04kvsp\x011\x01a\x01b\x01c") + "=",  # padding
        _b64(b"\x04kvsp\x011\x01a\x01b\x01c").replace("_", "/") + "+",  # standard alphabet
        "A",  # impossible length
        "",  # nothing
        "QR",  # trailing bits set (canonical form is "QQ")
    ],
)
def test_decode_moqt_namespace_rejects(text: str) -> None:
    with pytest.raises(RecordError) as info:
        decode_moqt_namespace(text, "$.moqt_namespace")
    assert info.value.path == "$.moqt_namespace"


def test_encode_moqt_namespace_rejects() -> None:
    with pytest.raises(RecordError):
        encode_moqt_namespace([b"a"] * 4)
    with pytest.raises(RecordError):
        encode_moqt_namespace([b"a", b"b", b"c", b"d", b""])
    with pytest.raises(RecordError):
        encode_moqt_namespace([b"a", b"b", b"c", b"d", b"x" * 256])


# --- hypothesis: round trips -----------------------------------------------------------------

hex32s = st.binary(min_size=32, max_size=32)
uris = st.builds(
    "{}://{}.example{}/{}".format,
    st.sampled_from(["https", "http"]),
    st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
    st.sampled_from(["", ":8443"]),
    st.from_regex(r"[a-z0-9/]{0,12}", fullmatch=True),
)
rates = st.floats(min_value=1e-3, max_value=1e9, allow_nan=False, allow_infinity=False)
nonneg = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
namespace_fields = st.lists(st.binary(min_size=1, max_size=255), min_size=5, max_size=5)


@st.composite
def residencies(draw: st.DrawFn, layer_count: int) -> tuple[Residency, ...]:
    cuts = sorted(draw(st.sets(st.integers(0, layer_count), min_size=2, max_size=8)))
    entries = []
    for first, end in itertools.pairwise(cuts):
        if draw(st.booleans()):
            entries.append(
                Residency(
                    tier=draw(st.sampled_from(list(Tier))),
                    first=first,
                    last=end - 1,
                    read_mbit_per_s=draw(st.none() | rates),
                )
            )
    return tuple(draw(st.permutations(entries))) or (Residency(tier=Tier.HOST, first=0, last=0),)


carrier_uris = st.sampled_from(
    [
        "moqt+tls://relay.example:4444/",
        "moqt+tcp://127.0.0.1:4445/",
        "moqt+unix://localhost/run/kvsp/relay.sock",
        "moqt+tls://[::1]:9/kv",
    ]
)


carrier_lists = st.lists(carrier_uris, min_size=1, max_size=8, unique=True).map(tuple)


def _lease_base_on(holder: str) -> str:
    # lease_base must be on the holder's origin (its host, for a moqt holder)
    parts = urlsplit(holder)
    if parts.scheme == "moqt":
        return "http://relay.example:8/"
    return f"{parts.scheme}://{parts.netloc}/leases/"


@st.composite
def replica_records(draw: st.DrawFn) -> ReplicaRecord:
    layer_digests = draw(st.none() | st.lists(hex32s, min_size=1, max_size=40).map(tuple))
    count = len(layer_digests) if layer_digests else draw(st.integers(1, 200))
    namespace = draw(st.none() | namespace_fields)
    holder = draw(uris) if namespace is None else "moqt://relay.example:4443/"
    return ReplicaRecord(
        block_key=BlockKey(draw(hex32s)),
        compat_id=CompatId(draw(hex32s)),
        scope_id=ScopeId(draw(st.binary(min_size=16, max_size=16))),
        holder=holder,
        codec=draw(st.integers(0, 0xFFFF)),
        size=draw(u64),
        digest=draw(hex32s),
        layer_digests=layer_digests,
        residency=draw(st.none() | residencies(count)),
        ttl_ms=draw(u64),
        moqt_namespace=None
        if namespace is None
        else b"".join(bytes([len(f)]) + f for f in namespace),
        lease_base=draw(st.none() | st.just(_lease_base_on(holder))),
        moqt_carriers=None if namespace is None else draw(st.none() | carrier_lists),
    )


@given(replica_records())
def test_replica_record_round_trip(record: ReplicaRecord) -> None:
    assert ReplicaRecord.from_json(record.to_json()) == record
    assert ReplicaRecord.from_json(loads(dumps(record))) == record


@given(namespace_fields)
def test_moqt_namespace_round_trip(fields: list[bytes]) -> None:
    assert decode_moqt_namespace(encode_moqt_namespace(fields)) == tuple(fields)


links = st.builds(Link, holder=uris, mbit_per_s=rates, rtt_us=nonneg)


@st.composite
def statuses(draw: st.DrawFn) -> InstanceStatusRecord:
    link_list = draw(st.lists(links, max_size=4, unique_by=lambda link: link.holder))
    return InstanceStatusRecord(
        instance=draw(uris),
        epoch=draw(u64),
        state=draw(st.sampled_from(list(InstanceState))),
        running=draw(u64),
        queued=draw(u64),
        batch_size=draw(u64),
        kv_utilization=draw(st.floats(0, 1)),
        prefill_tokens_per_s=draw(nonneg),
        decode_tokens_per_s=draw(nonneg),
        links=tuple(link_list),
        requested_state=draw(st.sampled_from([None, InstanceState.SLEEPING])),
        ttl_ms=draw(u64),
    )


@st.composite
def checkpoints(draw: st.DrawFn) -> SessionCheckpoint:
    generated = tuple(draw(st.lists(u32, max_size=20)))
    sampler = draw(
        st.sampled_from(
            [
                Sampler(method="greedy", seed=None, step=0, deterministic=True),
                Sampler(method="top-p", params={"p": 0.9}, seed=7, step=3, deterministic=False),
                Sampler(
                    method="top-k",
                    params={"k": 40, "temperature": 0.8},
                    step=1,
                    deterministic=False,
                ),
            ]
        )
    )
    return SessionCheckpoint(
        session=draw(st.uuids(version=4)),
        epoch=draw(u64),
        compat_id=CompatId(draw(hex32s)),
        scope_id=ScopeId(draw(st.binary(min_size=16, max_size=16))),
        prompt_blocks=tuple(BlockKey(k) for k in draw(st.lists(hex32s, max_size=5))),
        prompt_tail=tuple(draw(st.lists(u32, max_size=15))),
        generated=generated,
        output_offset=len(generated),
        sampler=sampler,
    )


@st.composite
def shard_maps(draw: st.DrawFn) -> ShardMap:
    cuts = sorted(draw(st.sets(st.integers(0, 2**32 - 1), min_size=2, max_size=9)))
    return ShardMap(
        map=draw(st.from_regex(r"[A-Za-z0-9._~-]{1,40}", fullmatch=True)),
        version=draw(u64),
        shards=tuple(
            Shard(tokens=(a, b), instance=draw(uris)) for a, b in itertools.pairwise(cuts)
        ),
    )


@st.composite
def reshard_plans(draw: st.DrawFn) -> ReshardPlan:
    cuts = sorted(draw(st.sets(st.integers(0, 2**32 - 1), min_size=1, max_size=12)))
    ranges = list(itertools.pairwise(cuts))
    kinds = [draw(st.sampled_from(["retain", "fetch", "release", "none"])) for _ in ranges]
    version = draw(st.integers(0, 2**64 - 2))
    return ReshardPlan(
        map="m1",
        from_version=version,
        to_version=version + 1,
        deadline_ms=draw(u64),
        retain=tuple(r for r, k in zip(ranges, kinds, strict=True) if k == "retain"),
        fetch=tuple(
            ReshardFetch(tokens=r, source=draw(uris))
            for r, k in zip(ranges, kinds, strict=True)
            if k == "fetch"
        ),
        release=tuple(r for r, k in zip(ranges, kinds, strict=True) if k == "release"),
    )


key_tuples = st.lists(hex32s.map(BlockKey), max_size=6).map(tuple)
scopes = st.binary(min_size=16, max_size=16).map(ScopeId)
compats = hex32s.map(CompatId)

OTHER_RECORDS = st.one_of(
    statuses(),
    checkpoints(),
    checkpoints().map(
        lambda c: ResumeRequest(epoch=c.epoch + 1, checkpoint=c) if c.epoch < 2**64 - 1 else c
    ),
    shard_maps(),
    reshard_plans(),
    st.builds(
        LookupRequest,
        scope_id=scopes,
        compat_id=compats,
        block_keys=key_tuples,
        targets=st.none() | st.lists(uris, unique=True, max_size=3).map(tuple),
        compact=st.booleans(),
    ),
    st.builds(
        LookupResponse,
        matched=st.just(1),
        replicas=st.lists(replica_records(), min_size=1, max_size=2).map(lambda rs: (tuple(rs),)),
        estimates=st.none()
        | st.lists(uris, unique=True, max_size=3).map(
            lambda ts: tuple(TargetEstimate(target=t, fetch_us=1.5, recompute_us=2.0) for t in ts)
        ),
        hint=st.none() | st.text(max_size=50),
    ),
    st.builds(
        PrefetchDirective,
        directive=st.uuids(version=4),
        request_ref=st.none() | st.text(max_size=30),
        scope_id=scopes,
        compat_id=compats,
        blocks=st.lists(
            st.builds(
                DirectiveBlock,
                block_key=hex32s.map(BlockKey),
                sources=st.lists(uris, min_size=1, max_size=3, unique=True).map(tuple),
            ),
            min_size=1,
            max_size=3,
        ).map(tuple),
        deadline_ms=u64,
        lease_ms=st.integers(1, 2**64 - 1),
    ),
    st.builds(
        DirectiveStatus,
        directive=st.uuids(version=4),
        state=st.sampled_from(list(DirectiveState)),
        loaded=key_tuples,
        detail=st.none() | st.text(max_size=30),
    ),
    st.builds(
        LeaseRequest,
        compat_id=compats,
        scope_id=scopes,
        block_keys=st.lists(hex32s.map(BlockKey), min_size=1, max_size=4).map(tuple),
        ttl_ms=st.integers(1, 2**64 - 1),
    ),
    st.builds(LeaseRenewal, ttl_ms=st.integers(1, 2**64 - 1)),
    st.builds(
        LeaseGrant,
        lease=st.from_regex(r"[A-Za-z0-9._~-]{1,30}", fullmatch=True),
        ttl_ms=u64,
        block_keys=st.none() | key_tuples,
    ),
    st.builds(
        PlaceRequest,
        scope_id=scopes,
        compat_id=compats,
        block_keys=key_tuples,
        prompt_tokens=st.integers(6, 2**32),
        session=st.none() | st.uuids(version=4),
        request_ref=st.none() | st.text(max_size=30),
    ),
    st.builds(
        PlaceResponse,
        instance=uris,
        matched=u32,
        cost_us=nonneg,
        directive=st.none() | st.uuids(version=4),
    ),
    st.builds(StateAnswer, state=st.sampled_from(list(InstanceState))),
    st.builds(ReshardCommit, map=st.just("m"), commit=st.integers(1, 2**64 - 1)),
    st.builds(ReshardAbort, map=st.just("m"), abort=st.integers(1, 2**64 - 1)),
)


@settings(max_examples=300)
@given(OTHER_RECORDS)
def test_record_round_trip(record: Any) -> None:
    cls = type(record)
    assert cls.from_json(record.to_json()) == record
    assert cls.from_json(loads(dumps(record))) == record


# --- hypothesis: garbage in ------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=70)
    | st.sampled_from([H32, H16, UPPER, "sha-256:" + H32, "https://h.example/", "sleeping"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["tier", "layers", "state", "tokens", "map", "to", "commit", "abort"])
            | st.text(max_size=8),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)

PARSERS: list[Callable[[Any], Any]] = [cls.from_json for cls in RECORDS]
PARSERS += [
    parse_reshard_message,
    lambda obj: TargetEstimate.from_json(obj, target="https://t.example/"),
]


@settings(max_examples=300)
@given(json_values)
def test_arbitrary_json_parses_or_raises_kvsp_error(value: Any) -> None:
    for parse in PARSERS:
        with contextlib.suppress(KVSPError):
            parse(value)


def _members(value: Any, prefix: str = "$") -> list[str]:
    """Every JSON path inside ``value`` (objects and arrays)."""
    paths = []
    if isinstance(value, dict):
        for key, item in value.items():
            if re.fullmatch(r"[A-Za-z_0-9]+", key):
                paths.append(f"{prefix}.{key}")
                paths += _members(item, f"{prefix}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            paths.append(f"{prefix}[{i}]")
            paths += _members(item, f"{prefix}[{i}]")
    return paths


@settings(max_examples=400)
@given(st.data())
def test_mutated_examples_parse_or_raise_kvsp_error(data: st.DataObject) -> None:
    cls, example = data.draw(st.sampled_from(EXAMPLES))
    obj = example()
    where = data.draw(st.sampled_from(_members(obj)))
    value = data.draw(st.just(DELETE) | json_values)
    with contextlib.suppress(KVSPError):
        record = cls.from_json(mutate(obj, where, value))
        assert cls.from_json(record.to_json()) == record  # whatever is accepted round-trips


# --- loads / dumps ---------------------------------------------------------------------------


def nest(depth: int, inner: str = "1") -> bytes:
    """``depth`` levels of alternating arrays and objects around ``inner``."""
    text = inner
    for level in range(depth):
        text = f"[{text}]" if level % 2 else '{"k": ' + text + "}"
    return text.encode()


def test_loads_accepts_depth_limit_and_rejects_deeper() -> None:
    assert loads(nest(MAX_DEPTH)) is not None
    for depth in (MAX_DEPTH + 1, 1000, 100_000):
        with pytest.raises(RecordError) as info:
            loads(nest(depth))
        assert info.value.path == "$" and "malformed JSON" in str(info.value)
    with pytest.raises(RecordError):
        loads(b"[" * 1_000_000)


def test_loads_depth_ignores_brackets_in_strings() -> None:
    tricky = json.dumps({"s": "[[[{{" * 50 + '\\"]]' * 30, "t": ["\\", '"[', "]]]]]"]}).encode()
    assert loads(tricky)["t"][0] == "\\"
    deep_with_strings = nest(MAX_DEPTH + 1, json.dumps("]]]}}}" * 40))
    with pytest.raises(RecordError):
        loads(deep_with_strings)
    assert loads(nest(MAX_DEPTH, json.dumps("[[[{{{" * 40 + '\\"' + "]" * 200)))


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@given(
    st.integers(MAX_DEPTH - 8, MAX_DEPTH + 8),
    st.lists(st.tuples(st.booleans(), st.text(alphabet='[]{}"\\ab', max_size=6)), max_size=80),
    st.text(alphabet='[]{}"\\\n\u2028ab', max_size=20),
)
def test_loads_depth_check_is_exact(
    depth: int, wrappers: list[tuple[bool, str]], leaf: str
) -> None:
    value: Any = [leaf, {leaf: leaf}]
    wrappers = (wrappers + [(True, "x")] * depth)[: max(depth - 2, 0)]
    for as_list, key in wrappers:
        value = [key, value, key] if as_list else {key: value, key + "!": key}
    data = json.dumps(value, ensure_ascii=False).encode()
    if _depth(value) <= MAX_DEPTH:
        assert loads(data) == value
    else:
        with pytest.raises(RecordError):
            loads(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b'{"a": 1,}',
        b"[NaN]",
        b"[Infinity]",
        b"[-Infinity]",
        b"1e400",
        b"[-1e999]",
        b'{"a": 1, "a": 2}',
        b"\xff\xfe{}",
        b'"\xc3\x28"',
        b"\xef\xbb\xbf{}",
        b"{} {}",
        b"'single'",
        b"1" * 5000,
    ],
)
def test_loads_rejects(data: bytes) -> None:
    with pytest.raises(RecordError) as info:
        loads(data)
    assert info.value.path == "$" and str(info.value).startswith("$: malformed JSON")


def test_loads_input_types() -> None:
    assert loads('{"a": [1, 2.5, "é"]}') == {"a": [1, 2.5, "é"]}
    assert loads(bytearray(b"[true, null]")) == [True, None]
    assert loads(memoryview(b"7")) == 7
    with pytest.raises(RecordError):
        loads('"\ud800"')


@given(st.binary(max_size=300))
def test_loads_on_garbage_bytes(data: bytes) -> None:
    try:
        loads(data)
    except RecordError as exc:
        assert exc.path == "$"


@given(json_values)
def test_loads_dumps_round_trip(value: Any) -> None:
    assert loads(dumps(value)) == value


def test_dumps_is_compact_utf8_and_rejects_nan() -> None:
    assert dumps({"a": "é", "b": [1]}) == '{"a":"é","b":[1]}'.encode()
    assert dumps(StateAnswer(state=InstanceState.FAILED)) == b'{"state":"failed"}'
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})


def test_records_are_frozen_and_keyword_only() -> None:
    answer = StateAnswer(state=InstanceState.ACTIVE)
    with pytest.raises(AttributeError):
        answer.state = InstanceState.FAILED  # type: ignore[misc]
    with pytest.raises(TypeError):
        StateAnswer(InstanceState.ACTIVE)  # type: ignore[misc]
    assert not hasattr(answer, "__dict__")


def test_public_names_are_exported() -> None:
    for name in records.__all__:
        assert hasattr(records, name), name


def _residency_record(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "block_key": "ab" * 32,
        "compat_id": "cd" * 32,
        "scope_id": "ef" * 16,
        "holder": "http://h.example/",
        "codec": 1,
        "size": 100,
        "digest": "sha-256:" + "01" * 32,
        "layer_digests": ["02" * 32, "03" * 32],
        "residency": [{"tier": "host", "layers": [0, 1], "read_mbit_per_s": 400.5}],
        "ttl_ms": 1000,
    }
    record.update(changes)
    return record


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"block_key": "AB" * 32}, "$.block_key"),
        ({"block_key": 7}, "$.block_key"),
        ({"scope_id": "ef" * 15}, "$.scope_id"),
        ({"digest": "sha-256:" + "0" * 63}, "$.digest"),
        ({"digest": "sha256:" + "01" * 32}, "$.digest"),
        ({"codec": 0x10000}, "$.codec"),
        ({"codec": True}, "$.codec"),
        ({"size": -1}, "$.size"),
        ({"ttl_ms": 2**64}, "$.ttl_ms"),
        ({"residency": [{"tier": "host", "layers": [1, 0]}]}, "$.residency[0].layers"),
        ({"residency": [{"tier": "host", "layers": [0, 2**32]}]}, "$.residency[0].layers[1]"),
        ({"residency": [{"tier": "host", "layers": [0.5, 1]}]}, "$.residency[0].layers[0]"),
        ({"residency": [{"tier": "host", "layers": [True, 1]}]}, "$.residency[0].layers[0]"),
        (
            {"residency": [{"tier": "host", "layers": [0, 1], "read_mbit_per_s": -1.5}]},
            "$.residency[0].read_mbit_per_s",
        ),
        (
            {"residency": [{"tier": "host", "layers": [0, 1], "read_mbit_per_s": 0.0}]},
            "$.residency[0].read_mbit_per_s",
        ),
        (
            {"residency": [{"tier": "host", "layers": [0, 1], "read_mbit_per_s": float("nan")}]},
            "$.residency[0].read_mbit_per_s",
        ),
        (
            {"residency": [{"tier": "host", "layers": [0, 1], "read_mbit_per_s": float("inf")}]},
            "$.residency[0].read_mbit_per_s",
        ),
    ],
)
def test_record_fields_read_without_paths_still_name_them_when_bad(
    changes: dict[str, Any], path: str
) -> None:
    """Integers, floats, hex identifiers and layer pairs are read without formatting their JSON
    path; a bad one still raises at its exact path."""
    with pytest.raises(RecordError) as caught:
        ReplicaRecord.from_json(_residency_record(**changes))
    assert caught.value.path == path


def test_record_fast_reads_keep_the_values() -> None:
    record = ReplicaRecord.from_json(_residency_record(codec=0xFFFF, ttl_ms=2**64 - 1))
    assert record.codec == 0xFFFF and record.ttl_ms == 2**64 - 1
    assert record.block_key == bytes.fromhex("ab" * 32) and record.scope_id == b"\xef" * 16
    assert record.digest == b"\x01" * 32
    assert record.residency is not None
    assert (record.residency[0].first, record.residency[0].last) == (0, 1)
    assert record.residency[0].read_mbit_per_s == 400.5
    integral = ReplicaRecord.from_json(
        _residency_record(residency=[{"tier": "host", "layers": [0, 1], "read_mbit_per_s": 3}])
    )
    assert integral.residency is not None and integral.residency[0].read_mbit_per_s == 3.0
