"""``bench/gpu_check.py`` runs on the CPU too: small settings, JSON summary, checks pass."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from bench import gpu_check  # noqa: E402


def test_gpu_check_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--device", "cpu", "--blocks", "4", "--layers", "4", "--kv-heads", "2"]
    argv += ["--head-dim", "16", "--reps", "1", "--prefix", "2"]
    assert gpu_check.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["device"] == "cpu"
    assert report["tiny_model"]["exact"] and report["tiny_model"]["greedy_equal"]
    assert report["sink"]["pages_equal_source"] and report["sink"]["gbps_verified"] > 0
    assert report["overlap"]["overlapped_s"] > 0
