"""``bench/bench_relay_upkeep.py`` runs, and its two variants (the relay's deadline heaps and
the scans they replaced) name the same records due over the same cache."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_relay_upkeep.py"


def test_the_upkeep_bench_compares_the_heaps_with_the_scans() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--blocks", "200,400", "--due", "3", "--passes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = re.findall(r"^\s*(\d+)\s+(scan|heap)\s+[\d.]+\s+(\d+)$", run.stdout, re.M)
    assert sorted(rows) == sorted(
        (size, variant, "3") for size in ("200", "400") for variant in ("scan", "heap")
    )
    lines = run.stdout.strip().splitlines()[-2:]
    assert [re.sub(r"= [\d.]+$", "= X", line) for line in lines] == [
        "ratio upkeep-scan/upkeep-heap 200 blocks = X",
        "ratio upkeep-scan/upkeep-heap 400 blocks = X",
    ]
