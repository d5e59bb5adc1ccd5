"""Benchmark §6.8 sessions among real processes: failover time and the cost of the release gate.

Run by hand: ``.venv/bin/python bench/bench_failover.py`` (a few minutes on 2 cores).

It starts ``kvsp serve control``, a ``kvsp serve holder`` keeping session replicas and three
``kvsp serve instance --engine toy`` (status TTL ``--ttl-ms``, the PC sweeping every 50 ms),
then measures through the front-end library (:mod:`kvsp.services.frontend`):

* **Failover time**: ``--runs`` generations, each with its serving instance SIGKILLed when the
  caller sees output index ``--kill-at``; the time from the kill to the first token of the new
  epoch at the caller, median and p90, split by the PC's event log (same monotonic clock) into
  detection (kill → the PC moves the session: status expiry + sweep + §6.4 choice), resume
  (move → the new instance took it) and reattach (→ the caller's first new token). Killed
  instances are restarted in the background.
* **Release gate**: for each ``--decode-ms`` pacing of the toy engine's decode rounds, the same
  greedy generations run alternately ungated (``deterministic``: tokens go out as made) and
  gated (``deterministic: false``: no token before the PC acknowledged a checkpoint covering
  it; ``--gate-batch`` new tokens per gated checkpoint), side by side; reported per mode: time
  to first token, mean per-token latency after it, median and p90 gap between tokens, time to
  the last token, and gated / ungated ratios. (Both modes wait for the first checkpoint before
  the first token; a pacing so fast that the whole generation is made before that
  acknowledgement measures nothing, hence paced decode rounds.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvsp.compat import compat_id
from kvsp.engine.toy import toy_descriptor
from kvsp.keys import scope_id
from kvsp.services.frontend import FrontEnd, FrontendConfig
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process

DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=16, kv_dtype="fp16", block_tokens=8)
COMPAT = compat_id(DESCRIPTOR)
SCOPE_KEY = bytes(range(60, 92))
SCOPE = scope_id(SCOPE_KEY)
ADMIN = "bench-failover-admin-token-0123456789abcdef"
CLIENT = "bench-failover-client-token-0123456789abcde"
INSTANCES = ("a", "b", "c")
FRONTEND = FrontendConfig(stall_s=0.3, poll_s=0.02, poll_max_s=0.1, reattach_s=30)


class Cluster:
    """The processes of one run, in a temporary folder."""

    def __init__(self, folder: Path, ttl_ms: int, gate_batch: int = 1) -> None:
        self.folder = folder
        self.ttl_ms = ttl_ms
        self.gate_batch = gate_batch
        self.services: dict[str, RunningService] = {}
        self.restarts = ThreadPoolExecutor(len(INSTANCES))
        self.pending: list[Future[None]] = []
        write_principals(
            folder / "principals",
            [
                principal_entry("admin", ADMIN, ["admin"], None),
                principal_entry("client", CLIENT, ["client"], [SCOPE]),
            ],
        )
        (folder / "admin.token").write_text(ADMIN)
        (folder / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
        (folder / "scope.key").write_text(SCOPE_KEY.hex())

    def serve(self, name: str, service: str, *argv: str, listen: str = "127.0.0.1:0") -> None:
        work = self.folder / name
        work.mkdir(exist_ok=True)
        (work / "ready").unlink(missing_ok=True)  # a restart: wait for the new process
        log = work / "output.log"
        if log.exists():
            log.rename(work / f"output-{time.monotonic_ns()}.log")
        command = [
            *(sys.executable, "-m", "kvsp", "serve", service, "--listen", listen),
            *("--state", str(work / "state"), "--principals", str(self.folder / "principals")),
            *("--descriptor", str(self.folder / "descriptor.json"), *argv),
        ]
        self.services[name] = start_process(command, workdir=work, ready_timeout=120)

    def start(self, decode_ms: float) -> None:
        token = str(self.folder / "admin.token")
        self.serve(
            "control",
            "control",
            *("--directive-token-file", token, "--status-sweep-ms", "50"),
            *("--session-log", str(self.folder / "pc.events")),
        )
        self.serve("holder", "holder", "--index", self.url("control"), "--index-token-file", token)
        for name in INSTANCES:
            self.start_instance(name, decode_ms)

    def start_instance(self, name: str, decode_ms: float, listen: str = "127.0.0.1:0") -> None:
        self.serve(
            name,
            "instance",
            *("--pc", self.url("control"), "--token-file", str(self.folder / "admin.token")),
            *("--engine", "toy", "--scope-key-file", str(self.folder / "scope.key")),
            *("--status-ttl-ms", str(self.ttl_ms), "--replica-holder", self.url("holder")),
            *("--toy-decode-ms", str(decode_ms), "--gate-batch", str(self.gate_batch)),
            listen=listen,
        )

    def restart_later(self, name: str, decode_ms: float) -> None:
        listen = self.url(name).removeprefix("http://").rstrip("/")
        self.pending.append(self.restarts.submit(self.start_instance, name, decode_ms, listen))

    def wait_restarts(self) -> None:
        for future in self.pending:
            future.result()
        self.pending.clear()

    def url(self, name: str) -> str:
        return self.services[name].base_url

    def name_of(self, url: str) -> str:
        return next(n for n, s in self.services.items() if s.base_url == url)

    def events(self) -> list[dict[str, Any]]:
        path = self.folder / "pc.events"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        self.wait_restarts()
        self.restarts.shutdown()
        for service in reversed(list(self.services.values())):
            service.stop()

    def frontend(self) -> FrontEnd:
        return FrontEnd(
            self.url("control"),
            CLIENT,
            scope_id=SCOPE,
            compat_id=COMPAT,
            block_tokens=DESCRIPTOR.block_tokens,
            scope_key=SCOPE_KEY,
            config=FRONTEND,
        )


def prompt_of(seed: int) -> list[int]:
    return [(seed * 7_919 + i * 31) % 30_000 for i in range(3 * DESCRIPTOR.block_tokens + 5)]


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- failover ------------------------------------------------------------------------------------


async def one_failover(
    cluster: Cluster, seed: int, tokens: int, kill_at: int, decode_ms: float
) -> tuple[int, int, str] | None:
    """One killed generation: (kill ns, first new-epoch token ns, session) or None."""
    killed = moved = None
    async with cluster.frontend() as fe:
        async for token in fe.generate(prompt_of(seed), tokens, {"method": "greedy"}):
            if killed is None and token.index == kill_at and fe.current is not None:
                name = cluster.name_of(fe.current)
                killed = time.monotonic_ns()
                cluster.services[name].proc.kill()
                cluster.services[name].proc.wait()
                cluster.restart_later(name, decode_ms)
            elif killed is not None and moved is None and token.epoch > 1:
                moved = time.monotonic_ns()
        session = str(fe.stats.sessions[-1])
    if killed is None or moved is None:
        return None  # the whole generation was out before the kill
    return killed, moved, session


def bench_failover(
    cluster: Cluster, runs: int, tokens: int, kill_at: int, decode_ms: float
) -> None:
    totals, detect, resume, reattach = [], [], [], []
    for run in range(runs):
        cluster.wait_restarts()
        result = asyncio.run(one_failover(cluster, 1000 + run, tokens, kill_at, decode_ms))
        if result is None:
            continue
        killed, moved, session = result
        events = [e for e in cluster.events() if e["session"] == session]
        move = min(e["t_ns"] for e in events if e["event"] == "move")
        resumed = max(e["t_ns"] for e in events if e["event"] == "resumed")
        totals.append((moved - killed) / 1e6)
        detect.append((move - killed) / 1e6)
        resume.append((resumed - move) / 1e6)
        reattach.append((moved - resumed) / 1e6)
    print(f"failover over {len(totals)} runs (status TTL {cluster.ttl_ms} ms, sweep 50 ms):")
    for label, values in (
        ("kill -> first token of the new epoch", totals),
        ("  kill -> PC moves the session", detect),
        ("  move -> new instance took it", resume),
        ("  took it -> caller's first new token", reattach),
    ):
        med, p90 = statistics.median(values), quantile(values, 0.9)
        print(f"  {label:40s} median {med:8.1f} ms   p90 {p90:8.1f} ms")


# --- the release gate --------------------------------------------------------------------------


async def timed(cluster: Cluster, seed: int, tokens: int, gated: bool) -> list[float]:
    """Arrival times (ms from the call) of each token of one greedy generation."""
    sampler: dict[str, Any] = {"method": "greedy", "deterministic": not gated}
    began = time.perf_counter()
    arrivals = []
    async with cluster.frontend() as fe:
        async for _ in fe.generate(prompt_of(seed), tokens, sampler):
            arrivals.append((time.perf_counter() - began) * 1000)
    return arrivals


def summary(runs: Sequence[list[float]]) -> dict[str, float]:
    gaps = [b - a for arrivals in runs for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "ttft": statistics.median(a[0] for a in runs),
        "per_token": statistics.median((a[-1] - a[0]) / (len(a) - 1) for a in runs),
        "gap": statistics.median(gaps),
        "gap_p90": quantile(gaps, 0.9),
        "last": statistics.median(a[-1] for a in runs),
    }


def bench_gate(cluster: Cluster, runs: int, tokens: int, decode_ms: float) -> None:
    results: dict[bool, list[list[float]]] = {False: [], True: []}
    for run in range(runs):
        for gated in (False, True) if run % 2 == 0 else (True, False):
            results[gated].append(asyncio.run(timed(cluster, 2000 + run, tokens, gated)))
    plain, gated = summary(results[False]), summary(results[True])
    print(
        f"release gate, toy decode {decode_ms} ms/round, gate batch {cluster.gate_batch}, "
        f"{runs} x {tokens} tokens each way:"
    )
    print(f"  {'':24s} {'ungated':>10s} {'gated':>10s} {'ratio':>8s}")
    for key, label in (
        ("ttft", "first token (ms)"),
        ("per_token", "per token after it (ms)"),
        ("gap", "median gap (ms)"),
        ("gap_p90", "p90 gap (ms)"),
        ("last", "last token (ms)"),
    ):
        ratio = gated[key] / plain[key] if plain[key] > 0 else float("nan")
        print(f"  {label:24s} {plain[key]:10.2f} {gated[key]:10.2f} {ratio:8.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="failover runs (default 10)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    parser.add_argument("--kill-at", type=int, default=16, help="index that triggers the kill")
    parser.add_argument("--ttl-ms", type=int, default=600, help="instances' status TTL")
    parser.add_argument("--gate-runs", type=int, default=10, help="gate runs each way")
    parser.add_argument("--gate-batch", type=int, default=1, help="instances' --gate-batch")
    parser.add_argument(
        "--decode-ms", default="25,10", help="toy decode pacings to run, ms (default 25,10)"
    )
    args = parser.parse_args(argv)
    pacings = [float(x) for x in args.decode_ms.split(",")]
    for number, decode_ms in enumerate(pacings):
        with tempfile.TemporaryDirectory(prefix="kvsp-bench-failover-") as tmp:
            cluster = Cluster(Path(tmp), args.ttl_ms, args.gate_batch)
            try:
                cluster.start(decode_ms)
                time.sleep(1.0)  # every instance reported once
                if number == 0:
                    bench_failover(cluster, args.runs, args.tokens, args.kill_at, decode_ms)
                    cluster.wait_restarts()
                    time.sleep(1.0)
                bench_gate(cluster, args.gate_runs, args.tokens, decode_ms)
            finally:
                cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
