"""The start-up heap of a served app leaves the cyclic collector's sight once it serves
(:func:`kvsp.web.runner.freeze_startup_heap`), in a process of its own (real socket, signal)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from kvsp.web.runner import freeze_startup_heap

SERVE = """
import asyncio, gc, os, signal
from kvsp.web.runner import ServeConfig, serve_async

async def app(scope, receive, send):
    raise RuntimeError("not called")

def serving(url):
    print(gc.get_freeze_count(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

assert gc.get_freeze_count() == 0
asyncio.run(serve_async(app, ServeConfig(), on_serving=serving))
print("stopped", flush=True)
"""


def test_a_service_freezes_its_heap_once_it_serves() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SERVE], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    frozen, stopped = done.stdout.split()
    assert int(frozen) > 1000 and stopped == "stopped"


class Node:
    """A reference cycle's member."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("collect", [False, True])
def test_collect_first_frees_the_garbage_instead_of_keeping_it(collect: bool) -> None:
    gc.disable()  # no collection between making the garbage and freezing
    try:
        garbage = weakref.ref(Node())  # unreachable, alive only through its own cycle
        freeze_startup_heap(collect=collect)
        later = weakref.ref(Node())
        gc.collect()
        assert (garbage() is None) is collect  # frozen garbage is never collected
        assert later() is None  # what comes after the freeze is collected as before
    finally:
        gc.unfreeze()
        gc.enable()
        gc.collect()
