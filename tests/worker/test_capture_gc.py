"""Python's cyclic collector and CUDA-graph capture: a collection inside a capture may destroy graphs that only a
reference cycle kept alive, which CUDA forbids while a stream captures (the capture is invalidated, the process
aborts). So the capture pauses the collector after collecting (`no_gc_during_capture`), and the piecewise graphs'
pieces hold their owner without a cycle. CPU checks here; the re-capture itself on a GPU is in
test_piecewise_graphs.py."""

from __future__ import annotations

import gc
import weakref

from metainfer.worker.cuda_graphs import no_gc_during_capture
from metainfer.worker.piecewise_graphs import _EagerAttention, _Split


class _Cyclic:
    """Garbage only the cyclic collector frees; records whether the collector was on when it was freed."""

    freed_with_gc_enabled: list[bool] = []

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cyclic.freed_with_gc_enabled.append(gc.isenabled())


def test_collects_cyclic_garbage_first_then_pauses_the_collector():
    _Cyclic.freed_with_gc_enabled = []
    _Cyclic()  # unreachable at once, freed only by a collection
    assert gc.isenabled()
    with no_gc_during_capture():
        assert _Cyclic.freed_with_gc_enabled == [True], "garbage must be collected before the capture starts"
        assert not gc.isenabled()
        _Cyclic()
        gc.collect(0)  # an explicit call still works; the automatic ones are what is paused
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
    try:
        with no_gc_during_capture():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()


class _Owner:
    """Stands in for PiecewiseGraphs: its pieces hold the attention segments and the split."""

    def __init__(self):
        self.pieces = [_EagerAttention(self, layer=None)]
        self.split = _Split(self)


def test_pieces_hold_their_owner_without_a_cycle():
    owner = _Owner()
    assert owner.pieces[0].owner.pieces is owner.pieces  # the segment still reads its owner
    ref = weakref.ref(owner)
    gc.disable()
    try:
        del owner
        assert ref() is None, "the owner must be freed by reference counting, not left to the cyclic collector"
    finally:
        gc.enable()
