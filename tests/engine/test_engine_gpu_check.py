"""``bench/gpu_check.py`` runs on the CPU too: small settings, JSON summary, checks pass."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--device", "cpu", "--blocks", "4", "--layers", "4", "--kv-heads", "2"]
    argv += ["--head-dim", "16", "--reps", "1", "--prefix", "2"]
    assert module.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["device"] == "cpu"
    assert report["tiny_model"]["exact"] and report["tiny_model"]["greedy_equal"]
    assert report["sink"]["pages_equal_source"] and report["sink"]["gbps_verified"] > 0
    assert report["overlap"]["overlapped_s"] > 0
