"""``kvsp demo``, ``kvsp up``, ``kvsp status`` and ``kvsp bench`` (the parsers are cheap; the
handlers import the cluster, HTTP and scenario modules only when they run).

Exit status:

* ``kvsp demo``: 0 when the scenario played to its end, 1 when the cluster or a step failed,
  130 on Ctrl-C (SIGINT), 143 on SIGTERM. Every service it started is stopped in all cases.
* ``kvsp up``: runs until Ctrl-C or SIGTERM, which stop every service and exit 0 (the way to
  stop it); 1 when the cluster failed to start or a service died.
* ``kvsp status``: 0 when the control plane answered, 1 otherwise.
* ``kvsp bench``: the status of ``bench/report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsp.demo.client import DemoClient
    from kvsp.demo.cluster import Cluster, ClusterConfig
    from kvsp.demo.console import Console

EXIT_FAILED = 1
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class Terminated(Exception):
    """SIGTERM arrived: unwind and stop the cluster, as for Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Let a stop finish: a second Ctrl-C must not leave services half stopped."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _prompt_tokens(text: str) -> int:
    if not text.isdigit() or not 256 <= int(text) <= 3584:
        raise argparse.ArgumentTypeError(f"expected 256 to 3584 tokens, got {text!r}")
    return int(text)


def _state_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state",
        type=Path,
        metavar="DIR",
        help="state folder: model, principals, tokens, logs (default ~/.kvsp/demo)",
    )


def _cluster_args(parser: argparse.ArgumentParser) -> None:
    _state_arg(parser)
    parser.add_argument(
        "--instances",
        type=int,
        default=3,
        choices=range(2, 7),
        metavar="N",
        help="reference-engine instances, 2 to 6 (default 3)",
    )


def add_demo_commands(sub: Any) -> None:
    """Add ``demo``, ``up``, ``status`` and ``bench`` to the ``kvsp`` subcommands."""
    p = sub.add_parser(
        "demo", help="start a local cluster, play a scenario, print a report, stop it all"
    )
    _cluster_args(p)
    p.add_argument(
        "--prompt-tokens",
        type=_prompt_tokens,
        default=2048,
        metavar="N",
        help="length of the shared system prompt in tokens (default 2048)",
    )
    p.set_defaults(handler=_cmd_demo)
    p = sub.add_parser("up", help="start the demo's cluster and keep it running (Ctrl-C stops)")
    _cluster_args(p)
    p.set_defaults(handler=_cmd_up)
    p = sub.add_parser("status", help="print a running cluster's instances, replicas, sessions")
    _state_arg(p)
    from kvsp.web.failover import add_url_list_argument

    add_url_list_argument(p, "--pc", help="a control plane (IS + PC) instead of --state")
    p.add_argument("--token-file", type=Path, metavar="FILE", help="its token (with --pc)")
    p.set_defaults(handler=_cmd_status)
    p = sub.add_parser(
        "bench", help="run the benchmarks and write bench/report.md with plots (bench/report.py)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes: minutes, not tens")
    p.add_argument("--out", type=Path, metavar="DIR", help="where report.md and PNGs go")
    p.add_argument("--only", metavar="NAMES", help="comma-separated benchmarks to run")
    p.set_defaults(handler=_cmd_bench)


def _config(args: argparse.Namespace) -> ClusterConfig:
    from kvsp.demo.cluster import ClusterConfig
    from kvsp.demo.state import default_state

    return ClusterConfig(state=args.state or default_state(), instances=args.instances)


