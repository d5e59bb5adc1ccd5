"""The ``kvsp`` command (also ``python -m kvsp``): language-neutral access to the protocol core
(spec §4.1–4.3) so that other implementations can check themselves against this one.

Every command prints its result on stdout. Bad input gives one line on stderr, starting with
``kvsp: error:``, and exit status 2 (usage) or 1 (input); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvsp import __version__
from kvsp.errors import KVSPError
from moqt.errors import ListenError

EXIT_INPUT = 1

Handler = Callable[[argparse.Namespace], int]


class CLIError(Exception):
    """A user-facing error of the command line (printed as one line, exit status 1)."""


def _read_json(path: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CLIError(f"{path}: not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CLIError(f"{path}: malformed JSON: {exc.msg} at line {exc.lineno}") from None


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from None


def _hex_arg(text: str, what: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise CLIError(f"{what}: not hex: {text[:80]!r}") from None


def _cmd_compat_id(args: argparse.Namespace) -> int:
    from kvsp.compat import compat_id

    print(compat_id(_read_json(args.descriptor)).hex())
    return 0


def _scope_key(args: argparse.Namespace) -> bytes:
    if args.scope_key_file is None:
        return _hex_arg(args.scope_key, "--scope-key")
    try:
        text = args.scope_key_file.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read --scope-key-file {args.scope_key_file}: {exc}") from None
    try:
        return bytes.fromhex(text)
    except ValueError:  # not echoed: the file holds a secret
        raise CLIError(f"--scope-key-file {args.scope_key_file}: not hex") from None


SCOPE_KEY_OCTETS = 32
"""Octets of a scope key made by ``kvsp scope-key new`` (§4.2 keys it with HMAC-SHA-256)."""


def _cmd_scope_key_new(args: argparse.Namespace) -> int:
    import os
    import secrets

    from kvsp.keys import scope_id

    key = secrets.token_bytes(SCOPE_KEY_OCTETS)
    path: Path = args.file
    try:  # O_EXCL: never overwrite a key (blocks keyed by it would be lost to their scope)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CLIError(f"{path} exists; a scope key is never overwritten") from None
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(key.hex() + "\n")
    print(scope_id(key).hex())
    return 0


def _cmd_scope_id(args: argparse.Namespace) -> int:
    from kvsp.keys import scope_id

    print(scope_id(_scope_key(args)).hex())
    return 0


def _parse_tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens is not None:
        text = args.tokens.strip()
        if not text:
            return []
        try:
            return [int(part, 10) for part in text.split(",")]
        except ValueError:
            raise CLIError("--tokens: expected comma-separated decimal integers") from None
    data = _read_json(args.tokens_file)
    if not isinstance(data, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in data
    ):
        raise CLIError(f"{args.tokens_file}: expected a JSON array of integers")
    return data


def _cmd_block_keys(args: argparse.Namespace) -> int:
    from kvsp.ids import parse_compat_id
    from kvsp.keys import block_keys

    keys = block_keys(
        _scope_key(args),
        parse_compat_id(args.compat_id, "--compat-id"),
        _parse_tokens(args),
        args.block_tokens,
    )
    sys.stdout.write("".join(key.hex() + "\n" for key in keys))
    return 0


def _cmd_container_inspect(args: argparse.Namespace) -> int:
    from kvsp.container import Geometry, decode_container, replica_digest
    from kvsp.ids import format_digest

    geometry = None
    if args.descriptor:
        geometry = Geometry.from_descriptor(_descriptor(args.descriptor))
    container = decode_container(_read_bytes(args.file), geometry)
    digests = container.layer_digests()
    report = {
        "version": container.version,
        "flags": container.flags,
        "codec": container.codec,
        "first_layer": container.first_layer,
        "layer_count": container.layer_count,
        "token_count": container.token_count,
        "layer_digests": [d.hex() for d in digests],
        "digest": format_digest(replica_digest(digests)),
    }
    print(json.dumps(report, indent=2))
    return 0


def _descriptor(path: str) -> Any:
    from kvsp.compat import CompatibilityDescriptor

    return CompatibilityDescriptor.from_json(_read_json(path))


def _cmd_container_pack(args: argparse.Namespace) -> int:
    from kvsp.container import Geometry, encode_container

    geometry = Geometry.from_descriptor(_descriptor(args.descriptor))
    layers = [(_read_bytes(k), _read_bytes(v)) for k, v in args.layer_file]
    data = encode_container(
        layers, first_layer=args.first_layer, token_count=args.token_count, geometry=geometry
    )
    try:
        Path(args.output).write_bytes(data)
    except OSError as exc:
        raise CLIError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    return 0


def _existing_entries(path: Path) -> list[dict[str, Any]]:
    import datetime
    import tomllib

    from kvsp.web.auth import Principals

    if not path.exists():
        return []
    Principals.load(path)  # refuse to extend a file that does not load
    with path.open("rb") as f:
        doc = tomllib.load(f)
    entries: list[dict[str, Any]] = doc.get("principal", [])
    for entry in entries:
        expires = entry.get("expires")
        if isinstance(expires, datetime.datetime):  # keep it, as integer ms
            entry["expires"] = int(expires.timestamp() * 1000)
    return entries


def _cmd_token(args: argparse.Namespace) -> int:
    from kvsp.ids import parse_scope_id
    from kvsp.web.auth import mint_token, principal_entry, write_principals

    scopes = None if args.scope == ["*"] else [parse_scope_id(s, "--scope") for s in args.scope]
    entries = [e for e in _existing_entries(args.principals) if e.get("name") != args.name]
    if len(entries) != len(_existing_entries(args.principals)) and not args.replace:
        raise CLIError(f"principal {args.name!r} exists in {args.principals}; use --replace")
    token = mint_token()
    entry = principal_entry(args.name, token, args.role, scopes, args.holder, args.expires_ms)
    try:
        write_principals(args.principals, [*entries, entry])
    except OSError as exc:
        raise CLIError(f"cannot write {args.principals}: {exc.strerror or exc}") from None
    print(token)
    return 0


def _cmd_token_audience(args: argparse.Namespace) -> int:
    from kvsp.audience import audience_credential

    try:
        token = args.token_file.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read --token-file {args.token_file}: {exc}") from None
    if not token:
        raise CLIError(f"--token-file {args.token_file} is empty")
    print(audience_credential(token, args.uri))
    return 0


def _cmd_help(parser: argparse.ArgumentParser) -> Handler:
    def show(args: argparse.Namespace) -> int:
        parser.print_help()
        return 0

    return show


SERVICES: dict[str, tuple[str, str, int]] = {
    # name: (module, help, default port)
    "index": ("kvsp.services.index.app", "the Index Service (§6.1-6.2)", 8470),
    "control": ("kvsp.services.control", "the control plane: IS and PC in one process", 8470),
    "pc": ("kvsp.services.pc.app", "the Placement Controller alone (§6.3-6.5)", 8472),
    "holder": ("kvsp.services.holder.app", "a block holder (§6.6-6.7)", 8471),
    "instance": ("kvsp.services.instance.app", "an inference instance agent (§6.3, §6.5)", 8473),
    "relay": ("relay.app", "a caching MOQT relay that is also a KVSP holder (§4.4, §6.6)", 4443),
}


OPTIONAL_PACKAGES = {"torch", "safetensors", "redis"}


def _add_serve_commands(sub: Any, load: bool) -> None:
    """Add ``kvsp serve SERVICE``; service modules are imported only when ``load`` is true,
    so the core commands start without importing the HTTP stack."""
    import importlib

    from kvsp.web.cliargs import add_common_arguments, with_logging
    from kvsp.web.config_file import ConfigArgumentParser

    serve = sub.add_parser("serve", help="run a KVSP service (kvsp serve -h lists them)")
    if not load:
        return
    # every service's flags may also come from KVSP_* variables and --config FILE
    ssub = serve.add_subparsers(metavar="SERVICE", required=True, parser_class=ConfigArgumentParser)
    for name, (module_name, help_text, port) in SERVICES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name not in OPTIONAL_PACKAGES and exc.name != module_name:
                raise
            continue  # the service needs an optional extra that is not installed
        # no abbreviations: "--token SECRET" must not pass for "--token-file SECRET"
        p = ssub.add_parser(name, help=help_text, allow_abbrev=False, service=name)
        add_common_arguments(p, port)
        module.configure_parser(p)
        p.set_defaults(handler=with_logging(module.run))


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvsp.services.frontend import run_generate  # the HTTP stack loads only for this

    return run_generate(args)


def _add_generate_command(sub: Any) -> None:
    """Add ``kvsp generate``: place a session through the PC and print its tokens as they
    come, following it across instance failures (§6.8)."""
    from kvsp.web.failover import add_url_list_argument

    p = sub.add_parser("generate", help="generate through the PC, surviving instance failures")
    add_url_list_argument(p, "--pc", required=True, help="the PC (or kvsp serve control)")
    p.add_argument("--token-file", required=True, type=Path, metavar="FILE")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--descriptor", metavar="D.json", help="the Compatibility Descriptor")
    model.add_argument("--compat-id", metavar="HEX32", help="read the descriptor from the PC")
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("--scope-key-file", type=Path, metavar="FILE", help="scope key (hex)")
    scope.add_argument(
        "--scope-id",
        metavar="HEX16",
        help="the scope, when its key is not at hand (no Block Keys: no cached block is found)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="text, as UTF-8 byte tokens")
    prompt.add_argument("--tokens", metavar="1,2,3", help="token ids")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N")
    p.add_argument(
        "--sampler", default="greedy", choices=["greedy", "temperature", "top-k", "top-p"]
    )
    p.add_argument("--p", type=float, metavar="P", help="top-p mass")
    p.add_argument("--k", type=int, metavar="K", help="top-k count")
    p.add_argument("--temperature", type=float, metavar="T")
    p.add_argument("--seed", type=int, metavar="N", help="sampler seed (none: not reproducible)")
    p.add_argument(
        "--non-deterministic",
        action="store_true",
        help="release no token before the PC acknowledged a checkpoint covering it",
    )
    p.add_argument("--text", action="store_true", help="print byte tokens as text, not NDJSON")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="then print on stderr the instance, matched, loaded and computed blocks, the "
        "directive, TTFT, session id and failovers",
    )
    p.set_defaults(handler=_cmd_generate)


def _add_sim_command(sub: Any, load: bool) -> None:
    """Add ``kvsp sim``; its modules are imported only when ``load`` is true."""
    if load:
        from kvsp.sim.cli import add_sim_command

        add_sim_command(sub)
    else:
        sub.add_parser("sim", help="replay request traces through the placement policies (§6.4)")


def _add_scope_key(p: argparse.ArgumentParser) -> None:
    key = p.add_mutually_exclusive_group(required=True)
    key.add_argument("--scope-key-file", type=Path, metavar="FILE", help="the scope key (hex)")
    key.add_argument(
        "--scope-key",
        metavar="HEX",
        help="the scope key itself (test vectors only: a command line is visible to local users)",
    )


def build_parser(load_services: bool = True, load_sim: bool = True) -> argparse.ArgumentParser:
    """Build the ``kvsp`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvsp", description="KV Cache Storage Protocol (KVSP) reference implementation"
    )
    parser.add_argument("--version", action="version", version=f"kvsp {__version__}")
    parser.set_defaults(handler=_cmd_help(parser))
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("compat-id", help="§4.1 Compatibility ID of a descriptor (hex32)")
    p.add_argument("descriptor", metavar="DESCRIPTOR.json")
    p.set_defaults(handler=_cmd_compat_id)

    p = sub.add_parser("scope-id", help="§4.2 Scope ID of a scope key (hex16)")
    _add_scope_key(p)
    p.set_defaults(handler=_cmd_scope_id)

    key_cmd = sub.add_parser("scope-key", help="§4.2 scope keys (the secret behind a scope)")
    ksub = key_cmd.add_subparsers(metavar="ACTION", required=True)
    p = ksub.add_parser(
        "new",
        help="write a new random scope key (hex, mode 0600) to FILE; print its Scope ID",
        description="Write 32 random octets as hex to FILE (mode 0600; an existing FILE is "
        "never overwritten) and print the Scope ID (hex16). Give FILE to --scope-key-file.",
    )
    p.add_argument("file", type=Path, metavar="FILE")
    p.set_defaults(handler=_cmd_scope_key_new)

    p = sub.add_parser("block-keys", help="§4.2 Block Keys of a token sequence, one per line")
    _add_scope_key(p)
    p.add_argument("--compat-id", required=True, metavar="HEX32")
    p.add_argument("--block-tokens", required=True, type=int, metavar="B")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--tokens", metavar="1,2,3")
    group.add_argument("--tokens-file", metavar="F.json")
    p.set_defaults(handler=_cmd_block_keys)

    container = sub.add_parser("container", help="§4.3 KVB1 block containers")
    csub = container.add_subparsers(metavar="ACTION", required=True)
    p = csub.add_parser("inspect", help="print a container's header and digests as JSON")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--descriptor", metavar="D.json", help="also check lengths against it")
    p.set_defaults(handler=_cmd_container_inspect)
    p = csub.add_parser("pack", help="write a container from raw K/V section files")
    p.add_argument("--descriptor", required=True, metavar="D.json")
    p.add_argument("--first-layer", required=True, type=int, metavar="N")
    p.add_argument("--token-count", required=True, type=int, metavar="T")
    p.add_argument("--layer-file", required=True, nargs=2, action="append", metavar=("K", "V"))
    p.add_argument("-o", "--output", required=True, metavar="OUT")
    p.set_defaults(handler=_cmd_container_pack)
    p = sub.add_parser(
        "token", help="mint a bearer token for a principal and add it to a principals file"
    )
    p.add_argument("--principals", required=True, type=Path, metavar="FILE")
    p.add_argument("--name", required=True)
    p.add_argument(
        "--role",
        required=True,
        action="append",
        choices=["holder", "instance", "pc", "relay", "client", "admin", "metrics"],
        help="repeat for several roles",
    )
    p.add_argument(
        "--scope", required=True, action="append", metavar="HEX16", help="repeat; '*' = all"
    )
    p.add_argument(
        "--holder",
        action="append",
        default=[],
        metavar="URI",
        help="holder or instance URI it may publish or report for (repeat)",
    )
    p.add_argument("--expires-ms", type=int, metavar="MS", help="expiry, ms since the epoch")
    p.add_argument("--replace", action="store_true", help="replace a principal of that name")
    p.set_defaults(handler=_cmd_token)
    p = sub.add_parser(
        "token-audience",
        help="print the credential a token's owner shows to one holder, instance or relay",
        description="Print the audience credential (for Authorization: Bearer, or a MOQT "
        "AUTHORIZATION TOKEN) that binds the token in --token-file to URI's origin; it works "
        "there only, never at the IS or PC.",
    )
    p.add_argument("--token-file", required=True, type=Path, metavar="FILE")
    p.add_argument("uri", metavar="URI", help="the holder, instance or relay (http(s) or moqt)")
    p.set_defaults(handler=_cmd_token_audience)
    from kvsp.engine.cli import configure_model_parser  # torch is imported by its handlers only

    configure_model_parser(sub)
    from kvsp.demo.cli import add_demo_commands  # the cluster modules load in its handlers

    add_demo_commands(sub)
    from kvsp.ops_cli import add_ops_commands  # clients load in its handlers

    add_ops_commands(sub)
    _add_generate_command(sub)
    _add_sim_command(sub, load_sim)
    _add_serve_commands(sub, load_services)
    return parser


EXIT_PIPE = 141
"""Exit status when stdout was closed early (``kvsp status | head -1``): 128 + SIGPIPE, as a
shell reports a command that SIGPIPE ended."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvsp`` command; returns the exit status.

    A reader that closes stdout early (``| head``) ends the command quietly with
    :data:`EXIT_PIPE`: stdout is pointed at ``/dev/null`` so that the flush at exit cannot
    fail again (the recipe of Python's ``signal`` documentation, "Note on SIGPIPE").
    """
    try:
        try:
            status = _run(list(sys.argv[1:] if argv is None else argv))
        finally:  # --help and usage errors exit through SystemExit: flush before it too
            sys.stdout.flush()  # a buffered tail meets the closed pipe here, not at exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_PIPE
    return status


def _stdout_to_devnull() -> None:
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a caller (tests): nothing to do
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _run(argv: list[str]) -> int:
    parser = build_parser(load_services=argv[:1] == ["serve"], load_sim=argv[:1] == ["sim"])
    args = parser.parse_args(argv)
    try:
        status: int = args.handler(args)
    except (KVSPError, CLIError, ListenError) as exc:
        print(f"kvsp: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
