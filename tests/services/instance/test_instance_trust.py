"""One trust setting for every outbound TLS connection of an instance (DESIGN.md §3 TLS;
spec §6.5 prefetch, §6.6 leases, §6.7 verification).

Every part a real process on 127.0.0.1: ``kvsp serve control``, a relay whose MOQT and HTTPS
faces carry a certificate signed by a private CA (``--cert``/``--key``), and instances given
only ``--cafile CA.pem`` (or ``--relay-cafile CA.pem``, the deprecated alias that now means the
same). Instance A publishes a prompt's blocks into the relay (its relay link
trusts the CA) and is killed; instance B is directed to prefetch them from the relay: it takes
its lease on the relay's HTTPS face and FETCHes over MOQT, both trusting the CA. Instance C,
given no ``--cafile``, fails the same directive, and its warning log names the cause
(``certificate verify failed``).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.engine.toy import toy_descriptor
from kvsp.ids import BlockKey, ScopeId
from kvsp.keys import block_keys, scope_id
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService
from tests.support.polling import eventually
from tests.support.private_ca import make_private_ca
from tests.support.services import Services

pytestmark = pytest.mark.timeout(180)
ADMIN = "trust-admin-token-0123456789abcdef0123"
SCOPE_KEY = bytes(range(60, 100))
SCOPE = ScopeId(scope_id(SCOPE_KEY))
DESCRIPTOR = toy_descriptor(layers=6, block_tokens=16)
COMPAT = compat_id(DESCRIPTOR)
PROMPT = [(13 * i + 5) % 50_000 for i in range(3 * 16 + 3)]  # three complete blocks


class Site:
    """The processes of one test and what it needs to talk to them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        principals = root / "principals.toml"
        write_principals(principals, [principal_entry("admin", ADMIN, ["admin"], None)])
        (root / "admin.token").write_text(ADMIN)
        (root / "scope.key").write_text(SCOPE_KEY.hex())
        (root / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
        self.services = Services(root, principals)
        self.http = httpx.Client(timeout=30, headers={"authorization": f"Bearer {ADMIN}"})

    def instance(self, name: str, control: str, *extra: str) -> RunningService:
        return self.services.start(
            name,
            *("instance", "--pc", control),
            *("--token-file", str(self.root / "admin.token")),
            *("--descriptor", str(self.root / "descriptor.json")),
            *("--scope-key-file", str(self.root / "scope.key")),
            *("--log-format", "text"),
            *extra,
        )

    def relay_holds(self, control: str, keys: list[BlockKey], relay: str) -> bool | None:
        body = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": [k.hex() for k in keys],
        }
        answer = self.http.post(f"{control}lookup", json=body)
        assert answer.status_code == 200, answer.text
        holders = [{r["holder"] for r in rs} for rs in answer.json()["replicas"]]
        # the lookup lists the matched prefix only: none matched yet is not "the relay holds all"
        held = len(holders) == len(keys) and all(relay in h for h in holders)
        return True if held else None

    def prefetch(self, instance: RunningService, keys: list[BlockKey], source: str) -> Any:
        directive = {
            "directive": str(uuid.uuid4()),
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "blocks": [{"block_key": k.hex(), "sources": [source]} for k in keys],
            "layer_order": "ascending",
            "deadline_ms": 30_000,
            "lease_ms": 10_000,
        }
        answer = self.http.post(f"{instance.base_url}prefetch", json=directive)
        assert answer.status_code == 202, answer.text
        location = answer.headers["location"]

        def finished() -> Any:
            status = self.http.get(location).json()
            return status if status["state"] != "pending" else None

        return eventually(finished, 60)

    def close(self) -> None:
        self.services.stop_all()
        self.http.close()


@pytest.mark.parametrize("option", ["--cafile", "--relay-cafile"])
def test_cafile_alone_trusts_a_ca_signed_relay_for_leases_and_moqt(
    tmp_path: Path, option: str
) -> None:
    issued = make_private_ca(tmp_path / "ca")
    site = Site(tmp_path)
    try:
        control = site.services.start("control", "control")
        relay = site.services.start(
            "relay",
            *("relay", "--index", control.base_url),
            *("--token-file", str(tmp_path / "admin.token")),
            *("--cert", str(issued.cert), "--key", str(issued.key)),
        )
        faces = json.loads(relay.base_url)
        assert faces["http"].startswith("https://")  # leases go to the relay's HTTPS face
        cafile = (option, str(issued.ca))  # --relay-cafile: the deprecated alias
        a = site.instance("a", control.base_url, "--relay", faces["moqt"], *cafile)
        answer = site.http.post(f"{a.base_url}generate", json={"prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        keys = block_keys(SCOPE_KEY, COMPAT, PROMPT, DESCRIPTOR.block_tokens)
        assert len(keys) == 3
        eventually(lambda: site.relay_holds(control.base_url, keys, faces["moqt"]), 60)
        a.proc.kill()  # the relay's cache is now the only source
        a.proc.wait(10)

        b = site.instance("b", control.base_url, *cafile)
        status = site.prefetch(b, keys, faces["moqt"])
        assert status["state"] == "complete", (status, b.output()[-4000:])
        assert status["loaded"] == [k.hex() for k in keys]
        if option == "--relay-cafile":
            assert "--relay-cafile is deprecated and means --cafile" in b.output()

        c = site.instance("c", control.base_url)  # the system trust store: no CA of ours
        status = site.prefetch(c, keys, faces["moqt"])
        assert status["state"] != "complete", status
        output = c.output()
        failed = [line for line in output.splitlines() if "failed" in line and "WARNING" in line]
        assert any("certificate verify failed" in line for line in failed), output[-4000:]
        assert any("kvsp-unreachable" in line for line in failed), output[-4000:]
        assert ADMIN not in output
    finally:
        site.close()
