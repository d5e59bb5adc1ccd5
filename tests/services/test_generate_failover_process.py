"""``kvsp generate`` and instances given several control planes (``--pc A,B``, ``--control
A,B``: kvsp.web.failover), among real processes on 127.0.0.1: two ``kvsp serve control`` on one
real Redis (sessions shared, §6.8), a holder keeping copies of session blocks, two toy
instances, the ``kvsp generate`` command.

* a dead first ``--pc`` URL: generate uses the next and completes;
* the PC a session was placed through dies mid-generation, then the instance serving it:
  the instances report to the second PC, which moves the session (§6.8), and generate follows
  it there, printing every token exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.runner import bind_socket
from kvsp.web.testing import RunningService, start_process
from tests.services.instance.test_instance_process import (
    AUTH,
    DESCRIPTOR,
    SCOPE_KEY,
    TOKEN,
    reference,
)
from tests.support.polling import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass
class Sites:
    folder: Path
    controls: list[RunningService]
    instances: dict[str, RunningService]
    http: httpx.Client

    def rows(self, control: int) -> dict[str, dict[str, Any]]:
        """GET instances at one control plane, by instance URL."""
        answer = self.http.get(f"{self.controls[control].base_url}instances", headers=AUTH)
        assert answer.status_code == 200, answer.text
        return {row["instance"]: row for row in answer.json()["instances"]}

    def generate(self, pcs: str, *argv: str) -> subprocess.Popen[str]:
        """``kvsp generate --pc PCS`` of the toy descriptor in the scope."""
        command = [
            *(sys.executable, "-m", "kvsp", "generate", "--pc", pcs),
            *("--token-file", str(self.folder / "token")),
            *("--descriptor", str(self.folder / "descriptor.json")),
            *("--scope-key-file", str(self.folder / "scope.key"), *argv),
        ]
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ
        )


def _serve(folder: Path, name: str, service: str, *argv: str) -> RunningService:
    workdir = folder / name
    workdir.mkdir()
    return start_process(
        [sys.executable, "-m", "kvsp", "serve", service, "--listen", "127.0.0.1:0",
         "--principals", str(folder / "principals.toml"), "--state", str(workdir / "state"),
         "--log-level", "info", "--log-format", "text", *argv],
        workdir=workdir,
    )  # fmt: skip


@pytest.fixture
def sites(tmp_path: Path, redis_url: str) -> Iterator[Sites]:
    write_principals(
        tmp_path / "principals.toml", [principal_entry("admin", TOKEN, ["admin"], None)]
    )
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    (tmp_path / "scope.key").write_text(SCOPE_KEY.hex())
    started: list[RunningService] = []
    try:
        descriptor = ("--descriptor", str(tmp_path / "descriptor.json"))
        for n in range(2):
            pc = ("--store", redis_url, "--directive-token-file", str(token))
            extra = ("--status-sweep-ms", "50", "--failover-deadline-ms", "20000")
            started.append(_serve(tmp_path, f"control-{n}", "control", *descriptor, *pc, *extra))
        controls = list(started)
        both = ",".join(c.base_url for c in controls)
        index = ("--index", both, "--index-token-file", str(token))
        started.append(holder := _serve(tmp_path, "holder", "holder", *index, *descriptor))
        instances = {}
        for name in ("x", "y"):
            instances[name] = _serve(
                tmp_path,
                name,
                "instance",
                *("--pc", both, "--token-file", str(token), *descriptor),
                *("--scope-key-file", str(tmp_path / "scope.key"), "--status-ttl-ms", "900"),
                *("--toy-decode-ms", "40", "--checkpoint-every", "4"),
                *("--replica-holder", holder.base_url),  # session blocks outlive the instance
            )
            started.append(instances[name])
        with httpx.Client(timeout=30) as http:
            world = Sites(tmp_path, controls, instances, http)
            eventually(lambda: len(world.rows(0)) == 2, 30, "both instances at the first PC")
            yield world
    finally:
        for service in reversed(started):
            service.stop()


def dead_url() -> str:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/"


def test_generate_skips_a_dead_first_pc(sites: Sites) -> None:
    prompt = list(range(300, 321))
    expected, _ = reference(prompt, 8)
    generate = sites.generate(
        f"{dead_url()},{sites.controls[0].base_url}",
        *("--tokens", ",".join(map(str, prompt)), "--max-tokens", "8", "--verbose"),
    )
    with generate:
        out, err = generate.communicate(timeout=120)
    assert generate.returncode == 0, err
    assert [json.loads(line)["token"] for line in out.splitlines()] == expected
    assert "failing over to " + sites.controls[0].base_url in err


def test_generate_follows_the_session_through_the_second_pc(sites: Sites) -> None:
    prompt = list(range(700, 733))
    count = 60
    expected, _ = reference(prompt, count)
    generate = sites.generate(
        ",".join(c.base_url for c in sites.controls),
        *("--tokens", ",".join(map(str, prompt)), "--max-tokens", str(count), "--verbose"),
    )
    with generate:
        lines, err = _follow(sites, generate, count)
    assert [line["index"] for line in lines] == list(range(count))  # every token once
    assert [line["token"] for line in lines] == expected
    assert f"failing over to {sites.controls[1].base_url}" in err
    assert "kvsp: failovers: 0" not in err  # it followed the session to the other instance
    assert "kvsp: PC failovers: 0" not in err


def _follow(
    sites: Sites, generate: subprocess.Popen[str], count: int
) -> tuple[list[dict[str, Any]], str]:
    """Kill the first PC once a token came, then the instance serving the session; the lines
    generate printed and its stderr."""
    lines: list[dict[str, Any]] = []

    def read() -> None:
        assert generate.stdout is not None
        for line in generate.stdout:
            lines.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    eventually(lambda: lines, 60, "the first token")
    sites.controls[0].proc.send_signal(signal.SIGKILL)  # the PC it was placed through dies
    sites.controls[0].proc.wait(10)

    def serving() -> str | None:
        rows = sites.rows(1)  # the instances report to the second PC now
        if len(rows) < 2 or any(row["state"] != "active" for row in rows.values()):
            return None
        return next((url for url, row in rows.items() if row["running"] > 0), None)

    at = eventually(serving, 30, "both instances active at the second PC, one serving")
    assert len(lines) < count, "the generation ended before the kill; make it longer"
    victim = next(s for s in sites.instances.values() if s.base_url == at)
    victim.proc.send_signal(signal.SIGKILL)  # then the instance serving the session
    reader.join(120)
    assert generate.stderr is not None
    err = generate.stderr.read()
    assert generate.wait(30) == 0, err
    return lines, err