def _with_cluster(args: argparse.Namespace, body: Callable[[Cluster, Console], int]) -> int:
    """Start the cluster, run ``body``, and stop every service whatever happens."""
    import httpx

    from kvsp.demo.client import DemoHTTPError
    from kvsp.demo.cluster import Cluster
    from kvsp.demo.console import Console
    from kvsp.errors import KVSPError

    console = Console()
    config = _config(args)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # Ctrl-C stops the cluster even where SIGINT came ignored (a shell's background job).
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = Cluster(config, console)
    try:
        console.line(f"state folder {config.state}; admin token in {cluster.files.admin_token}")
        cluster.start()
        return body(cluster, console)
    except KeyboardInterrupt:
        console.line("\ninterrupted: stopping every service")
        return EXIT_SIGINT
    except Terminated:
        console.line("terminated: stopping every service")
        return EXIT_SIGTERM
    except (KVSPError, DemoHTTPError, httpx.HTTPError, RuntimeError, OSError) as exc:
        print(f"kvsp: error: {exc}", file=sys.stderr)
        print(f"(service logs: {cluster.files.services}/*/output.log)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        with _signals_ignored():
            cluster.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvsp.demo.scenario import DemoOptions

    options = DemoOptions(prompt_tokens=args.prompt_tokens)

    def play(cluster: Cluster, console: Console) -> int:
        from kvsp.demo.scenario import Scenario
        from kvsp.demo.status import print_replicas
        from kvsp.demo.summary import print_report

        _print_endpoints(cluster, console)
        with _client(cluster) as client:
            scenario = Scenario(cluster, client, console, options)
            figures = scenario.run()
            print_report(console, figures, scenario.names())
            print_replicas(console, scenario.names(), client.census())
        console.line()
        console.line("stopping every service")
        return 0

    return _with_cluster(args, play)


def _client(cluster: Cluster) -> DemoClient:
    from kvsp.demo.client import DemoClient

    return DemoClient(
        cluster.running().control,
        client_token=cluster.files.read_token("client"),
        admin_token=cluster.files.read_token("admin"),
        scope_key=cluster.scope_key,
        scope=cluster.scope,
        compat=cluster.compat,
        block_tokens=cluster.config.block_tokens,
    )


def _print_endpoints(cluster: Cluster, console: Console) -> None:
    e = cluster.running()
    rows: list[list[object]] = [["control plane (IS + PC)", e.control]]
    if e.relay_moqt:
        rows += [["relay (MOQT)", e.relay_moqt], ["relay (HTTP holder face)", e.relay_http]]
    rows += [[f"instance {name}", url] for name, url in e.instances.items()]
    console.table(["service", "URL"], rows)


def _cmd_up(args: argparse.Namespace) -> int:
    def keep(cluster: Cluster, console: Console) -> int:
        _print_endpoints(cluster, console)
        console.line(f"admin token: {cluster.files.admin_token}")
        console.line(f"`kvsp status --state {cluster.files.root}` shows it; Ctrl-C stops all")
        console.line("cluster up")
        while True:
            dead = [s for s in cluster.group.services.values() if not s.alive()]
            if dead:
                names = ", ".join(f"{s.name} ({s.proc.returncode})" for s in dead)
                print(
                    f"kvsp: error: a service exited: {names}; stopping the others", file=sys.stderr
                )
                return EXIT_FAILED
            time.sleep(0.5)

    code = _with_cluster(args, keep)
    return 0 if code in (EXIT_SIGINT, EXIT_SIGTERM) else code


def _cmd_status(args: argparse.Namespace) -> int:
    from kvsp.demo.console import Console
    from kvsp.demo.state import default_state
    from kvsp.demo.status import print_status, target_from_options, target_from_state
    from kvsp.errors import ClusterError

    if (args.pc is None) != (args.token_file is None):
        raise ClusterError("--pc and --token-file go together")
    if args.pc is not None and args.state is not None:
        raise ClusterError("give --state or --pc, not both")
    if args.pc is not None:
        target = target_from_options(args.pc, args.token_file)
    else:
        target = target_from_state(args.state or default_state())
    return print_status(Console(), target)


def _cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "bench" / "report.py"
    if not script.is_file():
        from kvsp.errors import ClusterError

        raise ClusterError(f"{script} not found: `kvsp bench` runs from a source checkout")
    argv = [sys.executable, str(script)]
    if args.quick:
        argv.append("--quick")
    if args.out is not None:
        argv += ["--out", str(args.out)]
    if args.only is not None:
        argv += ["--only", args.only]
    return subprocess.run(argv, check=False).returncode
