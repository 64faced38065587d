"""The engine -> HTTP process hand-off (issue 23, item 4): every message waiting on the engine's output pipe is
applied in one reader callback (several steps cost the event loop one wake-up), and a consumer that fell behind
gets each request's latest cumulative output once, decoded once, not every intermediate one."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from metainfer.entrypoints.openai.engine_loop import EngineLoop, RequestGroup, RequestState
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.sampling_params import SamplingParams

STATS = (0,) * 12


class _Tokenizer:
    """Token i decodes to the letter chr(97 + i): a reference anyone can check by hand."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return "".join(chr(97 + i) for i in ids)


def _loop(tokenizer=None, handle=None) -> EngineLoop:
    return EngineLoop(handle, tokenizer or _Tokenizer(), ServerMetrics())


def _state(loop: EngineLoop, group: RequestGroup, rid: str) -> RequestState:
    state = RequestState(rid, None, [1, 2], SamplingParams(max_tokens=8), group.queue, 0.0)
    loop._requests[rid] = state
    return state


def _delta(ids, finished=False):
    return [(list(ids), None, None, "length" if finished else None, None, None)]


def test_a_consumer_behind_gets_each_requests_latest_output_once():
    async def run():
        loop = _loop()
        group = RequestGroup(loop, ["a", "b"])
        a, b = _state(loop, group, "a"), _state(loop, group, "b")
        for state, ids, finished in ((a, [0], False), (b, [0], False), (a, [1], False), (a, [2], False),
                                     (b, [1], True)):
            state.apply(finished, 0, _delta(ids, finished))
            group.queue.put_nowait(state)
        gen = group.outputs()
        first = [await gen.__anext__(), await gen.__anext__()]
        assert [(o.request_id, o.outputs[0].token_ids, o.outputs[0].text) for o in first] == [
            ("a", [0, 1, 2], "abc"), ("b", [0, 1], "ab")]
        assert group.unfinished == {"a"} and loop.num_queued == 0
        for ids, finished in (([3], False), ([4], True)):
            a.apply(finished, 0, _delta(ids, finished))
            group.queue.put_nowait(a)
        last = [o async for o in gen]
        assert [(o.request_id, o.outputs[0].text, o.finished) for o in last] == [("a", "abcde", True)]

    asyncio.run(run())


def test_an_error_after_outputs_is_raised_once_they_are_yielded():
    async def run():
        loop = _loop()
        group = RequestGroup(loop, ["a"])
        a = _state(loop, group, "a")
        a.apply(False, 0, _delta([0]))
        group.queue.put_nowait(a)
        group.queue.put_nowait(RuntimeError("step failed"))
        seen = []
        with pytest.raises(RuntimeError, match="step failed"):
            async for o in group.outputs():
                seen.append(len(o.outputs[0].token_ids))
        assert seen == [1] and not group.unfinished

    asyncio.run(run())


def test_sends_while_a_flush_is_pending_schedule_no_second_wake_up():
    """Three steps' messages wait on the pipe: one reader callback applies them all, the request is queued three
    times but decoded once when the consumer reads it, and the metrics see every token."""
    class Handle:
        outputs, sender = mp.Pipe(duplex=False)

    async def run():
        tokenizer = _Tokenizer()
        loop = _loop(tokenizer, Handle)
        loop._loop = asyncio.get_running_loop()
        group = RequestGroup(loop, ["a"])
        _state(loop, group, "a")
        for ids, finished in (([0], False), ([1], False), ([2], True)):
            Handle.sender.send(("step", [("a", finished, 0, None, _delta(ids, finished))], STATS))
        loop._on_readable()
        assert group.queue.qsize() == 3 and not Handle.outputs.poll() and not loop._requests
        outs = [o async for o in group.outputs()]
        assert [(o.outputs[0].text, o.finished) for o in outs] == [("abc", True)]
        assert tokenizer.calls == 1  # the finished choice: its one full decode, no per-token decodes
        assert loop.metrics.itl.count == 2 and loop.metrics.ttft.count == 1

    asyncio.run(run())
