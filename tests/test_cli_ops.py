"""The operator's commands against a real cluster (``kvsp serve control``, a holder and two
toy-engine instances): ``kvsp instance list|drain|wake`` (§6.3), ``kvsp replicas`` and
``kvsp holders`` (§6.1–6.2) over what the holder published, ``kvsp prefetch`` (§6.5) making an
instance load a prompt's blocks; and bad input answered in one line without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsp.ids import uri_id
from tests.support import cluster as kit
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # a cluster of processes

KVSP = [sys.executable, "-m", "kvsp"]


def kvsp(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSP, *argv], capture_output=True, text=True, timeout=120)


def ok(*argv: str) -> str:
    done = kvsp(*argv)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def refused(code: int, *argv: str) -> str:
    done = kvsp(*argv)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 or code == 2, done.stderr  # argparse adds its usage line
    return lines[-1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.Cluster]:
    running = kit.start_cluster(tmp_path_factory.mktemp("ops"), {"a": [], "b": []}, [])
    try:
        yield running
    finally:
        running.stop()
        running.http.close()


def token(c: kit.Cluster) -> tuple[str, str]:
    return ("--token-file", str(c.folder / "admin.token"))


def listed(c: kit.Cluster) -> dict[str, Any]:
    rows = json.loads(ok("instance", "list", "--pc", c.control, *token(c), "--json"))
    return {row["instance"]: row for row in rows["instances"]}


def test_instance_list_drain_wake(cluster: kit.Cluster) -> None:
    a = cluster.url("a")
    table = ok("instance", "list", "--pc", cluster.control, *token(cluster))
    assert a in table and cluster.url("b") in table and uri_id(a) in table
    assert listed(cluster)[a]["state"] == "active"

    drained = ok("instance", "drain", a, "--pc", cluster.control, *token(cluster))
    # an idle instance may sleep and report it before the PC answers (§6.3): either is the drain
    assert drained.strip() in (f"{a}: active -> draining", f"{a}: active -> sleeping")
    was = listed(cluster)[a]["state"]
    assert was in ("draining", "sleeping")  # an idle draining instance goes to sleep (§6.3)
    table = ok("instance", "list", "--pc", cluster.control, *token(cluster))
    assert [a, uri_id(a), was] in [line.split()[:3] for line in table.splitlines()]

    by_id = ok("instance", "wake", uri_id(a), "--pc", cluster.control, *token(cluster), "--json")
    assert json.loads(by_id) == {"instance": a, "was": was, "state": "active"}
    eventually(lambda: listed(cluster)[a]["state"] == "active", what="a active again")
    eventually(lambda: cluster.status("a")["state"] == "active", what="a says active")


def test_a_dead_first_pc_is_passed_over(cluster: kit.Cluster) -> None:
    """``--pc`` takes several URLs; the commands use the first that answers."""
    pcs = f"http://127.0.0.1:9/,{cluster.control}"
    rows = json.loads(ok("instance", "list", "--pc", pcs, *token(cluster), "--json"))
    assert cluster.url("a") in {row["instance"] for row in rows["instances"]}


def test_bad_input_is_one_line(cluster: kit.Cluster, tmp_path: Path) -> None:
    unknown = "http://127.0.0.1:9/"
    line = refused(1, "instance", "drain", unknown, "--pc", cluster.control, *token(cluster))
    assert line.startswith("kvsp: error: unknown instance")
    line = refused(2, "instance", "wake", "not-hex", "--pc", cluster.control, *token(cluster))
    assert "32-hex-digit id" in line
    line = refused(1, "instance", "list", "--pc", "http://127.0.0.1:9/", *token(cluster))
    assert line.startswith("kvsp: error: Peer unreachable")
    stranger = tmp_path / "stranger.token"
    stranger.write_text("not-a-known-token-0123456789abcdef\n")
    line = refused(1, "holders", "--index", cluster.control, "--token-file", str(stranger))
    assert line == "kvsp: error: Unauthorized: unknown token"
    line = refused(
        1, "replicas", "--index", cluster.control, *token(cluster), "--compat-id", "xyz",
        "--tokens", "1,2", "--scope-key-file", str(cluster.folder / "scope.key"),
    )  # fmt: skip
    assert "compat-id" in line
    line = refused(1, "replicas", "--index", cluster.control, *token(cluster), "--tokens", "1")
    assert "needs --scope-key-file" in line


def prompt_args(c: kit.Cluster, prompt: list[int], folder: Path) -> list[str]:
    tokens = folder / "prompt.json"
    tokens.write_text(json.dumps(prompt))
    return [
        *("--scope-key-file", str(c.folder / "scope.key")),
        *("--descriptor", str(c.folder / "descriptor.json")),
        *("--tokens-file", str(tokens)),
    ]


def test_replicas_holders_and_prefetch(cluster: kit.Cluster, tmp_path: Path) -> None:
    prompt = kit.prompt_of(3, seed=4242, tail=5)
    keys = cluster.store_at_holder(prompt)
    args = prompt_args(cluster, prompt, tmp_path)

    table = ok("replicas", "--index", cluster.control, *token(cluster), *args)
    assert table.splitlines()[0] == "matched 3 of 3 blocks"
    for key in keys:
        assert any(key.hex() in line and cluster.holder in line for line in table.splitlines())
    found = json.loads(ok("replicas", "--index", cluster.control, *token(cluster), *args, "--json"))
    assert found["matched"] == 3
    assert [b["block_key"] for b in found["blocks"]] == [k.hex() for k in keys]
    assert all(cluster.holder in {r["holder"] for r in b["replicas"]} for b in found["blocks"])
    only_a = ok(
        "replicas", "--index", cluster.control, *token(cluster), *args, "--holder", cluster.url("a")
    )
    assert cluster.holder not in only_a

    census = json.loads(ok("holders", "--index", cluster.control, *token(cluster), "--json"))
    rows = {row["holder"]: row for row in census["holders"]}
    assert rows[cluster.holder]["replicas"] >= 3
    assert cluster.holder in ok("holders", "--index", cluster.control, *token(cluster))
    per_holder = ok("replicas", "--index", cluster.control, *token(cluster))
    assert cluster.holder in per_holder  # without a prompt: the census

    b = cluster.url("b")
    out = ok("prefetch", "--pc", cluster.control, "--instance", b, *token(cluster), *args)
    lines = out.splitlines()
    assert lines[0].startswith(f"{b}: matched 3 of 3 blocks; directive ")
    directive = lines[0].split("directive ")[1].split(":")[0]
    assert lines[1] == "complete: 3 of 3 loaded"
    outcome = cluster.directive_outcome("b", directive)
    assert outcome["state"] == "complete" and set(outcome["loaded"]) == {k.hex() for k in keys}
    cluster.published(keys, b)  # b now holds them and says so at the IS

    again = ok("prefetch", "--pc", cluster.control, "--instance", uri_id(b), *token(cluster), *args)
    assert again.strip() == f"{b}: matched 3 of 3 blocks, 3 already there: nothing to prefetch"


def test_prefetch_refuses_an_instance_that_is_not_active(
    cluster: kit.Cluster, tmp_path: Path
) -> None:
    args = prompt_args(cluster, kit.prompt_of(1, seed=77), tmp_path)
    a = cluster.url("a")
    ok("instance", "drain", a, "--pc", cluster.control, *token(cluster))
    try:
        line = refused(
            1, "prefetch", "--pc", cluster.control, "--instance", a, *token(cluster), *args
        )
        assert "only an active one" in line and ("draining" in line or "sleeping" in line)
    finally:
        ok("instance", "wake", a, "--pc", cluster.control, *token(cluster))
