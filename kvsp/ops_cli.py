"""The operator's commands of ``kvsp``: ``instance list|drain|wake`` (spec §6.3), ``prefetch``
(§6.5), ``replicas`` (§6.1–6.2) and ``holders`` (the IS's census).

They are thin shells over the clients the services use themselves
(:class:`~kvsp.services.pc.client.PCClient`, :class:`~kvsp.services.index.client.IndexClient`),
so what an operator sees is what the PC and the IS answer. Each prints a table by default and
JSON with ``--json``; exit status 0 when the service did it, 1 when it said no (its problem's
title and detail on one line, never a traceback), 2 for a usage error. The HTTP stack is
imported only when a command runs, so the other ``kvsp`` commands start as fast as before.

``prefetch`` directs a named instance, which the PC has no route for (its directives follow
its own placement, §6.4): the command does what the PC does for a placement, client-side, with
the operator's token — a lookup at the IS (§6.2), the sources chosen by the instance's measured
links, :func:`~kvsp.placement_plan.build_directive`, ``POST {instance}prefetch`` (§6.5) — and
then waits for the directive's outcome. Like the PC, it directs active instances only (§6.3).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import uuid
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsp.errors import KVSPError

if TYPE_CHECKING:
    from kvsp.compat import CompatibilityDescriptor
    from kvsp.records import InstanceStatusRecord, LookupResponse, ReplicaRecord
    from kvsp.services.pc.client import InstanceListing

Handler = Callable[[argparse.Namespace], int]

_HEX16 = re.compile(r"[0-9a-f]{32}")
DEFAULT_WAIT_MS = 30_000
"""How long ``kvsp prefetch`` waits for the directive's outcome by default."""
MAX_WAIT_MS = 60_000
"""The longest single wait an instance grants (``GET prefetch/{directive}?wait_ms=``)."""


class OpsError(Exception):
    """A refusal or failure to report on one line (exit status 1)."""


