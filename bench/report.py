"""Run the benchmarks in ``bench/`` in one go and write ``bench/report.md`` with tables and PNG
plots: goodput by transport, lookup latency CDF, TTFT against prompt length, cached and
recomputed.

Each benchmark runs as its own process, one after another (so none measures beside another),
in a quick mode with small sizes (``--quick``) or with its defaults. Those that write
machine-readable results (``--json FILE``; ``gpu_check`` prints JSON) feed the tables and plots;
the text every benchmark prints goes into the report as it is, since each prints its ratios
side by side. A benchmark that fails or runs past its time limit is reported as such, and the
report is still written.

Usage::

    .venv/bin/python bench/report.py [--quick] [--out DIR] [--only index,moqt,ttft]
    kvsp bench [--quick] [--out DIR] [--only ...]      # the same

Plots need matplotlib (the ``sim`` extra); without it the report has the tables only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One script of ``bench/`` and how to run it."""

    name: str
    script: str
    title: str
    quick: tuple[str, ...]
    full: tuple[str, ...] = ()
    timeout_quick_s: float = 300
    timeout_full_s: float = 3600


BENCHMARKS = (
    Benchmark("keys", "bench_keys.py", "Block-key chain (§4.2)", ("--reps", "2")),
    Benchmark("container", "bench_container.py", "KVB1 containers (§4.3)", ("--reps", "5")),
    Benchmark(
        "index",
        "bench_index.py",
        "Index Service lookups (§6.1-6.2)",
        ("--records", "5000", "--prompt-keys", "100")
        + ("--lookups", "10", "--compact-lookups", "20"),
    ),
    Benchmark("blocks", "bench_blocks.py", "Verified block GETs over HTTP (§6.7)", ("--reps", "1")),
    Benchmark(
        "place",
        "bench_place.py",
        "Placement (§6.4)",
        ("--instances", "100", "--prompts", "2", "--prompt-keys", "1000", "--samples", "5"),
    ),
    Benchmark("moqt", "bench_moqt.py", "MOQT and the other transports", ("--quick",)),
    Benchmark(
        "hashbatch",
        "bench_hash_batch.py",
        "The MOQT client's hashing batch (§6.7)",
        ("--quick",),
    ),
    Benchmark(
        "ttft",
        "bench_ttft.py",
        "Time to first token (reference engine)",
        ("--max-tokens", "4096", "--reps", "1"),
    ),
    Benchmark(
        "gpu", "gpu_check.py", "KV sink and engine device check", ("--blocks", "8", "--reps", "1")
    ),
    Benchmark(
        "failover",
        "bench_failover.py",
        "Session failover and the release gate (§6.8)",
        ("--runs", "3", "--gate-runs", "3"),
    ),
    Benchmark(
        "reshard",
        "bench_reshard.py",
        "Resharding, retained ranges against moving all (§6.9)",
        ("--tokens", "8192", "--rounds", "1"),
    ),
    Benchmark(
        "loss",
        "bench_loss.py",
        "MOQT block FETCHes through a lossy network",
        ("--rounds", "1", "--blocks", "1"),
    ),
    Benchmark("crash", "bench_crash.py", "Replicas killed mid-transfer", ("--iterations", "2")),
    Benchmark(
        "upkeep",
        "bench_relay_upkeep.py",
        "The relay's upkeep pass with a large cache",
        ("--blocks", "10000,100000", "--passes", "10"),
    ),
    Benchmark(
        "steady",
        "bench_relay_steady.py",
        "Relay misses with a full cache, receive buffers pooled or fresh",
        ("--rounds", "4"),
    ),
    Benchmark(
        "gc",
        "bench_relay_gc.py",
        "The collector's pauses with a large relay cache, frozen slices or memoryviews",
        ("--rounds", "2"),
    ),
    Benchmark(
        "floor",
        "bench_relay_floor.py",
        "A relay miss against byte forwarders that parse nothing",
        ("--seconds", "8"),
    ),
    Benchmark(
        "load",
        "bench_load.py",
        "Many clients on the IS, many subscribers on the relay",
        ("--seconds", "5", "--clients", "8", "--subscribers", "10"),
    ),
)


@dataclass(slots=True)
class Outcome:
    """What one benchmark run gave."""

    bench: Benchmark
    argv: list[str]
    status: int | None
    """The exit status; ``None`` when it ran past its time limit."""
    seconds: float
    output: str
    data: Any = None
    """Its machine-readable results, if it wrote any."""
    load: float = 0.0
    """The 1-minute load average when it started (other work on the machine slows it)."""

    @property
    def ok(self) -> bool:
        """Whether it exited 0."""
        return self.status == 0


def takes_json(script: Path) -> bool:
    """Whether the benchmark accepts ``--json FILE`` (read from its source, not by running
    it, since some import torch just to print their help)."""
    return '"--json"' in script.read_text(encoding="utf-8")


