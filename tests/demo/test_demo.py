"""``kvsp demo``, ``kvsp up`` and ``kvsp status`` as a user runs them: real subprocesses on
127.0.0.1 (control plane, MOQT relay, reference-engine instances), checked for their output,
their exit status, and that no process they started outlives them.

The model is made once for the module (``Cluster.prepare``); each test starts its own cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch", reason="the demo's instances run the reference engine (torch)")
pytest.importorskip("safetensors", reason="the demo's instances need the engine extra")

from kvsp.demo.cluster import Cluster, ClusterConfig, instances_support_relay  # noqa: E402
from kvsp.demo.state import StateFolder  # noqa: E402
from kvsp.demo.summary import SECTIONS  # noqa: E402
from tests.support.polling import eventually  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc"),
]
KVSP = [sys.executable, "-m", "kvsp"]


def processes_naming(marker: str) -> list[str]:
    """The command lines of live processes (not zombies) that mention ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        command = raw.replace(b"\0", b" ").decode("utf-8", "replace")
        if marker in command:
            found.append(f"{entry.name}: {command[:200]}")
    return found


@pytest.fixture(scope="module")
def model_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state folder with the seeded model made (each test copies the folder's model)."""
    folder = tmp_path_factory.mktemp("demo-model")
    Cluster(ClusterConfig(state=folder)).prepare()
    return folder


@pytest.fixture
def state(model_state: Path, tmp_path: Path) -> Iterator[Path]:
    """A fresh state folder sharing the module's model; checked for leftovers at the end."""
    folder = tmp_path / "state"
    folder.mkdir()
    for name in ("model", "descriptor.json", "scope.key"):
        os.symlink(model_state / name, folder / name)
    yield folder
    leftovers = processes_naming(str(folder))
    for line in leftovers:  # do not leave them to the next test
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert not leftovers, leftovers


STEP_1_ROW = r"^(R[123]): system prompt ([AB]) +\d+/\d+ +(\S+) "
STEP_2_ROW = r"^(\S+) +(\S+) +(MOQT|HTTP) +\d+/\d+ "


def test_demo_plays_the_scenario_to_a_clean_exit_and_leaves_no_process(state: Path) -> None:
    done = subprocess.run(
        [*KVSP, "demo", "--state", str(state), "--prompt-tokens", "512"],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    for step in ("1. Requests sharing", "2. Prefetch", "3. Drain and sleep", "4. An instance"):
        assert step in out, out
    report = out[out.index("\nReport\n") :]
    for section in SECTIONS:
        assert f"\n{section}" in report, report
    assert "gap-free, duplicate-free" in report and "NOT gap-free" not in report, report
    assert "503 kvsp-not-active" in out  # the draining instance refused a new session
    assert "draining" in report and "sleeping" in report and "failed" in report
    blocks = 512 // 32
    moved = dict(re.findall(r"^(HTTP|MOQT) +(\d+) +[\d,]+ KiB$", report, re.MULTILINE))
    assert moved["HTTP"] == str(blocks)  # the HTTP directive loaded the whole prefix
    if instances_support_relay():
        assert moved["MOQT"] == str(blocks), report  # and so did the one through the relay
    # each directive goes to an instance that held none of its prefix, so what the table says
    # moved did cross the transport (step 1 may already have moved prompt A by a directive)
    placed = {r: (p, on) for r, p, on in re.findall(STEP_1_ROW, out, re.MULTILINE)}
    held = {"A": {on for p, on in placed.values() if p == "A"}, "B": {placed["R3"][1]}}
    step_2 = out[out.index("2. Prefetch") : out.index("3. Drain and sleep")]
    loads = re.findall(STEP_2_ROW, step_2, re.MULTILINE)
    assert len(loads) == (2 if instances_support_relay() else 1), step_2
    for target, _source, transport in loads:
        assert target not in held["A" if transport == "MOQT" else "B"], (target, held, step_2)
    assert not StateFolder(state).cluster_file.exists()
    assert processes_naming(str(state)) == []


@pytest.mark.parametrize(
    ("moment", "sig", "expected"),
    [("starting", signal.SIGTERM, 143), ("playing", signal.SIGINT, 130)],
)
def test_a_signal_stops_every_service_and_sets_the_exit_status(
    state: Path, moment: str, sig: signal.Signals, expected: int
) -> None:
    log = state / "demo.out"

    def reached() -> bool | None:
        if moment == "starting":  # the instances are starting (importing torch)
            return (state / "services/instance-b/output.log").exists() or None
        return "1. Requests sharing" in log.read_text() or None  # the scenario plays

    with open(log, "w") as out:
        demo = subprocess.Popen(
            [*KVSP, "demo", "--state", str(state), "--prompt-tokens", "512"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        eventually(reached, 180, f"the demo to be {moment}")
        spawned = processes_naming(str(state / "services"))
        assert len(spawned) >= 3, spawned
        demo.send_signal(sig)
        status = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert status == expected, log.read_text()
    said = "interrupted" if sig == signal.SIGINT else "terminated"
    assert f"{said}: stopping every service" in log.read_text()
    assert processes_naming(str(state)) == []


def test_status_shows_a_running_up_and_ctrl_c_stops_it(state: Path) -> None:
    log = state / "up.out"
    with open(log, "w") as out:
        up = subprocess.Popen(
            [*KVSP, "up", "--state", str(state), "--instances", "2"],
            stdout=out,
            stderr=subprocess.STDOUT,
            # as a shell starts a background job: SIGINT ignored, which kvsp up overrides
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    try:
        eventually(lambda: "cluster up" in log.read_text() or None, 180, "kvsp up")
        files = StateFolder(state)
        endpoints = json.loads(files.cluster_file.read_text())
        instance_a = endpoints["instances"]["a"]
        # One generation at a: its two complete blocks become replicas of a at the IS.
        prompt = list(range(10, 74))
        headers = {"authorization": f"Bearer {files.read_token('client')}"}
        body = {"prompt": prompt, "max_tokens": 2}
        made = httpx.post(f"{instance_a}generate", json=body, headers=headers, timeout=60)
        assert made.status_code == 200, made.text
        mirrored = instances_support_relay()  # a pushes its blocks to the relay too

        def shown() -> str | None:
            done = subprocess.run(
                [*KVSP, "status", "--state", str(state)], capture_output=True, text=True
            )
            assert done.returncode == 0, done.stdout + done.stderr
            complete = _replicas_of(done.stdout, "instance a") == 2 and (
                not mirrored or _replicas_of(done.stdout, "relay") == 2
            )
            return done.stdout if complete else None

        table = eventually(shown, 30, "two replicas of instance a (and the relay) in kvsp status")
        for heading in ("Endpoints", "Instances (PC)", "Replicas per holder (IS)", "Sessions"):
            assert heading in table, table
        rows = _section(table, "Instances (PC)")
        assert sum(1 for r in rows if r.startswith("instance ") and " active " in r) == 2, table
        # every demo process is labelled: one site, a zone per instance (§4.4 extension members)
        assert any(r.startswith("instance a ") and " local/zone-a " in r for r in rows), table

        by_url = subprocess.run(
            [*KVSP, "status", "--pc", endpoints["control"], "--token-file", str(files.admin_token)],
            capture_output=True,
            text=True,
        )
        assert by_url.returncode == 0, by_url.stdout + by_url.stderr
        assert instance_a in by_url.stdout  # no names without the state folder: URLs

        up.send_signal(signal.SIGINT)
        status = up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert status == 0, log.read_text()
    assert not StateFolder(state).cluster_file.exists()
    assert processes_naming(str(state)) == []


def _section(text: str, heading: str) -> list[str]:
    after = text[text.index(heading) :].splitlines()[3:]  # heading, underline, table header
    rows = []
    for line in after[1:]:  # the header's dashes
        if not line.strip():
            break
        rows.append(line)
    return rows


def _replicas_of(text: str, holder: str) -> int | None:
    if "Replicas per holder (IS)" not in text:
        return None
    for row in _section(text, "Replicas per holder (IS)"):
        if row.startswith(holder + " "):
            return int(row[len(holder) :].split()[0])
    return None
