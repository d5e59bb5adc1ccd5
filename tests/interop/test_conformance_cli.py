"""Our conformance CLI (``interop/conformance.py``, the moq-interop-runner client contract)
against relays: aiomoqt 0.13.3's (every case must pass) and ours (``relay.app --open``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from interop import peers
from interop.conformance import CASES
from tests.support import REPO

CLI = [sys.executable, "-m", "interop.conformance"]


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout, check=False
    )


def test_lists_the_cases() -> None:
    listed = run("-l")
    assert listed.returncode == 0 and listed.stdout.split() == list(CASES)
    assert len(CASES) == 13


def test_an_unknown_case_is_unsupported() -> None:
    answer = run("-r", "moqt://127.0.0.1:9", "-t", "rendezvous-timeout")
    assert answer.returncode == 127
    assert answer.stdout.startswith("TAP version 14\n1..0 # SKIP")


def test_a_relay_that_does_not_answer_fails_the_case() -> None:
    answer = run("-r", f"moqt://127.0.0.1:{peers.free_udp_port()}", "-t", "setup-only")
    assert answer.returncode == 1
    assert "not ok 1 - setup-only" in answer.stdout


@pytest.fixture(scope="module", params=["aiomoqt-relay", "kvsp-relay"])
def relay(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[peers.PeerProcess]:
    workdir = tmp_path_factory.mktemp(request.param)
    start = peers.start_aiomoqt_relay if request.param == "aiomoqt-relay" else peers.start_our_relay
    try:
        peer = start(workdir)
    except peers.PeerUnavailable as exc:
        pytest.skip(f"{request.param} unavailable: {exc}")
    with peer:
        yield peer


@pytest.mark.slow
def test_every_case_passes_against_the_relay(relay: peers.PeerProcess) -> None:
    base = ["-r", relay.url, "--tls-disable-verify"]
    outputs = [run(*base), run(*base, "-t", "fetch"), run(*base, "-t", "join")]
    tap = "\n".join(out.stdout for out in outputs)
    passed = {line.split(" - ", 1)[1] for line in tap.splitlines() if line.startswith("ok ")}
    failed = [line for line in tap.splitlines() if line.startswith("not ok")]
    assert (failed, passed) == ([], set(CASES)), tap
    assert [out.returncode for out in outputs] == [0, 0, 0]