def instance_ref(text: str) -> str:
    """An instance named by its URL (``http(s)://…``) or its id (hex16 of SHA-256 of the URL,
    as in ``instances/{id}`` paths); an ``argparse`` type.

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if text.startswith(("http://", "https://")):
        return text
    lowered = text.lower()
    if _HEX16.fullmatch(lowered):
        return lowered
    raise argparse.ArgumentTypeError(
        f"expected an instance URL (http(s)://...) or its 32-hex-digit id, got {text[:80]!r}"
    )


def _directive_ms(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 3_600_000:
        raise argparse.ArgumentTypeError(f"expected 1 to 3600000 ms, got {text!r}")
    return int(text)


def _wait_ms(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 600_000:
        raise argparse.ArgumentTypeError(f"expected 0 to 600000 ms, got {text!r}")
    return int(text)


# --- arguments -------------------------------------------------------------------------------


def _token(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token-file",
        required=True,
        type=Path,
        metavar="FILE",
        help="the operator's bearer token (role admin, or pc for instances)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _pc(p: argparse.ArgumentParser) -> None:
    from kvsp.web.failover import add_url_list_argument

    add_url_list_argument(p, "--pc", required=True, help="the PC (or kvsp serve control)")


def _index(p: argparse.ArgumentParser, *, required: bool) -> None:
    from kvsp.web.failover import add_url_list_argument

    add_url_list_argument(
        p,
        "--index",
        required=required,
        help="the Index Service" + ("" if required else " (default: --pc, as kvsp serve control)"),
    )


def _prompt(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument(
        "--scope-key-file",
        type=Path,
        metavar="FILE",
        required=required,
        help="the scope key (hex); Block Keys are keyed by it (§4.2)",
    )
    model = p.add_mutually_exclusive_group(required=required)
    model.add_argument("--descriptor", type=Path, metavar="D.json", help="the model's descriptor")
    model.add_argument("--compat-id", metavar="HEX32", help="read the descriptor from the IS")
    prompt = p.add_mutually_exclusive_group(required=required)
    prompt.add_argument("--prompt", metavar="TEXT", help="text, as UTF-8 byte tokens")
    prompt.add_argument("--tokens", metavar="1,2,3", help="token ids")
    prompt.add_argument("--tokens-file", type=Path, metavar="F.json", help="a JSON array of ids")


def add_ops_commands(sub: Any) -> None:
    """Add ``instance``, ``prefetch``, ``replicas`` and ``holders`` to the ``kvsp`` command."""
    inst = sub.add_parser("instance", help="§6.3 list, drain and wake instances through the PC")
    isub = inst.add_subparsers(metavar="ACTION", required=True)
    p = isub.add_parser("list", help="the instances the PC knows: state, epoch, load, age")
    _pc(p)
    _token(p)
    p.set_defaults(handler=main_guard(_cmd_list))
    for action, state, text in (
        ("drain", "draining", "stop placing on it; it finishes what it runs (PUT state draining)"),
        ("wake", "active", "make a draining or sleeping instance active again (PUT state active)"),
    ):
        p = isub.add_parser(action, help=text)
        p.add_argument("instance", type=instance_ref, metavar="URL|ID")
        _pc(p)
        _token(p)
        p.set_defaults(handler=main_guard(_state_handler(state)))

    p = sub.add_parser(
        "prefetch",
        help="§6.5 make an instance load a prompt's cached blocks",
        description="Look the prompt's Block Keys up at the IS and post a prefetch directive "
        "for its cached prefix to the instance. The PC has no route to direct a named "
        "instance, so this runs the PC's lookup and directive building here and posts the "
        "directive to the instance itself with your token (role admin, or pc); like the PC, "
        "it directs active instances only.",
    )
    _pc(p)
    _index(p, required=False)
    p.add_argument(
        "--instance",
        required=True,
        type=instance_ref,
        metavar="URL|ID",
        help="the instance to load them, by URL or id (kvsp instance list)",
    )
    _prompt(p, required=True)
    p.add_argument(
        "--deadline-ms",
        type=_directive_ms,
        default=10_000,
        metavar="MS",
        help="the directive's deadline_ms: how long the instance may take (default 10000)",
    )
    p.add_argument(
        "--lease-ms",
        type=_directive_ms,
        default=30_000,
        metavar="MS",
        help="the directive's lease_ms: how long holders keep the blocks (default 30000)",
    )
    p.add_argument(
        "--wait-ms",
        type=_wait_ms,
        default=DEFAULT_WAIT_MS,
        metavar="MS",
        help=f"wait this long for the outcome (default {DEFAULT_WAIT_MS}; 0: do not wait)",
    )
    _token(p)
    p.set_defaults(handler=main_guard(_cmd_prefetch))

    p = sub.add_parser(
        "replicas",
        help="§6.2 the holders of a prompt's blocks, or the IS's records per holder",
        description="With a prompt (and --scope-key-file and --descriptor or --compat-id): "
        "look its Block Keys up at the IS and print each matched block's holders. Without "
        "one: the IS's live records and octets per holder (its census; role admin).",
    )
    _index(p, required=True)
    _prompt(p, required=False)
    p.add_argument("--holder", metavar="URL", help="only this holder's records")
    _token(p)
    p.set_defaults(handler=main_guard(_cmd_replicas))

    p = sub.add_parser("holders", help="the holders the IS has records of, with counts")
    _index(p, required=True)
    _token(p)
    p.set_defaults(handler=main_guard(_cmd_holders))


# --- plumbing --------------------------------------------------------------------------------


def _run(body: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``body``; a service's refusal or an unreachable one becomes :class:`OpsError`."""
    try:
        return asyncio.run(body())
    except KVSPError as exc:
        raise OpsError(_problem_line(exc)) from None


def _problem_line(exc: KVSPError) -> str:
    title = getattr(exc, "title", "")
    text = str(exc)
    return f"{title}: {text}" if title and not text.startswith(title) else text


