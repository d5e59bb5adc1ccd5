"""``bench/bench_relay_gc.py`` runs: a cache filled with frozen slices and one with tracked
memoryviews, the collector's pauses for each, and the two ratio lines last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_relay_gc.py"

pytestmark = pytest.mark.timeout(120)


def test_the_gc_bench_fills_both_caches_and_prints_its_ratios() -> None:
    pytest.importorskip("moqt._frozen", reason="moqt._frozen was not built here")
    run = subprocess.run(
        [sys.executable, str(BENCH), "--objects", "3000", "--size", "20000", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=110,
        check=True,
    )
    rows = dict(re.findall(r"^(frozen|tracked)\s+0\s+(\d+)\s+[\d.]+\s+[\d.]+$", run.stdout, re.M))
    assert sorted(rows) == ["frozen", "tracked"]
    assert int(rows["tracked"]) >= 3 * 3000 > 6 * int(rows["frozen"])  # what the collector walks
    lines = run.stdout.strip().splitlines()[-2:]
    assert [re.sub(r"= [\d.]+$", "= X", line) for line in lines] == [
        "ratio gc-full-tracked/gc-full-frozen = X",
        "ratio gc-longest-pause-tracked/gc-longest-pause-frozen = X",
    ]


def test_sizes_it_cannot_fill_are_refused() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--size", "0"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "--size from 1 to" in run.stderr
