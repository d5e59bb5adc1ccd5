"""``kvsp sim``: replay Mooncake traces through the placement policies and report.

Wiring: ``add_sim_command(subparsers)`` adds the ``sim`` command to the ``kvsp`` parser (its
handler is :func:`run`); :func:`configure_parser` alone fills an existing parser.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvsp.errors import BadRequest
from kvsp.sim.config import ClusterConfig, load_config
from kvsp.sim.engine import RunResult, simulate
from kvsp.sim.policies import BEYOND_SPEC, POLICIES, SPEC_POLICIES
from kvsp.sim.replicas import SCOPE_KEY, ClusterIndex
from kvsp.sim.report import Summary, format_table, plot_cdfs, summarize
from kvsp.sim.trace import KeyMapper, SimRequest, load_trace, to_requests

DEFAULT_SLO_S = 10.0


PAPER_AVG_TTFT_S = {"conversation_trace": (3.07, 19.65)}
"""Average TTFT (global cache-aware, random) the Mooncake paper reports for a trace (FAST'25,
section 5, Fig. 5), printed beside the KVSP / random ratio."""


def add_sim_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sim`` to the ``kvsp`` subcommands (``subparsers`` from ``add_subparsers``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim", help="replay request traces through the placement policies (§6.4)"
    )
    configure_parser(parser)
    parser.set_defaults(handler=run)
    return parser


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``kvsp sim`` arguments to ``p``."""
    p.add_argument(
        "--trace",
        required=True,
        action="append",
        metavar="FILE.jsonl",
        help="a Mooncake-format trace; repeat for several (one table each)",
    )
    p.add_argument(
        "--policy",
        default="all",
        metavar="all|NAME[,NAME]",
        help=f"policies to compare (names: {', '.join(POLICIES)})",
    )
    p.add_argument(
        "--beyond-spec",
        action="store_true",
        help="also run the beyond-spec policy (kvsp-backlog) with 'all', and allow it",
    )
    p.add_argument(
        "--instances",
        metavar="N|auto",
        help="instances (default: the config's); 'auto' sizes each trace so that "
        "prefilling every prompt without reuse would take the whole cluster",
    )
    p.add_argument("--config", metavar="FILE.json|FILE.toml", help="cluster parameter file")
    p.add_argument("--cache-blocks", type=int, metavar="N", help="KV cache blocks per instance")
    p.add_argument("--store-blocks", type=int, metavar="N", help="shared store blocks (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--slo-s", type=float, default=DEFAULT_SLO_S, help="TTFT SLO in seconds")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--out", required=True, metavar="DIR", help="where summary.json and plots go")


def _policies(text: str, beyond: bool) -> list[str]:
    if text == "all":
        chosen = [p.name for p in SPEC_POLICIES]
        return chosen + ([p.name for p in BEYOND_SPEC] if beyond else [])
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in POLICIES:
            raise BadRequest(f"--policy: unknown policy {name!r} (known: {', '.join(POLICIES)})")
        if not beyond and any(p.name == name for p in BEYOND_SPEC):
            raise BadRequest(f"--policy: {name} is beyond the spec; add --beyond-spec")
    if not names:
        raise BadRequest("--policy: no policy named")
    return names


def auto_instances(requests: Sequence[SimRequest], config: ClusterConfig) -> int:
    """Instances whose capacity equals the prefill work of every prompt without reuse."""
    if len(requests) < 2:
        return 1
    span_us = requests[-1].arrival_us - requests[0].arrival_us
    work_us = sum(config.prefill_us(r.input_tokens, 0) for r in requests)
    return max(1, round(work_us / span_us)) if span_us > 0 else 1


def _base_config(args: argparse.Namespace) -> ClusterConfig:
    config = load_config(args.config) if args.config else ClusterConfig()
    return config.with_overrides(cache_blocks=args.cache_blocks, store_blocks=args.store_blocks)


def _instances(
    args: argparse.Namespace, requests: Sequence[SimRequest], config: ClusterConfig
) -> int:
    if args.instances is None:
        return config.instances
    if args.instances == "auto":
        return auto_instances(requests, config)
    try:
        return int(args.instances)
    except ValueError:
        raise BadRequest(
            f"--instances: expected a number or 'auto', got {args.instances!r}"
        ) from None


def _replay(
    path: str, args: argparse.Namespace, base: ClusterConfig, policies: Sequence[str], out: Path
) -> dict[str, Any]:
    started = time.perf_counter()
    trace = load_trace(path, base.block_tokens)
    if args.limit is not None:
        trace = trace[: max(0, args.limit)]
    mapper = KeyMapper(SCOPE_KEY, ClusterIndex(base).compat_id, base.block_tokens)
    requests = to_requests(trace, mapper, base.block_tokens)
    config = base.with_overrides(instances=_instances(args, requests, base))
    keyed_s = time.perf_counter() - started
    results: list[RunResult] = []
    summaries: list[Summary] = []
    stem = Path(path).stem
    for name in policies:
        t0 = time.perf_counter()
        result = simulate(config, requests, name, seed=args.seed)
        results.append(result)
        summaries.append(summarize(result, slo_s=args.slo_s, runtime_s=time.perf_counter() - t0))
    title = (
        f"{Path(path).name}: {len(requests)} requests, {config.instances} instances, "
        f"{config.cache_blocks} blocks each, store {config.store_blocks} blocks"
    )
    print(format_table(title, summaries, slo_s=args.slo_s))
    if stem in PAPER_AVG_TTFT_S:
        (paper_global, paper_random) = PAPER_AVG_TTFT_S[stem]
        print(
            f"the paper's global cache-aware / random on this trace: {paper_global} s / "
            f"{paper_random} s = {paper_global / paper_random:.3f} (its 16 x 8 A800 cluster and "
            "prefill model, not this one)"
        )
    print(
        plot_cdfs(
            results, out / f"ttft_cdf_{stem}.png", title=f"TTFT CDF: {stem}", slo_s=args.slo_s
        )
    )
    print(
        f"keys for {mapper.distinct_blocks} distinct blocks in {keyed_s:.1f} s; "
        f"replays in {sum(s.runtime_s for s in summaries):.1f} s\n"
    )
    return {
        "trace": str(path),
        "requests": len(requests),
        "distinct_blocks": mapper.distinct_blocks,
        "config": asdict(config),
        "slo_s": args.slo_s,
        "policies": [s.to_json() for s in summaries],
    }


def run(args: argparse.Namespace) -> int:
    """Replay each trace under each policy, print the tables, write summary.json and plots.

    Raises:
        TraceError: a bad trace line.
        ConfigError: a bad parameter file or value.
        BadRequest: bad arguments or an output folder that cannot be written.
    """
    policies = _policies(args.policy, args.beyond_spec)
    base = _base_config(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadRequest(f"--out: cannot create {out}: {exc.strerror or exc}") from None
    reports = [_replay(path, args, base, policies, out) for path in args.trace]
    try:
        (out / "summary.json").write_text(json.dumps(reports, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise BadRequest(f"--out: cannot write summary.json: {exc.strerror or exc}") from None
    sys.stdout.flush()
    return 0
