"""``kvsp status --pc A,B`` (kvsp.web.failover's URL list): a first control plane that does not
answer is reported and the next one's tables are printed, against a real ``kvsp serve
control`` on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvsp.cli import main
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.runner import bind_socket
from kvsp.web.testing import start_process

pytestmark = pytest.mark.slow  # a control plane process

TOKEN = "status-failover-admin-token-0123456789abc"


def test_status_asks_the_next_control_plane(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_principals(
        tmp_path / "principals.toml", [principal_entry("admin", TOKEN, ["admin"], None)]
    )
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    argv = [
        sys.executable, "-m", "kvsp", "serve", "control", "--listen", "127.0.0.1:0",
        "--principals", str(tmp_path / "principals.toml"), "--state", str(tmp_path / "state"),
    ]  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    sock.close()
    with start_process(argv, workdir=tmp_path) as control:
        code = main(["status", "--pc", f"{dead},{control.base_url}", "--token-file", str(token)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"the control plane at {dead} does not answer" in out
    assert "Instances (PC)" in out and "(no instance has reported yet)" in out
