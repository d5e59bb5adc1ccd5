"""``bench/bench_relay_floor.py`` runs: FETCHes straight from the publisher, through three byte
forwarders and through ``relay.app``, in turns, and the five ratio lines last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_relay_floor.py"

pytestmark = pytest.mark.timeout(180)


def test_the_floor_bench_measures_every_path_and_prints_its_ratios() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--seconds", "0.4", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=170,
        check=True,
    )
    row = r"^(direct|pipe|hash|floor|relay-miss), QMux UDS.*?\s[\d.]+ MB/s\s+cpu ms/block [\d.]+"
    assert re.findall(row, run.stdout, re.M) == ["direct", "pipe", "hash", "floor", "relay-miss"]
    assert "failed" not in run.stdout
    lines = run.stdout.strip().splitlines()[-5:]
    assert [re.sub(r"= [\d.]+$", "= X", line) for line in lines] == [
        "ratio pipe/direct = X",
        "ratio hash/direct = X",
        "ratio floor/direct = X",
        "ratio relay-miss/direct = X",
        "ratio relay-miss/floor = X",
    ]
    assert all(float(line.rsplit("= ", 1)[1]) > 0 for line in lines)