def _read_text(path: Path, option: str) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise OpsError(f"cannot read {option} {path}: {getattr(exc, 'strerror', exc)}") from None
    if not text:
        raise OpsError(f"{option} {path} is empty")
    return text


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [list(headers), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _pc_client(args: argparse.Namespace) -> Any:
    from kvsp.services.pc.client import PCClient

    return PCClient(args.pc, _read_text(args.token_file, "--token-file"))


async def _listing(pc: Any) -> tuple[list[InstanceListing], list[dict[str, Any]]]:
    """The PC's instances, typed and as sent (extension members such as ``site`` kept)."""
    from kvsp.fields import Fields
    from kvsp.services.pc.client import InstanceListing
    from kvsp.web.client import decode_answer

    raw = await pc._request_json("GET", "instances")
    rows = decode_answer(
        lambda obj: [InstanceListing.from_json(v, p) for v, p in Fields(obj).items("instances")],
        raw,
    )
    return rows, list(raw["instances"])


def _find(rows: Sequence[InstanceListing], ref: str) -> InstanceListing:
    from kvsp.ids import uri_id

    for row in rows:
        if ref in (row.instance, row.instance.rstrip("/"), uri_id(row.instance)):
            return row
    if ref.startswith("http") and not ref.endswith("/"):
        return _find(rows, ref + "/")
    raise OpsError(f"unknown instance {ref}: the PC knows {len(rows)} (see kvsp instance list)")


# --- instance list | drain | wake ------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    from kvsp.ids import uri_id

    async def body() -> int:
        async with _pc_client(args) as pc:
            rows, raw = await _listing(pc)
        if args.json:
            _print_json({"instances": raw})
            return 0
        if not rows:
            print("(no instance has reported to this PC)")
            return 0
        sites = [str(r.get("site", "")) for r in raw]
        headers = ["INSTANCE", "ID", "STATE", "EPOCH", "RUNNING", "QUEUED", "BATCH", "AGE_MS"]
        table = [
            [
                r.instance,
                uri_id(r.instance),
                r.state if r.requested_state is None else f"{r.state} (asks {r.requested_state})",
                r.epoch,
                r.running,
                r.queued,
                r.batch_size,
                r.age_ms,
            ]
            for r in rows
        ]
        if any(sites):
            headers.append("SITE")
            table = [[*row, site or "-"] for row, site in zip(table, sites, strict=True)]
        _table(headers, table)
        return 0

    return _run(body)


def _state_handler(state_name: str) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        from kvsp.registries import InstanceState

        state = InstanceState(state_name)

        async def body() -> int:
            async with _pc_client(args) as pc:
                row = _find((await _listing(pc))[0], args.instance)
                now = await pc.set_state(row.instance, state)
            if args.json:
                _print_json({"instance": row.instance, "was": str(row.state), "state": str(now)})
            else:
                print(f"{row.instance}: {row.state} -> {now}")
            return 0

        return _run(body)

    return handler


# --- prompts and descriptors -----------------------------------------------------------------


def _tokens(args: argparse.Namespace) -> list[int]:
    if args.prompt is not None:
        return list(args.prompt.encode("utf-8"))  # byte-level tokens, as kvsp generate
    if args.tokens is not None:
        try:
            return [int(part, 10) for part in args.tokens.split(",") if part.strip()]
        except ValueError:
            raise OpsError("--tokens: expected comma-separated decimal integers") from None
    try:
        data = json.loads(_read_text(args.tokens_file, "--tokens-file"))
    except json.JSONDecodeError as exc:
        raise OpsError(f"--tokens-file {args.tokens_file}: malformed JSON: {exc.msg}") from None
    if not isinstance(data, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in data
    ):
        raise OpsError(f"--tokens-file {args.tokens_file}: expected a JSON array of token ids")
    return data


def _scope_key(args: argparse.Namespace) -> bytes:
    text = _read_text(args.scope_key_file, "--scope-key-file")
    try:
        return bytes.fromhex(text)
    except ValueError:  # not echoed: the file holds a secret
        raise OpsError(f"--scope-key-file {args.scope_key_file}: not hex") from None


async def _descriptor(args: argparse.Namespace, index: Any) -> CompatibilityDescriptor:
    from kvsp.ids import parse_compat_id
    from kvsp.stores.descriptors import read_descriptor_file

    if args.descriptor is not None:
        return read_descriptor_file(args.descriptor)
    found: CompatibilityDescriptor = await index.get_descriptor(
        parse_compat_id(args.compat_id, "--compat-id")
    )
    return found


async def _look_up(args: argparse.Namespace, index: Any) -> tuple[Any, Any, LookupResponse]:
    """The prompt's scope, compat id, keys and the IS's answer for them."""
    from kvsp.compat import compat_id
    from kvsp.ids import CompatId, ScopeId
    from kvsp.keys import block_keys, scope_id
    from kvsp.records import LookupRequest

    key = _scope_key(args)
    tokens = _tokens(args)
    descriptor = await _descriptor(args, index)
    cid = CompatId(compat_id(descriptor))
    keys = tuple(block_keys(key, cid, tokens, descriptor.block_tokens))
    if not keys:
        raise OpsError(
            f"the prompt has {len(tokens)} tokens: less than one block of "
            f"{descriptor.block_tokens}, so nothing is cached for it"
        )
    request = LookupRequest(scope_id=ScopeId(scope_id(key)), compat_id=cid, block_keys=keys)
    return request, keys, await index.lookup(request)


# --- replicas, holders -----------------------------------------------------------------------


def _index_client(args: argparse.Namespace, base: list[str]) -> Any:
    from kvsp.services.index.client import IndexClient

    return IndexClient(base, _read_text(args.token_file, "--token-file"))


def _census_row(row: dict[str, Any]) -> list[object]:
    return [row.get("holder", "?"), row.get("replicas", "?"), row.get("octets", "?")]


async def _census(index: Any) -> list[dict[str, Any]]:
    raw = await index._request_json("GET", "replicas")
    if not isinstance(raw, dict) or not isinstance(raw.get("holders"), list):
        from kvsp.errors import RemoteError

        raise RemoteError("GET replicas: no holders array in the answer", remote_status=200)
    return [row for row in raw["holders"] if isinstance(row, dict)]


def _print_census(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        _print_json({"holders": rows})
        return
    if not rows:
        print("(the IS has no live records)")
        return
    headers = ["HOLDER", "RECORDS", "OCTETS"]
    table = [_census_row(r) for r in rows]
    extra = sorted({k for r in rows for k in r} - {"holder", "replicas", "octets"})
    for name in extra:  # extension members such as "site"
        headers.append(name.upper())
        for row, r in zip(table, rows, strict=True):
            row.append(r.get(name, "-"))
    _table(headers, table)


def _cmd_holders(args: argparse.Namespace) -> int:
    async def body() -> int:
        async with _index_client(args, args.index) as index:
            _print_census(await _census(index), args.json)
        return 0

    return _run(body)


def _record_json(record: ReplicaRecord) -> dict[str, Any]:
    out: dict[str, Any] = record.to_json()
    return out


def _cmd_replicas(args: argparse.Namespace) -> int:
    given = [args.scope_key_file, args.descriptor or args.compat_id, _prompt_given(args)]
    if not any(given):

        async def census() -> int:
            async with _index_client(args, args.index) as index:
                rows = await _census(index)
            if args.holder is not None:
                rows = [r for r in rows if r.get("holder") == args.holder]
            _print_census(rows, args.json)
            return 0

        return _run(census)
    if not all(given):
        raise OpsError(
            "a lookup needs --scope-key-file, --descriptor or --compat-id, and --prompt, "
            "--tokens or --tokens-file (without them: the census per holder)"
        )

    async def body() -> int:
        async with _index_client(args, args.index) as index:
            _, keys, answer = await _look_up(args, index)
        found = answer.replicas or ()
        rows: list[tuple[int, bytes, ReplicaRecord]] = [
            (i, keys[i], r)
            for i, records in enumerate(found)
            for r in records
            if args.holder is None or r.holder == args.holder
        ]
        if args.json:
            blocks = [
                {"block": i, "block_key": keys[i].hex(), "replicas": [_record_json(r) for r in rs]}
                for i, rs in enumerate(found)
            ]
            _print_json({"keys": len(keys), "matched": answer.matched, "blocks": blocks})
            return 0
        print(f"matched {answer.matched} of {len(keys)} blocks")
        if rows:
            _table(
                ["BLOCK", "BLOCK_KEY", "HOLDER", "OCTETS", "TTL_MS"],
                [[i, k.hex(), r.holder, r.size, r.ttl_ms] for i, k, r in rows],
            )
        return 0

    return _run(body)


def _prompt_given(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.prompt, args.tokens, args.tokens_file))


# --- prefetch --------------------------------------------------------------------------------


class _Instance:
    """The instance's own routes the command calls: ``status``, ``prefetch`` (§6.3, §6.5)."""

    def __init__(self, base: str, token: str) -> None:
        from kvsp.web.client import BaseClient

        self.client = BaseClient(base, token)  # an audience credential, not the token

    async def status(self) -> InstanceStatusRecord:
        from kvsp.records import InstanceStatusRecord
        from kvsp.web.client import decode_answer

        answer = await self.client._request_json("GET", "status")
        return decode_answer(InstanceStatusRecord.from_json, answer)

    async def post(self, body: dict[str, Any]) -> None:
        await self.client._request("POST", "prefetch", body)

    async def outcome(self, directive: uuid.UUID, wait_ms: int) -> Any:
        from kvsp.records_control import DirectiveStatus
        from kvsp.web.client import decode_answer

        path = f"prefetch/{directive}?wait_ms={min(wait_ms, MAX_WAIT_MS)}"
        return decode_answer(
            DirectiveStatus.from_json, await self.client._request_json("GET", path)
        )


def choose_sources(
    instance: str, status: InstanceStatusRecord, found: Sequence[Sequence[ReplicaRecord]]
) -> list[str | None]:
    """Per matched block, the holder to load it from: the one the instance measured the fastest
    link to (unmeasured ones after, by URI), ``None`` where the instance holds it itself."""
    rates = {link.holder: (-link.mbit_per_s, link.rtt_us) for link in status.links}
    unknown = (0.0, float("inf"))
    chosen: list[str | None] = []
    for records in found:
        holders = {r.holder for r in records}
        if instance in holders:
            chosen.append(None)
            continue
        chosen.append(min(holders, key=lambda h: (rates.get(h, unknown), h)))
    return chosen


def _cmd_prefetch(args: argparse.Namespace) -> int:
    async def body() -> int:
        from kvsp.placement_plan import build_directive
        from kvsp.records import PlaceRequest
        from kvsp.registries import InstanceState

        token = _read_text(args.token_file, "--token-file")
        async with _pc_client(args) as pc:
            row = _find((await _listing(pc))[0], args.instance)
        if row.state is not InstanceState.ACTIVE:
            raise OpsError(f"{row.instance} is {row.state}: only an active one is directed (§6.3)")
        async with _index_client(args, args.index or args.pc) as index:
            request, keys, answer = await _look_up(args, index)
        found = answer.replicas or ()
        target = _Instance(row.instance, token)
        try:
            status = await target.status()
            sources = choose_sources(row.instance, status, found)
            place = PlaceRequest(
                scope_id=request.scope_id,
                compat_id=request.compat_id,
                block_keys=keys,
                prompt_tokens=len(keys),
            )
            directive = build_directive(
                directive_id=uuid.uuid4(),
                request=place,
                replicas=found,
                sources=sources,
                status=status,
                deadline_ms=args.deadline_ms,
                lease_ms=args.lease_ms,
            )
            report: dict[str, Any] = {
                "instance": row.instance,
                "keys": len(keys),
                "matched": answer.matched,
                "resident": sum(s is None for s in sources),
                "directive": None,
            }
            if directive is None:
                _prefetch_report(args, report)
                return 0
            await target.post(directive.to_json())
            report["directive"] = str(directive.directive)
            report["directed"] = len(directive.blocks)
            if args.wait_ms:
                outcome = await target.outcome(directive.directive, args.wait_ms)
                report["state"] = str(outcome.state)
                report["loaded"] = len(outcome.loaded)
                if outcome.detail:
                    report["detail"] = outcome.detail
        finally:
            await target.client.aclose()
        _prefetch_report(args, report)
        return 0 if report.get("state") in (None, "complete", "pending") else 1

    return _run(body)


def _prefetch_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.json:
        _print_json(report)
        return
    head = f"{report['instance']}: matched {report['matched']} of {report['keys']} blocks"
    if report["directive"] is None:
        print(f"{head}, {report['resident']} already there: nothing to prefetch")
        return
    print(f"{head}; directive {report['directive']}: {report['directed']} blocks to load")
    if "state" in report:
        detail = f" ({report['detail']})" if "detail" in report else ""
        print(f"{report['state']}: {report['loaded']} of {report['directed']} loaded{detail}")


def main_guard(handler: Handler) -> Handler:
    """``handler`` with :class:`OpsError` printed as one ``kvsp: error:`` line (exit 1)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except OpsError as exc:
            print(f"kvsp: error: {exc}", file=sys.stderr)
            return 1

    return run
