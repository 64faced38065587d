"""Python's cyclic collector and CUDA-graph capture: a collection inside a capture may destroy graphs that only a
reference cycle kept alive, which CUDA forbids while a stream captures (the capture fails and the process aborts).
So the capture collects first and pauses the collector (`no_gc_during_capture`). CPU checks here; a re-capture of
every graph on a GPU is in test_piecewise_graphs.py."""

from __future__ import annotations

import gc

import pytest

from metainfer.worker.cuda_graphs import no_gc_during_capture


class _Cyclic:
    """Garbage only the cyclic collector frees; records whether the collector was on when it was freed."""

    freed_with_gc_enabled: list[bool] = []

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cyclic.freed_with_gc_enabled.append(gc.isenabled())


def test_collects_cyclic_garbage_first_then_pauses_the_collector():
    gc.disable()  # no automatic collection between making the garbage and entering the guard
    try:
        _Cyclic.freed_with_gc_enabled = []
        _Cyclic()  # unreachable at once, freed only by a collection
        gc.enable()
        with no_gc_during_capture():
            assert _Cyclic.freed_with_gc_enabled == [True], "garbage must be collected before the capture starts"
            assert not gc.isenabled(), "no automatic collection may run inside a capture"
    finally:
        gc.enable()
    assert gc.isenabled()


def test_restores_a_disabled_collector_as_disabled():
    gc.disable()
    try:
        with no_gc_during_capture():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_restores_the_collector_when_the_capture_raises():
    with pytest.raises(RuntimeError, match="capture failed"):  # the error goes on to the caller
        with no_gc_during_capture():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
