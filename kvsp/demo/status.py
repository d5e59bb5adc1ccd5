"""``kvsp status``: a running cluster as tables (spec §6.3 instance status and lifecycle, §6.1
replicas, §6.8 sessions; DESIGN.md §3 resource table).

It reads the endpoints from a state folder's ``cluster.json`` (written by ``kvsp up`` and
``kvsp demo`` while they run) with the folder's ``admin.token``, or takes ``--pc URL`` and
``--token-file`` for any control plane (several ``--pc`` URLs: the first that answers is
asked, as :mod:`kvsp.web.failover` does). Tables:

* instances: ``GET instances`` at the PC: state, the state last reported, load, epoch;
* replicas per holder, the holder list: ``GET replicas`` at the IS (every holder with a live
  record, its records and octets), over the memory and the Redis store alike;
* sessions: ``GET sessions`` at the PC (the most recently changed first), over either store.

The KV column is the instance's reported ``kv_utilization``: below 1 % it keeps two
significant digits, so an instance holding a few blocks of a large cache does not read 0 %.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvsp.demo.console import Console
from kvsp.demo.state import Endpoints, StateFolder
from kvsp.errors import ClusterError


@dataclass(frozen=True, slots=True)
class Target:
    """Which control plane to ask, with what token, and the names it knows for URLs."""

    control: str
    token: str
    names: dict[str, str]
    endpoints: Endpoints | None = None
    alternates: tuple[str, ...] = ()
    """More URLs of the same control plane, asked in order when ``control`` does not answer."""


def target_from_state(state: Path) -> Target:
    """The control plane of the cluster running from ``state``.

    Raises:
        ClusterError: no cluster runs from that folder (no ``cluster.json``) or no token.
    """
    files = StateFolder(state)
    try:
        text = files.cluster_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClusterError(
            f"no cluster runs from {state} (no cluster.json); start one with `kvsp up`, or "
            "give --pc URL --token-file FILE"
        ) from None
    try:
        endpoints = Endpoints.from_json(json.loads(text))
    except ValueError as exc:
        raise ClusterError(f"{files.cluster_file}: not JSON ({exc})") from None
    names = {url: f"instance {name}" for name, url in endpoints.instances.items()}
    for url in (endpoints.relay_moqt, endpoints.relay_http):
        if url:
            names[url] = "relay"
    return Target(endpoints.control, files.read_token("admin"), names, endpoints)


def target_from_options(pc: str | Sequence[str], token_file: Path) -> Target:
    """The control plane at ``pc`` (one URL or several of the same control plane) with the
    token in ``token_file``.

    Raises:
        ClusterError: the token file is unreadable or empty, or no URL is given.
    """
    from kvsp.errors import BadRequest
    from kvsp.web.failover import url_list

    try:
        urls = url_list(pc)
    except BadRequest as exc:
        raise ClusterError(f"--pc: {exc}") from None
    try:
        token = token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ClusterError(f"cannot read --token-file {token_file}: {exc.strerror}") from None
    if not token:
        raise ClusterError(f"--token-file {token_file} is empty")
    return Target(urls[0], token, {}, alternates=urls[1:])


def print_status(console: Console, target: Target) -> int:
    """Print the tables; 0 when the control plane answered, 1 when it did not.

    Raises:
        ClusterError: the control plane refused the token.
    """
    headers = {"authorization": f"Bearer {target.token}"}
    for url in (target.control, *target.alternates):
        with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
            try:
                listed = http.get("instances")
            except httpx.TransportError as exc:
                console.line(f"the control plane at {url} does not answer: {exc}")
                continue
            return _print_tables(console, target, http, listed)
    return 1


def _print_tables(
    console: Console, target: Target, http: httpx.Client, listed: httpx.Response
) -> int:
    """The tables, from the control plane that answered ``GET instances`` with ``listed``."""
    if listed.status_code in (401, 403):
        raise ClusterError(f"the control plane refused the token ({listed.status_code})")
    if target.endpoints is not None:
        _endpoints(console, target.endpoints)
    _instances(console, target, listed)
    print_replicas(console, target.names, http.get("replicas"))
    _sessions(console, target.names, http.get("sessions"))
    return 0


def _endpoints(console: Console, e: Endpoints) -> None:
    console.heading("Endpoints")
    rows: list[list[object]] = [["control plane (IS + PC)", e.control, e.pids.get("control")]]
    if e.relay_moqt:
        rows.append(["relay (MOQT)", e.relay_moqt, e.pids.get("relay")])
        rows.append(["relay (HTTP holder face)", e.relay_http, None])
    for name, url in e.instances.items():
        rows.append([f"instance {name}", url, e.pids.get(f"instance-{name}")])
    console.table(["service", "URL", "pid"], rows)


def _instances(console: Console, target: Target, answer: httpx.Response) -> None:
    console.heading("Instances (PC)")
    if answer.status_code != 200:
        console.line(f"GET instances answered {answer.status_code}")
        return
    rows = [
        [
            target.names.get(r["instance"], r["instance"]),
            _where(r),
            r["state"],
            r["reported_state"],
            r["running"] + r["queued"],
            r["running"],
            r["queued"],
            r["epoch"],
            kv_share(float(r.get("kv_utilization", 0))),
            r["age_ms"],
        ]
        for r in answer.json().get("instances", [])
    ]
    headers = ["instance", "site", "state", "reported", "load", "running", "queued", "epoch", "KV"]
    console.table([*headers, "age ms"], rows)
    if not rows:
        console.line("(no instance has reported yet)")


def _where(row: dict[str, Any]) -> str:
    """An instance's ``site`` and ``zone`` labels (extension members) as ``site/zone``."""
    site, zone = row.get("site"), row.get("zone")
    if not site:
        return "-"
    return f"{site}/{zone}" if zone else str(site)


