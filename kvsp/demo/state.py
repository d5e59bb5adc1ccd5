"""The state folder of ``kvsp demo`` and ``kvsp up`` (see :mod:`kvsp.demo.cluster` for what
it holds) and ``cluster.json``, the endpoints of the cluster that runs from it, which ``kvsp
status`` reads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from kvsp.errors import ClusterError


def default_state() -> Path:
    """The default state folder: ``~/.kvsp/demo``."""
    return Path.home() / ".kvsp" / "demo"


class StateFolder:
    """The paths of a state folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = root / "model"
        self.descriptor = root / "descriptor.json"
        self.scope_key = root / "scope.key"
        self.principals = root / "principals.toml"
        self.admin_token = root / "admin.token"
        self.tokens = root / "tokens"
        self.services = root / "services"
        self.cluster_file = root / "cluster.json"

    def token_file(self, name: str) -> Path:
        """The token file of party ``name`` (the admin's is :attr:`admin_token`)."""
        return self.admin_token if name == "admin" else self.tokens / f"{name}.token"

    def read_token(self, name: str) -> str:
        """The token of party ``name``.

        Raises:
            ClusterError: the file is missing or empty.
        """
        path = self.token_file(name)
        try:
            token = path.read_text(encoding="ascii").strip()
        except OSError as exc:
            raise ClusterError(f"cannot read {path}: {exc.strerror}") from None
        if not token:
            raise ClusterError(f"{path} is empty")
        return token


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (tokens, keys)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoints:
    """Where the services of a running cluster listen (``cluster.json``)."""

    control: str
    relay_moqt: str | None
    relay_http: str | None
    instances: dict[str, str]
    pids: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {
            "control": self.control,
            "relay": {"moqt": self.relay_moqt, "http": self.relay_http},
            "instances": self.instances,
            "pids": self.pids,
        }

    @classmethod
    def from_json(cls, obj: Any) -> Self:
        """Read ``cluster.json``.

        Raises:
            ClusterError: not the shape :meth:`to_json` writes.
        """
        try:
            relay = obj.get("relay") or {}
            return cls(
                control=str(obj["control"]),
                relay_moqt=relay.get("moqt"),
                relay_http=relay.get("http"),
                instances={str(k): str(v) for k, v in obj["instances"].items()},
                pids={str(k): int(v) for k, v in obj.get("pids", {}).items()},
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ClusterError(f"cluster.json: unexpected content ({exc})") from None
