"""``bench/bench_relay_steady.py`` runs: a relay with the receive-buffer pool and one without it,
each forwarding verified misses with a full cache, and the two ratio lines last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_relay_steady.py"

pytestmark = pytest.mark.timeout(180)


def test_the_steady_state_bench_runs_both_relays_and_prints_its_ratios() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "1", "--warm", "12", "--misses", "8"],
        capture_output=True,
        text=True,
        timeout=170,
        check=True,
    )
    row = r"^(pooled|fresh)\s+0\s+[\d.]+\s+[\d.]+\s+\|\s+[\d.]+\s+\|\s+[\d.]+"
    rows = re.findall(row, run.stdout, re.M)
    assert sorted(rows) == ["fresh", "pooled"]
    lines = run.stdout.strip().splitlines()[-2:]
    assert [re.sub(r"= [\d.]+$", "= X", line) for line in lines] == [
        "ratio relay-cpu-fresh/relay-cpu-pooled = X",
        "ratio miss-rate-pooled/miss-rate-fresh = X",
    ]
