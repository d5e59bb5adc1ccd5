"""A real ``kvsp serve instance`` process stopped with SIGTERM (§6.3 draining; the two-sites
contract's graceful leave): it reports draining at once, the generation in flight finishes,
its replicas are withdrawn at the IS in one request and its epoch is ended at the PC, and it
exits 0. Against the real ``kvsp serve control``, and against the recording control plane of
``tests.support.contract_control``, which logs the order of the calls the instance makes (and
lets a test kill the first of two PCs)."""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.ids import uri_id
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService
from tests.services.instance.test_instance_process import (
    AUTH,
    DESCRIPTOR,
    SCOPE_KEY,
    TOKEN,
    instance_argv,
    reference,
    serve,
)
from tests.support.contract_control import serve_contract_control
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # instance processes


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_principals(
        tmp_path / "principals.toml", [principal_entry("admin", TOKEN, ["admin"], None)]
    )
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    (tmp_path / "scope.key").write_text(SCOPE_KEY.hex())
    return tmp_path


class _Control:
    """Stands for a control plane's base URL in :func:`instance_argv`."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


def start_instance(folder: Path, control: str, *argv: str) -> RunningService:
    options = instance_argv(folder, _Control(control))  # type: ignore[arg-type]
    logs = ("--log-level", "info", "--log-format", "text")
    return serve(folder, "instance", *options, *logs, "--toy-decode-ms", "40", *argv)


def stream_in_thread(url: str, prompt: list[int], count: int) -> tuple[threading.Thread, list[Any]]:
    """POST generate in a thread; the lines it read go to the list (an exception last)."""
    lines: list[Any] = []

    def read() -> None:
        try:
            with (
                httpx.Client(timeout=30) as http,
                http.stream(
                    "POST",
                    f"{url}generate",
                    json={"prompt": prompt, "max_tokens": count},
                    headers=AUTH,
                ) as answer,
            ):
                for line in answer.iter_lines():
                    if line:
                        lines.append(json.loads(line))
        except Exception as exc:  # the test asserts on what arrived
            lines.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, lines


def publish_some(url: str, http: httpx.Client) -> None:
    """A short generation, whose computed blocks the instance publishes."""
    answer = http.post(
        f"{url}generate", json={"prompt": list(range(40)), "max_tokens": 1}, headers=AUTH
    )
    assert answer.status_code == 200, answer.text


def sigterm_mid_generation(instance: RunningService) -> list[Any]:
    """SIGTERM while a 20-token generation streams; the lines it read."""
    prompt = list(range(500, 523))
    thread, lines = stream_in_thread(instance.base_url, prompt, 20)
    eventually(lambda: lines, 30, "the first token")
    instance.proc.send_signal(signal.SIGTERM)
    assert instance.proc.wait(timeout=60) == 0, instance.output()[-3000:]
    thread.join(30)
    expected, _ = reference(prompt, 20)
    assert [line["token"] for line in lines] == expected  # the session in flight finished
    return lines


def test_sigterm_drains_withdraws_and_ends_the_epoch(folder: Path) -> None:
    with serve_contract_control() as control, httpx.Client(timeout=30) as http:
        instance = start_instance(folder, control.base, "--drain-timeout", "20")
        try:
            url = instance.base_url
            iid = uri_id(url)
            eventually(lambda: iid in control.statuses, 30, "the instance to report")
            epoch = control.statuses[iid]["epoch"]
            publish_some(url, http)
            eventually(lambda: control.replicas_of(url), 30, "its replicas to be published")
            sigterm_mid_generation(instance)
        finally:
            instance.stop()
        calls = control.texts()
        log = instance.output()
    draining = calls.index(f"status draining epoch {epoch}")
    withdrawn = next(i for i, c in enumerate(calls) if c.startswith("DELETE holder replicas"))
    ended = calls.index(f"DELETE instance epoch {epoch}")
    assert draining < withdrawn < ended  # drain first, then withdraw, then end the epoch
    assert calls[withdrawn] != "DELETE holder replicas 0"
    assert ended == len(calls) - 1  # nothing reported after the end: never re-registered
    assert control.replicas_of(url) == [] and control.ended == [(iid, epoch)]
    for step in (
        "state draining reported",
        "in-flight sessions and directives finished",
        "withdrawing the replicas at the IS: ",
        f"ending epoch {epoch} at the PC: done",
    ):
        assert f"leaving: {step}" in log, log[-3000:]  # fmt: skip


def test_a_second_control_url_takes_the_reports_when_the_first_dies(folder: Path) -> None:
    with serve_contract_control() as second, ExitStack() as first_alive:
        first = first_alive.enter_context(serve_contract_control())
        instance = start_instance(folder, f"{first.base},{second.base}")
        try:
            iid = uri_id(instance.base_url)
            eventually(lambda: iid in first.statuses, 30, "reports at the first control plane")
            time.sleep(1)  # several reports (every 500 ms): all of them at the first
            assert iid not in second.statuses
            first_alive.close()  # the first control plane dies
            eventually(lambda: iid in second.statuses, 30, "reports at the second control plane")
            count = len(second.texts())
            eventually(lambda: len(second.texts()) >= count + 2, 30, "reports keep coming")
            assert f"PC PUT instances/{iid}/status at {first.base} failed" in instance.output()
            assert f"failing over to {second.base}" in instance.output()
        finally:
            instance.stop()


def test_sigterm_with_the_real_control_plane(folder: Path) -> None:
    control = serve(folder, "control", "--directive-token-file", str(folder / "token"))
    try:
        with httpx.Client(timeout=30) as http:
            probe = http.delete(f"{control.base_url}holders/{'0' * 32}/replicas", headers=AUTH)
            assert probe.status_code == 200, probe.text  # the IS route the instance uses
            instance = start_instance(folder, control.base_url)
            try:
                url = instance.base_url
                eventually(lambda: _listed(http, control.base_url, url), 30, "registration")
                publish_some(url, http)
                eventually(lambda: _replicas(http, control.base_url, url), 30, "replicas")
                sigterm_mid_generation(instance)
            finally:
                instance.stop()
            assert _replicas(http, control.base_url, url) == 0  # gone at once, not after a TTL
            assert not _listed(http, control.base_url, url)  # ended, not failed
            time.sleep(1.6)  # past the status TTL: an expired record would show as failed now
            assert not _listed(http, control.base_url, url)
    finally:
        control.stop()


def _listed(http: httpx.Client, control: str, url: str) -> dict[str, Any] | None:
    answer = http.get(f"{control}instances", headers=AUTH)
    assert answer.status_code == 200, answer.text
    return next((row for row in answer.json()["instances"] if row["instance"] == url), None)


def _replicas(http: httpx.Client, control: str, url: str) -> int:
    answer = http.get(f"{control}replicas", headers=AUTH)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    holders = body.get("holders", [])
    return sum(int(h["replicas"]) for h in holders if h["holder"] == url)
