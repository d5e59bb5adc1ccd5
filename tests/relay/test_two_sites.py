"""Two sites on 127.0.0.1, every part a real process: the PC sends an edge instance to its edge
relay for a prefix computed at the central site (spec §6.4, §6.5; DESIGN.md §4).

central: ``kvsp serve control``, a relay (site ``central``) and an instance (site
``central``, ``--relay`` the central relay, so its computed blocks are announced and pushed
there). edge: a relay (site ``edge``, ``--upstream`` the central relay) and an instance (site
``edge``, ``--relay`` the edge relay). The edge instance has measured no link and no holder
is in its site, so no Replica Record names a source it may use; the PC names its relay, the
edge instance FETCHes over MOQT from the edge relay, which passes the miss upstream and caches
what comes back. The central instance is drained, so the placement goes to the edge.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.engine.toy import toy_descriptor
from kvsp.ids import ScopeId, uri_id
from kvsp.keys import block_keys, scope_id
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService
from tests.support.polling import eventually
from tests.support.services import Services

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ADMIN = "two-sites-admin-token-0123456789abcdef"
SCOPE_KEY = bytes(range(40, 80))
SCOPE = ScopeId(scope_id(SCOPE_KEY))
DESCRIPTOR = toy_descriptor(layers=6, block_tokens=16)
COMPAT = compat_id(DESCRIPTOR)
PROMPT = [(17 * i + 3) % 50_000 for i in range(3 * 16 + 4)]  # three complete blocks


class Sites:
    """The processes and the admin's HTTP client."""

    def __init__(self, root: Path) -> None:
        self.root = root
        principals = root / "principals.toml"
        write_principals(principals, [principal_entry("admin", ADMIN, ["admin"], None)])
        (root / "admin.token").write_text(ADMIN)
        (root / "scope.key").write_text(SCOPE_KEY.hex())
        (root / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
        self.services = Services(root, principals)
        self.http = httpx.Client(timeout=30, headers={"authorization": f"Bearer {ADMIN}"})

    def token(self) -> str:
        return str(self.root / "admin.token")

    def relay(self, name: str, control: str, site: str, *extra: str) -> tuple[dict[str, str], str]:
        started = self.services.start(
            name,
            *("relay", "--index", control, "--token-file", self.token(), "--site", site),
            *extra,
        )
        cert = self.root / name / "state" / "relay-tls" / "cert.pem"
        return json.loads(started.base_url), str(cert)

    def instance(self, name: str, control: str, *extra: str) -> RunningService:
        return self.services.start(
            name,
            *("instance", "--control", control, "--token-file", self.token()),
            *("--descriptor", str(self.root / "descriptor.json")),
            *("--scope-key-file", str(self.root / "scope.key")),
            *("--log-format", "text"),
            *extra,
        )

    def rows(self, control: str) -> dict[str, dict[str, Any]]:
        answer = self.http.get(f"{control}instances")
        assert answer.status_code == 200, answer.text
        return {row["instance"]: row for row in answer.json()["instances"]}

    def holders(self, control: str, keys: list[bytes]) -> list[dict[str, str | None]] | None:
        """Per key, each holder of a replica and the ``site`` its record carries."""
        body = {"scope_id": SCOPE.hex(), "compat_id": COMPAT.hex(), "block_keys": []}
        body["block_keys"] = [k.hex() for k in keys]
        answer = self.http.post(f"{control}lookup", json=body)
        assert answer.status_code == 200, answer.text
        found = answer.json().get("replicas") or []
        if len(found) < len(keys):
            return None
        return [{r["holder"]: r.get("site") for r in records} for records in found]


def test_a_central_prefix_reaches_the_edge_instance_through_its_relay(tmp_path: Path) -> None:
    sites = Sites(tmp_path)
    try:
        control = sites.services.start(
            "control", "control", "--directive-token-file", sites.token()
        ).base_url
        central_relay, central_cert = sites.relay("relay-central", control, "central")
        edge_relay, edge_cert = sites.relay(
            "relay-edge",
            control,
            "edge",
            *("--upstream", central_relay["moqt"], "--upstream-token-file", sites.token()),
            *("--cafile", central_cert),
        )
        central = sites.instance(
            "central",
            control,
            *("--site", "central", "--relay", central_relay["moqt"], "--cafile", central_cert),
        )
        edge = sites.instance(
            "edge",
            control,
            *("--site", "edge", "--zone", "z1", "--relay", edge_relay["moqt"]),
            *("--cafile", edge_cert),
        )
        scenario(sites, control, central, edge, central_relay["moqt"], edge_relay["moqt"])
    finally:
        sites.http.close()
        sites.services.stop_all()


def scenario(
    sites: Sites,
    control: str,
    central: RunningService,
    edge: RunningService,
    central_relay: str,
    edge_relay: str,
) -> None:
    keys = block_keys(SCOPE_KEY, COMPAT, PROMPT, DESCRIPTOR.block_tokens)
    assert len(keys) == 3
    computed = sites.http.post(
        f"{central.base_url}generate", json={"prompt": PROMPT, "max_tokens": 2}
    )
    assert computed.status_code == 200, computed.text
    assert computed.headers["kvsp-computed-blocks"] == "3"
    # the central instance's holder face and the central relay hold the prefix; nobody at the edge
    everywhere = eventually(
        lambda: (
            found
            if (found := sites.holders(control, keys))
            and all({central.base_url, central_relay} <= h.keys() for h in found)
            else None
        ),
        60,
    )
    assert all(edge_relay not in h and edge.base_url not in h for h in everywhere)
    # each holder labels its records with its site: the instance's holder face, the relay
    assert all(h[central.base_url] == h[central_relay] == "central" for h in everywhere)

    rows = eventually(lambda: r if len(r := sites.rows(control)) == 2 else None, 30)
    assert (rows[edge.base_url]["site"], rows[edge.base_url]["zone"]) == ("edge", "z1")
    assert (rows[central.base_url]["site"], rows[central.base_url]["zone"]) == ("central", None)
    drained = sites.http.put(
        f"{control}instances/{uri_id(central.base_url)}/state", json={"state": "draining"}
    )
    assert drained.status_code == 200, drained.text

    body = {
        "scope_id": SCOPE.hex(),
        "compat_id": COMPAT.hex(),
        "block_keys": [k.hex() for k in keys],
        "prompt_tokens": len(PROMPT),
        "deadline_ms": 60_000,
    }
    placed = sites.http.post(f"{control}place", json=body)
    assert placed.status_code == 200, placed.text
    answer = placed.json()
    assert answer["instance"] == edge.base_url and answer["matched"] == 3
    assert answer.get("directive"), answer  # loading is cheaper than recomputing: a directive

    def final() -> dict[str, Any] | None:
        status = sites.http.get(f"{edge.base_url}prefetch/{answer['directive']}").json()
        return status if status["state"] != "pending" else None

    status = eventually(final, 60)
    assert status["state"] == "complete", (status, edge.output()[-3000:])
    assert status["loaded"] == [k.hex() for k in keys]
    # the blocks came over MOQT from the edge relay, and only from there: the only link the
    # edge instance measured is its relay (a directive names a source, the instance measures it)
    record = eventually(
        lambda: s if (s := sites.http.get(f"{edge.base_url}status").json())["links"] else None, 30
    )
    assert [link["holder"] for link in record["links"]] == [edge_relay]
    assert (record["site"], record["zone"], record["relay"]) == ("edge", "z1", edge_relay)

    # the edge relay cached what it passed through and publishes it, labelled with its site
    def edge_relay_records() -> list[dict[str, Any]] | None:
        lookup = {"scope_id": SCOPE.hex(), "compat_id": COMPAT.hex()}
        lookup["block_keys"] = [k.hex() for k in keys]  # type: ignore[assignment]
        found = sites.http.post(f"{control}lookup", json=lookup).json().get("replicas") or []
        mine = [r for records in found for r in records if r["holder"] == edge_relay]
        return mine if len(mine) == len(keys) else None

    assert {r.get("site") for r in eventually(edge_relay_records, 60)} == {"edge"}
    # the edge instance now serves the prompt from what it loaded
    generated = sites.http.post(
        f"{edge.base_url}generate", json={"prompt": PROMPT, "max_tokens": 2}
    )
    assert generated.status_code == 200, generated.text
    assert generated.headers["kvsp-loaded-blocks"] == "3"
    assert "failed" not in "".join(
        line for line in edge.output().splitlines() if "block " in line and edge_relay in line
    )
