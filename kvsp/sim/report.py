"""Summaries of replays: the per-trace table, a JSON summary, and a PNG of TTFT CDFs.

Metrics per policy: average, p50, p90 and p99 TTFT; cache hit ratio (prompt tokens served from
reused blocks, local or fetched, over all prompt tokens); octets fetched between holders;
tokens recomputed (prefilled); and the share of requests whose TTFT exceeds the SLO.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsp.sim.engine import RunResult

GIB = float(1 << 30)


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """One policy's figures on one trace."""

    policy: str
    requests: int
    avg_ttft_s: float
    p50_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    hit_ratio: float
    fetched_gib: float
    recompute_mtok: float
    slo_violation: float
    published: int
    withdrawn: int
    evictions: int
    runtime_s: float

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return asdict(self)


def summarize(result: RunResult, *, slo_s: float, runtime_s: float = 0.0) -> Summary:
    """The figures of one replay (all zero for an empty one)."""
    outcomes = result.outcomes
    ttft = np.array([o.ttft_us for o in outcomes], dtype=np.float64) / 1e6
    prompt = sum(o.input_tokens for o in outcomes)
    reused = sum(o.input_tokens - o.recomputed_tokens for o in outcomes)
    fetched = sum(o.fetched_blocks for o in outcomes) * result.block_bytes
    empty = not outcomes

    def pct(q: float) -> float:
        return 0.0 if empty else float(np.percentile(ttft, q))

    return Summary(
        policy=result.policy,
        requests=len(outcomes),
        avg_ttft_s=0.0 if empty else float(ttft.mean()),
        p50_ttft_s=pct(50),
        p90_ttft_s=pct(90),
        p99_ttft_s=pct(99),
        hit_ratio=reused / prompt if prompt else 0.0,
        fetched_gib=fetched / GIB,
        recompute_mtok=sum(o.recomputed_tokens for o in outcomes) / 1e6,
        slo_violation=0.0 if empty else float((ttft > slo_s).mean()),
        published=result.published,
        withdrawn=result.withdrawn,
        evictions=result.evictions,
        runtime_s=runtime_s,
    )


_COLUMNS = (
    ("policy", 24, "{:<24}"),
    ("avg TTFT s", 10, "{:>10.2f}"),
    ("p90 TTFT s", 10, "{:>10.2f}"),
    ("hit %", 6, "{:>6.1f}"),
    ("fetched GiB", 11, "{:>11.1f}"),
    ("recompute Mtok", 14, "{:>14.2f}"),
    ("SLO viol %", 10, "{:>10.1f}"),
    ("run s", 6, "{:>6.1f}"),
)


def format_table(title: str, summaries: Sequence[Summary], *, slo_s: float) -> str:
    """A fixed-width table of ``summaries`` under ``title``, with the KVSP / random ratio."""
    header = "  ".join(
        f"{name:>{width}}" if n else f"{name:<{width}}"
        for n, (name, width, _) in enumerate(_COLUMNS)
    )
    lines = [title, f"(SLO: TTFT <= {slo_s:g} s)", header, "-" * len(header)]
    for s in summaries:
        values = (
            s.policy,
            s.avg_ttft_s,
            s.p90_ttft_s,
            100 * s.hit_ratio,
            s.fetched_gib,
            s.recompute_mtok,
            100 * s.slo_violation,
            s.runtime_s,
        )
        lines.append(
            "  ".join(fmt.format(v) for (_, _, fmt), v in zip(_COLUMNS, values, strict=True))
        )
    by_name = {s.policy: s for s in summaries}
    base = by_name.get("random")
    if base is not None and base.avg_ttft_s > 0:
        for name in ("kvsp", "kvsp-backlog"):
            if name in by_name:
                ratio = by_name[name].avg_ttft_s / base.avg_ttft_s
                lines.append(f"average TTFT {name} / random: {ratio:.3f}")
    return "\n".join(lines)


def plot_cdfs(results: Sequence[RunResult], path: Path, *, title: str, slo_s: float) -> str:
    """Write a PNG of the TTFT CDF of each replay (log time axis, the SLO dashed); returns a
    line saying where it went, or why no plot was made (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib) for {path.name}"
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for result in results:
        ttft = np.sort(np.array([o.ttft_us for o in result.outcomes], dtype=np.float64) / 1e6)
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=result.policy)
    ax.axvline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot: {path}"