def run_benchmark(bench: Benchmark, quick: bool, scratch: Path) -> Outcome:
    """Run one benchmark to its end (or its time limit) and collect what it wrote."""
    script = BENCH / bench.script
    argv = [sys.executable, str(script), *(bench.quick if quick else bench.full)]
    results = scratch / f"{bench.name}.json"
    if takes_json(script):
        argv += ["--json", str(results)]
    timeout = bench.timeout_quick_s if quick else bench.timeout_full_s
    load = os.getloadavg()[0]
    began = time.monotonic()
    try:
        done = subprocess.run(
            argv,
            cwd=BENCH.parent,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        status: int | None = done.returncode
        output = done.stdout + (f"\n[stderr]\n{done.stderr[-3000:]}" if done.returncode else "")
    except subprocess.TimeoutExpired as exc:
        status = None
        output = _text(exc.stdout) + f"\n[ran past its {timeout:.0f} s limit]"
    outcome = Outcome(bench, argv[1:], status, time.monotonic() - began, output, load=load)
    outcome.data = _results(bench, results, outcome)
    return outcome


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value or ""


def _results(bench: Benchmark, path: Path, outcome: Outcome) -> Any:
    if not outcome.ok:
        return None
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    if bench.name == "gpu":  # it prints one JSON object
        start = outcome.output.find("{")
        if start >= 0:
            try:
                return json.loads(outcome.output[start:])
            except ValueError:
                return None
    return None


# --- tables ------------------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def datagrams(row: Any) -> str:
    """``bench_moqt``'s datagram size of a row (-1: the backend's defaults, 1200 B)."""
    return "library defaults" if row["datagram"] == -1 else f"{row['datagram']} B datagrams"


def goodput_rows(data: Any) -> list[tuple[str, float, str]]:
    """(path, MB/s, note) of every transport ``bench_moqt --json`` measured."""
    rows = [(p["path"], float(p["mb_s"]), p.get("note", "")) for p in data.get("paths", [])]
    for r in data.get("moqt", []):
        label = f"MOQT FETCH vs raw QUIC, {r['backend']} {datagrams(r)}"
        rows.append((f"{label}: MOQT", float(r["moqt_mb_s"]), ""))
        rows.append((f"{label}: raw QUIC", float(r["raw_mb_s"]), ""))
    return rows


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def lookup_rows(data: Any) -> list[list[object]]:
    """(variant, n, lookups/s, p50 ms, p90 ms, p99 ms) from ``bench_index --json``."""
    rows: list[list[object]] = []
    for r in data.get("results", []):
        s = [float(x) for x in r["seconds"]]
        if s:
            rows.append(
                [
                    r["name"],
                    len(s),
                    len(s) / sum(s),
                    statistics.median(s) * 1e3,
                    percentile(s, 0.9) * 1e3,
                    percentile(s, 0.99) * 1e3,
                ]
            )
    return rows


def ttft_methods(data: Any) -> list[str]:
    """The load methods of ``bench_ttft --json`` rows: every ``*_s`` member but recompute."""
    found: list[str] = []
    for row in data.get("rows", []):
        for key in row:
            if key.endswith("_s") and key != "recompute_s" and key not in found:
                found.append(key)
    return found


def method_title(method: str) -> str:
    """``http_overlap_s`` → ``HTTP: loading overlapped with compute``."""
    transport, _, mode = method.removesuffix("_s").partition("_")
    how = {"load": "load, then compute", "overlap": "loading overlapped with compute"}
    return f"{transport.upper()}: {how.get(mode, mode)}"


def ttft_rows(data: Any) -> tuple[list[str], list[list[object]]]:
    """Headers and rows (ms) of the TTFT table."""
    methods = ttft_methods(data)
    headers = ["tokens", "cached", "recompute ms", *(f"{method_title(m)}, ms" for m in methods)]
    rows: list[list[object]] = []
    for row in data.get("rows", []):
        values = [row.get(m) for m in methods]
        rows.append(
            [
                int(row["tokens"]),
                f"{100 * float(row['cached']):.0f}%",
                float(row["recompute_s"]) * 1e3,
                *(None if v is None else float(v) * 1e3 for v in values),
            ]
        )
    return headers, rows


# --- plots -------------------------------------------------------------------------------------


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or ``None`` when not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_goodput(plt: Any, data: Any, path: Path) -> Path | None:
    """Left, horizontal bars: MB/s of verified blocks on every path (TCP, HTTP, MOQT on each
    QUIC setting and QMux carrier, through the relay, the peers), per block size. Right
    (``--paired`` runs only), paired bars: MOQT FETCH against raw QUIC per backend and datagram
    size, the same settings side by side."""
    paths = [(p["path"], float(p["mb_s"])) for p in data.get("paths", []) if p["mb_s"]]
    pairs = data.get("moqt", [])
    if not paths and not pairs:
        return None
    panels = [panel for panel in (paths, pairs) if panel]
    height = max(5.5, 0.28 * len(paths))  # one readable bar per path
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), height), squeeze=False)
    ax = axes[0][0]
    if paths:
        bars = ax.barh(range(len(paths)), [rate for _, rate in paths], color="#3b75af")
        ax.bar_label(bars, labels=[f"{rate:,.0f}" for _, rate in paths], fontsize=8, padding=3)
        ax.set_yticks(range(len(paths)), [label for label, _ in paths], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("goodput, MB/s (log scale)")
        ax.set_title("Goodput by transport, verified blocks, loopback")
        ax = axes[0][-1]
    if pairs:
        x = range(len(pairs))
        ax.bar([i - 0.2 for i in x], [r["moqt_mb_s"] for r in pairs], 0.4, label="MOQT FETCH")
        ax.bar([i + 0.2 for i in x], [r["raw_mb_s"] for r in pairs], 0.4, label="raw QUIC")
        labels = [f"{r['backend']}\n{datagrams(r).removesuffix('datagrams')}" for r in pairs]
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("goodput, MB/s")
        ax.set_title("MOQT against raw QUIC, by backend and datagram size")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_lookup_cdf(plt: Any, data: Any, path: Path) -> Path | None:
    """One CDF line per lookup variant, latency on a log axis; one panel per store (the
    in-memory store, Redis when measured), sharing the axis, legends beside them."""
    results = [r for r in data.get("results", []) if r.get("seconds")]
    if not results:
        return None
    stores = [
        ("in-memory store", [r for r in results if not r["name"].startswith("Redis")]),
        ("Redis store", [r for r in results if r["name"].startswith("Redis")]),
    ]
    stores = [(name, found) for name, found in stores if found]
    fig, axes = plt.subplots(
        len(stores), 1, figsize=(11, 4.2 * len(stores)), sharex=True, squeeze=False
    )
    keys, records = data.get("prompt_keys", "?"), data.get("records", "?")
    for ax, (store, found) in zip(axes[:, 0], stores, strict=True):
        colors = plt.get_cmap("tab10" if len(found) <= 10 else "tab20").colors
        for i, r in enumerate(found):
            ms = sorted(float(x) * 1e3 for x in r["seconds"])
            fractions = [(k + 1) / len(ms) for k in range(len(ms))]
            style = "--" if "HTTP" in r["name"] else "-"
            label = r["name"].removeprefix("Redis ")
            color = colors[i % len(colors)]
            ax.step(ms, fractions, style, where="post", color=color, label=label)
        ax.set_xscale("log")
        ax.set_ylabel("fraction of lookups")
        ax.set_title(f"Lookup latency CDF, {store}: {keys}-key prompts, {records} records")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes[-1, 0].set_xlabel("lookup latency, ms (log scale); dashed: over HTTP")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft(plt: Any, data: Any, path: Path) -> Path | None:
    """TTFT against prompt length: recomputed, and each load method per cached share."""
    rows = data.get("rows", [])
    methods = ttft_methods(data)
    if not rows or not methods:
        return None
    cols = min(2, len(methods))
    grid = -(-len(methods) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(6 * cols, 4.5 * grid), squeeze=False)
    recompute = sorted({(int(r["tokens"]), float(r["recompute_s"]) * 1e3) for r in rows})
    shares = sorted({float(r["cached"]) for r in rows} - {0.0})  # 0 %: the recompute line
    for ax in axes.flat[len(methods) :]:
        ax.set_visible(False)
    for ax, method in zip(axes.flat, methods, strict=False):
        ax.plot(*zip(*recompute, strict=True), "k-o", label="recomputed")
        for share in shares:
            points = sorted(
                (int(r["tokens"]), float(r[method]) * 1e3)
                for r in rows
                if float(r["cached"]) == share and r.get(method) is not None
            )
            if points:
                ax.plot(*zip(*points, strict=True), "-o", label=f"{100 * share:.0f}% cached")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT, ms")
        ax.set_title(method_title(method))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the report --------------------------------------------------------------------------------


def _by_name(outcomes: Sequence[Outcome]) -> dict[str, Outcome]:
    return {o.bench.name: o for o in outcomes}


def write_report(outcomes: Sequence[Outcome], out: Path, quick: bool) -> Path:
    """Write ``report.md`` and the PNGs into ``out``; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    found = _by_name(outcomes)
    parts = [_header(outcomes, quick)]
    sections = (
        ("moqt", "Goodput by transport", "goodput_by_transport.png", _goodput_section),
        ("index", "Lookup latency", "lookup_latency_cdf.png", _lookup_section),
        ("ttft", "TTFT against prompt length", "ttft_vs_prompt_length.png", _ttft_section),
    )
    for name, heading, png, section in sections:
        outcome = found.get(name)
        parts.append(f"## {heading}\n")
        if outcome is None:
            parts.append(f"Not run (`--only` left out `{name}`).\n")
        elif outcome.data is None:
            why = "failed or timed out" if not outcome.ok else "wrote no --json results"
            parts.append(f"`{outcome.bench.script}` {why}; its output is below.\n")
        else:
            parts.append(section(plt, outcome.data, out / png))
    parts.append("## Every benchmark's own output\n")
    for outcome in outcomes:
        parts.append(_verbatim(outcome))
    report = out / "report.md"
    report.write_text("\n".join(parts), encoding="utf-8")
    return report


def _header(outcomes: Sequence[Outcome], quick: bool) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = [
        [
            o.bench.name,
            o.bench.title,
            "ok" if o.ok else ("timed out" if o.status is None else f"exit {o.status}"),
            round(o.seconds, 1),
            f"{o.load:.2f}",
        ]
        for o in outcomes
    ]
    return "\n".join(
        [
            "# KVSP benchmark report\n",
            f"Written by `bench/report.py{' --quick' if quick else ''}` on {when}: "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average at the "
            f"end {load}. The benchmarks ran one after another, never two at once; every figure "
            "comes from this run. Other work on the machine slows them: the load average when "
            "each started is in the table.\n",
            md_table(["benchmark", "what", "outcome", "seconds", "load at start"], rows),
            "",
        ]
    )


def _figure(plt: Any, draw: Any, data: Any, path: Path) -> str:
    if plt is None:
        return "(no plot: matplotlib is not installed; `pip install -e '.[sim]'`)\n"
    made = draw(plt, data, path)
    return f"![{path.stem}]({path.name})\n" if made is not None else "(nothing to plot)\n"


def ratio_rows(data: Any) -> list[list[object]]:
    """(ratio, value, target, met) of ``bench_moqt --json``'s ratios (issue #20's targets)."""
    rows: list[list[object]] = []
    for r in data.get("ratios", []):
        value = r.get("value")
        met = "yes" if value is not None and value >= r["target"] else "no"
        shown = "-" if value is None else float(value)
        rows.append([r["ratio"], shown, f">= {r['target']:g}", met])
    return rows


def _goodput_section(plt: Any, data: Any, png: Path) -> str:
    table = md_table(["path (block size)", "MB/s", "note"], goodput_rows(data))
    ratios = ratio_rows(data)
    if ratios:
        table += "\n\n" + md_table(["ratio", "value", "target", "met"], ratios)
    return f"{table}\n\n{_figure(plt, plot_goodput, data, png)}"


def _lookup_section(plt: Any, data: Any, png: Path) -> str:
    headers = ["variant", "n", "lookups/s", "p50 ms", "p90 ms", "p99 ms"]
    table = md_table(headers, lookup_rows(data))
    intro = (
        f"{data.get('prompt_keys', '?')}-key prompts over {data.get('records', '?')} replica "
        "records, one lookup in flight.\n"
    )
    return f"{intro}\n{table}\n\n{_figure(plt, plot_lookup_cdf, data, png)}"


def _ttft_section(plt: Any, data: Any, png: Path) -> str:
    headers, rows = ttft_rows(data)
    return f"{md_table(headers, rows)}\n\n{_figure(plt, plot_ttft, data, png)}"


def _verbatim(outcome: Outcome) -> str:
    shown = [
        "FILE" if a.endswith(".json") and "--json" in outcome.argv else a for a in outcome.argv
    ]
    argv = " ".join(shown).replace(str(BENCH.parent) + "/", "")
    return f"### {outcome.bench.title} (`{argv}`)\n\n```\n{outcome.output.strip()}\n```\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks and write the report; 0 when every benchmark succeeded."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: minutes, not tens")
    parser.add_argument("--out", type=Path, default=BENCH, help="folder for report.md and PNGs")
    names = ",".join(b.name for b in BENCHMARKS)
    parser.add_argument("--only", default=names, help=f"comma-separated, of {names}")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if b.name in set(args.only.split(","))]
    unknown = set(args.only.split(",")) - {b.name for b in BENCHMARKS}
    if unknown or not chosen:
        parser.error(f"--only: unknown benchmark(s) {sorted(unknown)}; choose from {names}")
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="kvsp-bench-report-") as scratch:
        for bench in chosen:
            print(f"running {bench.script} ...", flush=True)
            outcome = run_benchmark(bench, args.quick, Path(scratch))
            verdict = "ok" if outcome.ok else "FAILED"
            print(f"  {verdict} in {outcome.seconds:.1f} s", flush=True)
            outcomes.append(outcome)
    report = write_report(outcomes, args.out, args.quick)
    print(f"wrote {report}")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
