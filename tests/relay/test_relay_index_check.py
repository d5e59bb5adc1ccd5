"""The relay checks ``--index`` and its token at start (``relay.app.check_index``): a token the
IS refuses ends it at once with exit status 2 and one clear line; an IS that does not answer yet
is logged, the relay serves meanwhile, and a refusal once the IS is up still ends it with 2."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # IS and relay processes

RELAY_TOKEN = "relay-check-token-0123456789abcdefghij"
WRONG_TOKEN = "wrong-relay-token-0123456789abcdefghij"


def _principals(folder: Path, *tokens: str) -> Path:
    path = folder / "principals.toml"
    entries = [principal_entry(f"relay{n}", t, ["relay"], None) for n, t in enumerate(tokens)]
    write_principals(path, entries)
    return path


def _index(folder: Path, principals: Path, listen: str = "127.0.0.1:0") -> RunningService:
    work = folder / f"index-{len(list(folder.glob('index-*')))}"
    work.mkdir()
    argv = [sys.executable, "-m", "kvsp", "serve", "index", "--listen", listen]
    argv += ["--state", str(work / "state"), "--principals", str(principals)]
    return start_process(argv, workdir=work)


def _relay_argv(folder: Path, index: str, token: str) -> list[str]:
    token_file = folder / "relay.token"
    token_file.write_text(token + "\n")
    return [
        *(sys.executable, "-m", "kvsp", "serve", "relay", "--listen", "127.0.0.1:0"),
        *("--state", str(folder / "relay-state"), "--open", "--log-format", "text"),
        *("--index", index, "--index-token-file", str(token_file)),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_refused_token_ends_the_relay_with_status_2(tmp_path: Path) -> None:
    with _index(tmp_path, _principals(tmp_path, RELAY_TOKEN)) as index:
        done = subprocess.run(
            _relay_argv(tmp_path, index.base_url, WRONG_TOKEN),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"the Index Service at {index.base_url} refused the token" in done.stderr
    assert "--index-token-file" in done.stderr and "401" in done.stderr


def test_a_known_token_starts_and_the_old_flag_warns(tmp_path: Path) -> None:
    with _index(tmp_path, _principals(tmp_path, RELAY_TOKEN)) as index:
        argv = _relay_argv(tmp_path, index.base_url, RELAY_TOKEN)
        argv[argv.index("--index-token-file")] = "--token-file"
        with start_process(argv, workdir=tmp_path) as relay:
            face = json.loads(relay.base_url)["http"]
            assert httpx.get(f"{face}healthz").status_code == 200
            eventually(
                lambda: "--token-file is deprecated; use --index-token-file" in relay.output()
            )
            assert "refused" not in relay.output()


def test_an_index_that_is_down_is_waited_for(tmp_path: Path) -> None:
    port = _free_port()
    index_url = f"http://127.0.0.1:{port}/"
    with start_process(_relay_argv(tmp_path, index_url, RELAY_TOKEN), workdir=tmp_path) as relay:
        face = json.loads(relay.base_url)["http"]
        assert httpx.get(f"{face}healthz").status_code == 200  # it serves meanwhile
        assert f"the Index Service at {index_url} does not answer" in relay.output()
        assert relay.proc.poll() is None
        # the IS comes up, but does not know the relay's token: the relay ends with 2
        with _index(tmp_path, _principals(tmp_path, WRONG_TOKEN), f"127.0.0.1:{port}"):
            status = eventually(lambda: relay.proc.poll(), timeout=60, what="the relay to end")
        assert status == 2, relay.output()
        assert "refused the token of --index-token-file" in relay.output()


def test_an_index_without_a_token_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from relay.app import main

    argv = ["--listen", "127.0.0.1:0", "--state", str(tmp_path), "--open"]
    assert main([*argv, "--index", "http://127.0.0.1:9/"]) == 2
    assert capsys.readouterr().err.strip() == (
        "relay: error: --index needs --index-token-file: the IS takes records from no one else"
    )
