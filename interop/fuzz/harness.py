"""The driver behind ``interop/fuzz/atheris_fuzz.py``: atheris when it is installed, else a
plain random-mutation loop over the same target and seeds.

atheris (coverage-guided, libFuzzer underneath) is not a dependency of this project. Install it
beside the venv to use it, for example::

    .venv/bin/python -m pip install --target /tmp/atheris_pkgs atheris
    PYTHONPATH=/tmp/atheris_pkgs .venv/bin/python interop/fuzz/atheris_fuzz.py container \\
        -max_total_time=180 -max_len=4096

Without atheris (or with ``--plain``) the loop mutates the seeds with byte-level operators
(bit flips, interesting integers, insertions, deletions, duplications, splices with other
seeds and with earlier inputs that parsed) for ``--seconds`` or ``--runs``, and prints the
executions, the rate, and each distinct finding: an exception the target is not allowed to
raise, saved with its input under ``--crashes`` (default ``fuzz-crashes/``).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from .targets import TARGETS, Target

INTERESTING = (
    b"\x00",
    b"\xff",
    b"\x7f",
    b"\x80",
    b"\x3f",
    b"\x40\x00",
    b"\x7f\xff",
    b"\xbf\xff\xff\xff",
    b"\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\x80\x00\x00\x00",
    b"\x00\x00\x01\x00\x00\x00\x00\x00",
    b"\xc0\x00\x00\x01\x00\x00\x00\x00",
    b"KVB1",
    b'"',
    b"[",
    b"{",
    b"}",
    b"]",
    b"\\",
    b"-1",
    b"1e400",
    b"null",
    b"9" * 40,
    "\u00e9".encode(),
    b"\xed\xa0\x80",
)
"""Values that often sit on a boundary: varint prefixes, 32/64-bit extremes, JSON syntax."""


class Mutator:
    """Byte-level mutations of a corpus, driven by one seeded ``random.Random``."""

    def __init__(self, seeds: Sequence[bytes], rng: random.Random, max_len: int) -> None:
        self.corpus = [bytes(s) for s in seeds]
        self.rng = rng
        self.max_len = max_len

    def mutate(self) -> bytes:
        """A new input: one corpus entry with 1–6 stacked mutations."""
        data = bytearray(self.rng.choice(self.corpus))
        for _ in range(self.rng.randint(1, 6)):
            self._once(data)
        return bytes(data[: self.max_len])

    def keep(self, data: bytes) -> None:
        """Add an input that parsed to the corpus (bounded, oldest dropped first)."""
        self.corpus.append(data)
        if len(self.corpus) > 512:
            del self.corpus[len(self.corpus) // 8]

    def _once(self, data: bytearray) -> None:
        rng = self.rng
        kind = rng.randrange(8)
        pos = rng.randrange(len(data) + 1)
        if kind == 0 and data:
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 2:
            value = rng.choice(INTERESTING)
            data[pos : pos + len(value)] = value
        elif kind == 3:
            data[pos:pos] = rng.choice(INTERESTING)
        elif kind == 4 and data:
            end = min(len(data), pos + rng.randint(1, 32))
            del data[pos:end]
        elif kind == 5 and data:
            start = rng.randrange(len(data))
            piece = data[start : start + rng.randint(1, 64)]
            data[pos:pos] = piece
        elif kind == 6:
            other = rng.choice(self.corpus)
            cut = rng.randrange(len(other) + 1)
            data[pos:] = other[cut:]
        else:
            del data[pos:]


def run_plain(
    target: Target,
    seeds: Sequence[bytes],
    *,
    seconds: float,
    runs: int | None,
    seed: int,
    max_len: int,
    crashes: Path,
    report: Callable[[str], None] = print,
) -> tuple[int, dict[str, bytes]]:
    """Mutate ``seeds`` and call ``target`` until ``seconds`` pass or ``runs`` inputs ran.

    Returns:
        The number of executions and the distinct findings (by exception type and the line
        that raised it), each with the first input that produced it.
    """
    mutator = Mutator(seeds, random.Random(seed), max_len)
    findings: dict[str, bytes] = {}
    deadline = time.monotonic() + seconds
    executions = 0
    for data in [*seeds]:
        _call(target, data, findings, crashes, report)
        executions += 1
    while time.monotonic() < deadline and (runs is None or executions < runs):
        data = mutator.mutate()
        if _call(target, data, findings, crashes, report) and executions % 7 == 0:
            mutator.keep(data)
        executions += 1
    return executions, findings


def _call(
    target: Target,
    data: bytes,
    findings: dict[str, bytes],
    crashes: Path,
    report: Callable[[str], None],
) -> bool:
    """Run one input; record a finding. Whether the input parsed or was refused cleanly."""
    try:
        target(data)
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{type(exc).__name__} at {Path(frame.filename).name}:{frame.lineno}"
        if where not in findings:
            findings[where] = data
            crashes.mkdir(parents=True, exist_ok=True)
            name = crashes / f"crash-{hashlib.sha256(data).hexdigest()[:16]}"
            name.write_bytes(data)
            report(f"FINDING {where}: {exc!r:.300} (input saved to {name})")
        return False
    return True


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("target", choices=list(TARGETS), help="the parser to fuzz")
    parser.add_argument("--plain", action="store_true", help="the random loop even with atheris")
    parser.add_argument("--seconds", type=float, default=60.0, help="plain loop: time budget")
    parser.add_argument("--runs", type=int, default=None, help="plain loop: most executions")
    parser.add_argument("--seed", type=int, default=1, help="plain loop: random seed")
    parser.add_argument("--max-len", type=int, default=4096, help="plain loop: longest input")
    parser.add_argument("--crashes", type=Path, default=Path("fuzz-crashes"))
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Fuzz the target named first in ``argv`` (see :data:`~interop.fuzz.targets.TARGETS`);
    exit status 1 on a finding. Arguments this driver does not know go to libFuzzer
    (``-max_total_time=N``)."""
    args, rest = _parse_args(sys.argv[1:] if argv is None else argv)
    name = args.target
    target, make_seeds = TARGETS[name]
    seeds = make_seeds()
    if not args.plain:
        try:
            import atheris  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            print(f"{name}: atheris is not installed; running the plain random-mutation loop")
        else:
            return _run_atheris(atheris, target, seeds, rest)
    start = time.monotonic()
    executions, findings = run_plain(
        target,
        seeds,
        seconds=args.seconds,
        runs=args.runs,
        seed=args.seed,
        max_len=args.max_len,
        crashes=args.crashes,
    )
    elapsed = time.monotonic() - start
    rate = executions / elapsed if elapsed else 0.0
    print(
        f"{name}: {executions} executions in {elapsed:.1f} s ({rate:.0f}/s), "
        f"{len(findings)} distinct findings"
    )
    return 1 if findings else 0


def _run_atheris(atheris: object, target: Target, seeds: Sequence[bytes], rest: list[str]) -> int:
    """Hand the target to atheris; the seeds go into a fresh corpus folder it reads first."""
    import tempfile

    corpus = Path(tempfile.mkdtemp(prefix="kvsp-fuzz-corpus-"))
    for i, data in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(data)
    setup = getattr(atheris, "Setup")  # noqa: B009 - an untyped module
    fuzz = getattr(atheris, "Fuzz")  # noqa: B009
    setup([sys.argv[0], *rest, str(corpus)], target)
    fuzz()
    return 0
