"""``kvsp sim`` (kvsp/sim/cli.py): tables, summary.json, the CDF plot, and typed errors."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from kvsp.errors import BadRequest
from kvsp.sim.cli import add_sim_command
from kvsp.sim.trace import TraceError

B = 512


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvsp")
    add_sim_command(parser.add_subparsers())
    return parser.parse_args(["sim", *argv])


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    lines = []
    for n in range(30):
        ids = [0, 1, 2, *range(100 + 10 * n, 100 + 10 * n + n % 5)]
        length = len(ids) * B - 7
        lines.append(
            json.dumps(
                {"timestamp": 200 * n, "input_length": length, "output_length": 3, "hash_ids": ids}
            )
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_all_policies_print_a_table_and_write_a_summary(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = _parse("--trace", str(trace), "--instances", "2", "--beyond-spec", "--out", str(out))
    assert args.handler(args) == 0
    text = capsys.readouterr().out
    for name in ("random", "least-loaded", "local-cache-aware", "kvsp", "kvsp-backlog"):
        assert f"\n{name} " in text
    assert "average TTFT kvsp / random:" in text
    (report,) = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert report["requests"] == 30 and report["config"]["instances"] == 2
    assert [p["policy"] for p in report["policies"]][-1] == "kvsp-backlog"
    pytest.importorskip("matplotlib")
    assert (out / "ttft_cdf_tiny.png").stat().st_size > 1000


def test_without_matplotlib_the_plot_is_skipped(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = _parse("--trace", str(trace), "--policy", "random,kvsp", "--out", str(tmp_path))
    assert args.handler(args) == 0
    assert "no plot: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "ttft_cdf_tiny.png").exists()


def test_auto_instances_follow_the_no_reuse_work(trace: Path, tmp_path: Path) -> None:
    args = _parse(
        "--trace",
        str(trace),
        "--policy",
        "random",
        "--instances",
        "auto",
        "--out",
        str(tmp_path),
        "--limit",
        "10",
    )
    assert args.handler(args) == 0
    (report,) = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert report["requests"] == 10 and report["config"]["instances"] >= 1


def test_a_bad_trace_line_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 5}\n',
        encoding="utf-8",
    )
    args = _parse("--trace", str(path), "--out", str(tmp_path))
    with pytest.raises(TraceError) as info:
        args.handler(args)
    assert info.value.line == 2


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("--policy", "kvsp-backlog"), "--beyond-spec"),
        (("--policy", "nope"), "unknown policy"),
        (("--instances", "many"), "--instances"),
    ],
)
def test_bad_arguments_are_typed_errors(
    trace: Path, tmp_path: Path, argv: tuple[str, ...], words: str
) -> None:
    args = _parse("--trace", str(trace), "--out", str(tmp_path), *argv)
    with pytest.raises(BadRequest, match=words):
        args.handler(args)


def test_the_papers_ratio_is_printed_beside_the_conversation_trace(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    named = tmp_path / "conversation_trace.jsonl"
    named.write_bytes(trace.read_bytes())
    args = _parse("--trace", str(named), "--policy", "random,kvsp", "--out", str(tmp_path / "o"))
    assert args.handler(args) == 0
    text = capsys.readouterr().out
    assert "average TTFT kvsp / random:" in text
    assert "global cache-aware / random on this trace: 3.07 s / 19.65 s = 0.156" in text
    args = _parse("--trace", str(trace), "--policy", "random", "--out", str(tmp_path / "p"))
    assert args.handler(args) == 0
    assert "global cache-aware" not in capsys.readouterr().out
