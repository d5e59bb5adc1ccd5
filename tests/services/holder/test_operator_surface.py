"""The operator's surface of real ``kvsp serve`` processes: a holder without ``--descriptor``
learns descriptors from its Index Service (§6.1, §6.7), ``/readyz`` beside ``/healthz``,
principals reloaded on SIGHUP, and a wildcard ``--listen`` that needs ``--public-url``."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, ServiceStartError, start_process
from tests.support.polling import eventually
from tests.support.tiny_holder import COMPAT, DESCRIPTOR, SCOPE, container, key

SERVICE_TOKEN = "service-token-0123456789abcdefghijklmn"
CLIENT_TOKEN = "client-token-0123456789abcdefghijklmno"
LATE_TOKEN = "late-token-0123456789abcdefghijklmnopqr"
KVSP_SERVE = [sys.executable, "-m", "kvsp", "serve"]


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _entries() -> list[dict[str, object]]:
    return [
        principal_entry("service", SERVICE_TOKEN, ["admin"], None),
        principal_entry("client", CLIENT_TOKEN, ["client", "instance"], [SCOPE]),
    ]


@dataclass
class Site:
    root: Path
    principals: Path
    token_file: Path
    http: httpx.Client

    def serve(self, name: str, *argv: str) -> RunningService:
        folder = self.root / name
        folder.mkdir(exist_ok=True)
        command = [*KVSP_SERVE, *argv, "--principals", str(self.principals)]
        command += ["--state", str(folder / "state"), "--log-level", "info"]
        if "--listen" not in argv:
            command += ["--listen", "127.0.0.1:0"]
        return start_process(command, workdir=folder, ready_timeout=60)

    def holder(self, index: RunningService | None, *argv: str) -> RunningService:
        extra = [] if index is None else ["--index", index.base_url]
        extra += [] if index is None else ["--index-token-file", str(self.token_file)]
        return self.serve("holder", "holder", *extra, *argv)

    def put_block(self, holder: RunningService, n: int, token: str) -> httpx.Response:
        url = f"{holder.base_url}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key(n).hex()}"
        headers = _bearer(token) | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        return self.http.put(url, content=container(n), headers=headers)


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    principals = tmp_path / "principals.toml"
    write_principals(principals, _entries())
    token_file = tmp_path / "service.token"
    token_file.write_text(SERVICE_TOKEN + "\n")
    with httpx.Client(timeout=10) as http:
        yield Site(tmp_path, principals, token_file, http)


def test_holder_without_descriptor_learns_it_from_the_index(site: Site) -> None:
    with site.serve("index", "index") as index, site.holder(index) as holder:
        # unknown here and at the IS: still 422
        assert site.put_block(holder, 1, CLIENT_TOKEN).status_code == 422
        registered = site.http.put(
            f"{index.base_url}descriptors/{COMPAT.hex()}",
            json=DESCRIPTOR.to_json(),
            headers=_bearer(SERVICE_TOKEN),
        )
        assert registered.status_code in (200, 201), registered.text
        stored = site.put_block(holder, 1, CLIENT_TOKEN)
        assert stored.status_code == 201, stored.text
        known = site.http.get(
            f"{holder.base_url}descriptors/{COMPAT.hex()}", headers=_bearer(CLIENT_TOKEN)
        )
        assert known.status_code == 200 and known.json() == DESCRIPTOR.to_json()


def test_readyz_needs_no_token_and_follows_the_index(site: Site) -> None:
    index = site.serve("index", "index")
    try:
        with site.holder(index) as holder:
            for service in (index, holder):
                ready = site.http.get(f"{service.base_url}readyz")
                assert ready.status_code == 200, ready.text
                assert ready.json() == {"status": "ready"}
            index.stop()
            answer = site.http.get(f"{holder.base_url}readyz")
            assert answer.status_code == 503
            assert answer.headers["content-type"].startswith("application/problem+json")
            assert answer.json()["type"].endswith("kvsp-not-ready")
            assert site.http.get(f"{holder.base_url}healthz").status_code == 200  # alive
    finally:
        index.stop()


def test_sighup_reloads_principals_and_keeps_them_on_a_bad_file(site: Site) -> None:
    with site.holder(None, "--descriptor", str(_descriptor_file(site.root))) as holder:
        assert site.put_block(holder, 1, LATE_TOKEN).status_code == 401
        late = principal_entry("late", LATE_TOKEN, ["instance"], [SCOPE])
        write_principals(site.principals, [*_entries(), late])  # minted after start
        holder.proc.send_signal(signal.SIGHUP)
        eventually(lambda: site.put_block(holder, 1, LATE_TOKEN).status_code == 201)

        site.principals.write_text("[[principal]]\nname = 3\n")  # does not load
        holder.proc.send_signal(signal.SIGHUP)
        eventually(lambda: "principals not reloaded" in holder.output())
        assert holder.proc.poll() is None
        assert site.put_block(holder, 2, LATE_TOKEN).status_code == 201  # old ones kept
        assert site.put_block(holder, 3, CLIENT_TOKEN).status_code == 201


def test_wildcard_listen_needs_public_url(site: Site) -> None:
    with pytest.raises(ServiceStartError, match="wildcard address.*--public-url"):
        site.holder(None, "--listen", "0.0.0.0:0")
    instance = [*KVSP_SERVE, "instance", "--listen", "[::]:0", "--state", str(site.root / "i")]
    instance += ["--pc", "http://127.0.0.1:9/", "--token-file", str(site.token_file)]
    done = subprocess.run(instance, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "wildcard address" in done.stderr and "--public-url" in done.stderr, done.stderr

    public = "http://holder.example.test:8471/"
    argv = ["--listen", "0.0.0.0:0", "--public-url", public]
    argv += ["--descriptor", str(_descriptor_file(site.root))]
    with site.holder(None, *argv) as holder:
        stored = site.put_block(holder, 1, CLIENT_TOKEN)
        assert stored.status_code == 201, stored.text
        assert stored.headers["location"].startswith(public)
        assert stored.json()["holder"] == public


def _descriptor_file(root: Path) -> Path:
    import json

    path = root / "descriptor.json"
    path.write_text(json.dumps(DESCRIPTOR.to_json()))
    return path


def test_readyz_of_an_instance_follows_its_registration(site: Site) -> None:
    control = site.serve("control", "control")
    try:
        argv = ["instance", "--pc", control.base_url, "--token-file", str(site.token_file)]
        with site.serve("instance", *argv, "--status-ttl-ms", "1500") as instance:
            url = f"{instance.base_url}readyz"
            eventually(lambda: site.http.get(url).status_code == 200, what="registered")
            assert site.http.get(f"{control.base_url}readyz").status_code == 200
            control.stop()
            answer = eventually(lambda: _not_ready(site.http.get(url)), what="503 once gone")
            assert "Index Service" in str(answer["detail"]) or "PC" in str(answer["detail"])
    finally:
        control.stop()


def test_readyz_of_the_index_follows_its_store(site: Site) -> None:
    import shutil

    from tests.conftest import _start_redis

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    started = _start_redis(exe, site.root)
    if isinstance(started, str):
        pytest.skip(f"redis-server could not start: {started}")
    redis, port = started
    try:
        store = f"redis://127.0.0.1:{port}/0"
        with site.serve("index", "index", "--store", store) as index:
            url = f"{index.base_url}readyz"
            assert site.http.get(url).status_code == 200
            redis.kill()
            redis.wait()
            answer = eventually(lambda: _not_ready(site.http.get(url)), what="503 once gone")
            assert "store" in str(answer["detail"])
            assert site.http.get(f"{index.base_url}healthz").status_code == 200
    finally:
        redis.kill()
        redis.wait()


def _not_ready(answer: httpx.Response) -> dict[str, object] | None:
    if answer.status_code != 503:
        return None
    body: dict[str, object] = answer.json()
    assert str(body["type"]).endswith("kvsp-not-ready")
    return body
