"""``bench/report.py`` (``kvsp bench``): the report's tables and plots from benchmark results,
and a real quick run of one benchmark through ``kvsp bench``."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from tests.support import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KVSP = [sys.executable, "-m", "kvsp"]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    length, kind = struct.unpack("!I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR"), f"{path}: no IHDR chunk first"
    width, height = struct.unpack("!II", data[16:24])
    return width, height


def outcome(name: str, data: object) -> object:
    bench = next(b for b in report.BENCHMARKS if b.name == name)
    return report.Outcome(bench, [bench.script], 0, 1.0, f"{name} printed this", data)


def test_the_report_has_a_table_and_a_png_per_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots need the sim extra")
    moqt = {
        "paths": [
            {"path": "plain TCP stream", "mb_s": 900.0, "note": ""},
            {"path": "HTTP GET", "mb_s": 300.0, "note": ""},
            {"path": "relay", "mb_s": 0.0, "note": "failed: no relay"},
        ],
        "moqt": [{"backend": "qh3", "datagram": 1452, "moqt_mb_s": 120.0, "raw_mb_s": 150.0}],
    }
    index = {
        "records": 1000,
        "prompt_keys": 10,
        "results": [
            {"name": "HTTP compact", "seconds": [0.002, 0.001, 0.004], "answer_bytes": 9},
            {"name": "in-process", "seconds": [0.0001, 0.0002], "answer_bytes": 0},
        ],
    }
    ttft = {
        "rows": [
            {"tokens": t, "cached": c, "recompute_s": t / 1000, "http_load_s": t * (1 - c) / 900}
            for t in (512, 1024)
            for c in (0.0, 0.5, 0.95)
        ]
    }
    outcomes = [outcome("moqt", moqt), outcome("index", index), outcome("ttft", ttft)]
    failed = outcome("keys", None)
    failed.status = 1  # type: ignore[attr-defined]
    written = report.write_report([*outcomes, failed], tmp_path, quick=True)

    text = written.read_text()
    assert "| HTTP GET | 300.00 |  |" in text
    assert "| MOQT FETCH vs raw QUIC, qh3 1452 B datagrams: MOQT | 120.00 |  |" in text
    assert "| HTTP compact | 3 | 428.57 | 2.00 | 4.00 | 4.00 |" in text  # 3 lookups in 7 ms
    assert "| 1024 | 50% | 1,024 | 568.89 |" in text
    assert "| keys | Block-key chain (§4.2) | exit 1 | 1.00 | 0.00 |" in text
    for png in ("goodput_by_transport", "lookup_latency_cdf", "ttft_vs_prompt_length"):
        assert f"![{png}]({png}.png)" in text
        width, height = png_size(tmp_path / f"{png}.png")
        assert width > 300 and height > 200


def test_a_benchmark_without_results_is_said_so_and_the_report_is_still_written(
    tmp_path: Path,
) -> None:
    empty = outcome("index", None)
    written = report.write_report([empty], tmp_path, quick=False)
    text = written.read_text()
    assert "`bench_index.py` wrote no --json results" in text
    assert "Not run (`--only` left out `moqt`)." in text
    assert "index printed this" in text
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.slow
def test_kvsp_bench_quick_runs_a_benchmark_and_plots_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots need the sim extra")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsp",
            "bench",
            "--quick",
            "--only",
            "index",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "report.md").read_text()
    assert "| index | Index Service lookups (§6.1-6.2) | ok | " in text
    assert "100-key prompts over" in text
    rows = [line for line in text.splitlines() if line.startswith("| HTTP compact (raw bytes) |")]
    assert len(rows) == 1 and int(rows[0].split("|")[2]) == 20  # 20 compact lookups timed
    width, height = png_size(tmp_path / "lookup_latency_cdf.png")
    assert width > 300 and height > 200