def kv_share(utilization: float) -> str:
    """``kv_utilization`` (0..1) as a percentage: whole percents from 1 % up, two significant
    digits below, ``0%`` only when nothing is in use."""
    percent = 100 * utilization
    if percent == 0 or percent >= 1:
        return f"{percent:.0f}%"
    return f"{percent:.2g}%"


def print_replicas(console: Console, names: dict[str, str], answer: httpx.Response) -> None:
    """The table of ``GET replicas`` at the IS (``names`` maps URLs to short names)."""
    console.heading("Replicas per holder (IS)")
    if answer.status_code != 200:
        console.line(f"(this Index Service does not list replicas: GET replicas {_why(answer)})")
        return
    rows = [
        [names.get(h["holder"], h["holder"]), h["replicas"], round(h["octets"] / 1024)]
        for h in answer.json().get("holders", [])
    ]
    console.table(["holder", "replicas", "KiB"], rows)
    if not rows:
        console.line("(no holder has a live replica record)")


def _sessions(console: Console, names: dict[str, str], answer: httpx.Response) -> None:
    console.heading("Sessions (PC)")
    if answer.status_code != 200:
        console.line(f"(the PC does not list sessions: GET sessions {_why(answer)})")
        return
    sessions: list[dict[str, Any]] = answer.json().get("sessions", [])
    rows = [
        [
            s.get("session"),
            names.get(s.get("instance") or "", s.get("instance")),
            s.get("epoch"),
            s.get("state"),
            s.get("output_offset"),
            s.get("detail", ""),
        ]
        for s in sessions
    ]
    console.table(["session", "instance", "epoch", "state", "tokens", "detail"], rows)
    if not sessions:
        console.line("(no sessions)")


def _why(answer: httpx.Response) -> str:
    try:
        title = answer.json().get("title", "")
    except ValueError:
        title = ""
    return f"answered {answer.status_code}" + (f" {title}" if title else "")
