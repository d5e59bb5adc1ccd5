"""Fuzz one of KVSP's parsers by hand: ``atheris_fuzz.py TARGET [options]``.

TARGET names an entry of ``targets.TARGETS``: ``container`` (KVB1, spec §4.3), ``records``
(the JSON records, §4.4), ``moqt_control`` (MOQT control messages), ``moqt_data`` (MOQT
stream and datagram objects) or ``moqt_qmux`` (a client's octets of a MOQT session over QMux).
``interop/fuzz/harness.py`` says how the driver runs. With atheris installed beside the venv
(coverage-guided), or without it (the plain loop)::

    PYTHONPATH=/tmp/atheris_pkgs .venv/bin/python interop/fuzz/atheris_fuzz.py container \\
        -max_total_time=180 -max_len=4096
    .venv/bin/python interop/fuzz/atheris_fuzz.py records --plain --seconds 180

atheris instruments only the modules imported inside its ``with`` block, so the harness, and
through it the library, is imported there; the target is chosen from the command line after.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # interop/ is a folder of tools

try:
    import atheris  # type: ignore[import-not-found,import-untyped,unused-ignore]
except ImportError:
    instrumented: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
else:  # coverage feedback for the library's own modules only
    instrumented = atheris.instrument_imports(include=["kvsp", "moqt"])

with instrumented:
    from interop.fuzz.harness import main

if __name__ == "__main__":
    sys.exit(main())
