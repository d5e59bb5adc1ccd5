"""Fuzz the JSON record parsers by hand (``interop/fuzz/harness.py`` says how).

With atheris installed beside the venv (coverage-guided), or without it (the plain loop)::

    PYTHONPATH=/tmp/atheris_pkgs .venv/bin/python interop/fuzz/atheris_records.py \\
        -max_total_time=180 -max_len=4096
    .venv/bin/python interop/fuzz/atheris_records.py --plain --seconds 180
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # interop/ is a folder of tools

try:
    import atheris  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    instrumented: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
else:  # coverage feedback for the library's own modules only
    instrumented = atheris.instrument_imports(include=["kvsp", "moqt"])

with instrumented:
    from interop.fuzz.harness import main

if __name__ == "__main__":
    sys.exit(main("records"))
